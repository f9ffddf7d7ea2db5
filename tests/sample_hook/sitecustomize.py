"""Test-only: record which training frames a real `opentau train` / `opentau resume` launch reads.

Put this directory on PYTHONPATH and set TEST_RECORD_SAMPLES=DIR: every process that reads frames appends each index
it reads to DIR/rank<RANK>.txt, one per line, in the order read (the demo config loads in the rank's own process,
dataset.num_workers=0, so reads happen exactly as batches are consumed). Python processes without the variable are
untouched.
"""

from __future__ import annotations

import os


def _install(directory: str) -> None:
    from pathlib import Path

    from opentau_cli.data.dataset import LeRobotDataset

    out = Path(directory) / f"rank{os.environ.get('RANK', '0')}.txt"
    read = LeRobotDataset.__getitem__

    def recorded(self, idx):
        with open(out, "a") as f:
            f.write(f"{int(idx)}\n")
        return read(self, idx)

    LeRobotDataset.__getitem__ = recorded


if os.environ.get("TEST_RECORD_SAMPLES"):
    _install(os.environ["TEST_RECORD_SAMPLES"])
