"""The pickle scan that resume runs before any library loader: foreign globals are refused, nothing is executed.

(The end-to-end `opentau resume` refusal is tested on a real run in test_consolidate_pi05.py.)"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from opentau_cli.store.pickle_scan import UnsafePickleError, scan_checkpoint_pickles, scan_pickle_file

pytestmark = pytest.mark.full


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_scan_refuses_foreign_globals_in_torch_zip_and_plain_pickles_without_running_them(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"rng": _Evil(marker)}, tmp_path / "a.pt")
    (tmp_path / "b.pkl").write_bytes(pickle.dumps([1, _Evil(marker)]))
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "ok.bin")
    for name in ("a.pt", "b.pkl"):
        with pytest.raises(UnsafePickleError, match="system"):
            scan_pickle_file(tmp_path / name)
    scan_pickle_file(tmp_path / "ok.bin")
    assert len(scan_checkpoint_pickles(tmp_path)) == 2
    assert not marker.exists()
