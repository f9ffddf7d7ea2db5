"""Resume never unpickles what the checkpoint's manifest does not vouch for, nor a pickle with foreign globals."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from conftest import EXAMPLES, run_cli
from opentau_cli.checkpoint.manifest import write_manifest
from opentau_cli.checkpoint.pickle_scan import UnsafePickleError, scan_checkpoint_pickles, scan_pickle_file

pytestmark = pytest.mark.e2e


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


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("sec") / "run"
    env = {"HF_HOME": str(run.parent / "hf"), "OPENTAU_CACHE_DIR": str(EXAMPLES.parents[1] / ".cache" / "opentau")}
    res = run_cli(["train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={run}",
                   "--steps=2", "--save_freq=2", "--validation.val_freq=1000"], env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return run, env


@pytest.mark.parametrize("forge_manifest", [False, True], ids=["tampered", "tampered_with_forged_manifest"])
def test_resume_refuses_a_planted_malicious_pickle_and_never_runs_it(trained, tmp_path, forge_manifest):
    import shutil

    src, env = trained
    run = tmp_path / "run"
    shutil.copytree(src, run, symlinks=True)
    ckpt = run / "checkpoints" / "000002"
    marker = tmp_path / "pwned"
    rng = next(ckpt.glob("random_states_*.pkl"))  # Accelerate unpickles this with plain pickle on load_state
    torch.save({"step": _Evil(marker)}, rng)
    if forge_manifest:  # an attacker who can also rewrite manifest.json: the pickle scan still refuses
        write_manifest(ckpt)
    res = run_cli(["resume", str(ckpt), "--steps=3"], env=env)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert not marker.exists()
    assert "Traceback" not in res.stderr
    assert (rng.name in res.stderr) and ("system" in res.stderr if forge_manifest else "manifest" in res.stderr)
