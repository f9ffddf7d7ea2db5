"""SIGKILL at six moments of a save (real CheckpointManager, real Accelerator; the moments strike at the save's named
fault points, tests/save_faults.py): the previous checkpoint stays complete and verifiable, nothing incomplete passes
as a checkpoint, and resuming gives the uninterrupted weights. Every test runs for synchronous saves and for
checkpoint.async_save's (where the moments strike in the background writer and a failure surfaces at a later step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opentau_cli.cli.main import app
from opentau_cli.store.layout import CHECKPOINTS, LAST, read_last, step_of
from opentau_cli.store.manifest import is_complete, verify_manifest
from opentau_cli.store.runs import latest

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_save_driver import MOMENTS  # noqa: E402

pytestmark = [pytest.mark.full, pytest.mark.slow]  # a minute or more: starts first (tests/conftest.py)


@pytest.fixture(scope="module", params=["sync", "async"])
def killed_runs(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("faults")
    mode = ["--async-save"] if request.param == "async" else []
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "ckpt_save_driver.py"), str(root), *mode],
                          capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["run"]: r for r in map(json.loads, proc.stdout.splitlines())}
    return root, results


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigkill_during_save_leaves_previous_checkpoint_intact_and_resume_matches(killed_runs, moment):
    root, results = killed_runs
    assert results[moment]["killed"], "the run was not killed at that moment"
    ckpts = root / f"{moment}.killed" / CHECKPOINTS

    # Nothing looks complete that is not: every step dir either verifies fully or is not complete.
    steps = [d for d in ckpts.iterdir() if step_of(d.name) is not None]
    for d in steps:
        assert not is_complete(d) or verify_manifest(d) == [], d
    assert all(is_complete(d) for d in steps), "a kill must never leave a half-written or half-deleted step dir"
    newest = latest(ckpts.parent)
    assert newest is not None and newest.name in ("000002", "000003") and verify_manifest(newest) == []
    assert is_complete(ckpts / read_last(ckpts))
    # The user-facing check agrees: exit 0, leftovers reported as notes.
    res = CliRunner().invoke(app, ["checkpoint", "verify", str(ckpts.parent)])
    assert res.exit_code == 0, res.stdout

    # Resuming (leftovers cleaned, newest complete checkpoint) ends with the uninterrupted run's exact weights.
    assert results[moment]["resumed_from"] == newest.name
    assert results[moment]["weights"] == results["reference"]["weights"]
    after = root / moment / CHECKPOINTS
    assert not [p for p in after.iterdir() if p.name.startswith(".")], "leftovers were not cleaned up"
    # keep_last=2, except that the checkpoint resumed from is never deleted by the run that resumed from it.
    kept = {p.name for p in after.iterdir() if step_of(p.name) is not None}
    assert kept == {"000003", "000004", newest.name}


@pytest.mark.parametrize("variant", ["disk_full_model", "disk_full_optimizer"])
def test_disk_full_during_save_stops_with_clear_message_and_keeps_previous_checkpoint(killed_runs, variant):
    root, results = killed_runs
    error = results[variant].get("error", "")
    assert "RunError" in error and "step 3" in error and "disk is full" in error, error
    assert "previous checkpoint" in error and "000002" in error and "intact" in error
    ckpts = root / variant / CHECKPOINTS
    assert sorted(p.name for p in ckpts.iterdir()) == ["000001", "000002", LAST]  # no temp dir left behind
    assert verify_manifest(ckpts / "000002") == [] and read_last(ckpts) == "000002"
