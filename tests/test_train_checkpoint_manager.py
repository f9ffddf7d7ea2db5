"""CheckpointManager's save path with a fake accelerator (one process): publish, retention, failures, lookup."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from opentau_cli.errors import RunError, UserError
from opentau_cli.store import faults
from opentau_cli.store.layout import (
    CHECKPOINTS, LAST, MANIFEST, MODEL_WEIGHTS, OPTIMIZER, TRAIN_CONFIG, TRAINING_STATE, leftover_of, old_dir,
    read_last, step_dir_name, tmp_dir,
)
from opentau_cli.store.manifest import is_complete, verify_manifest
from opentau_cli.store.runs import clean_leftovers, find_checkpoint, latest
from opentau_cli.train.manager import CheckpointManager

pytestmark = pytest.mark.quick


class FakeAccelerator:
    """Stands in for accelerate.Accelerator on one process; save_state writes a weights file like the real one."""

    is_main_process = True
    device = torch.device("cpu")
    num_processes = 1

    def __init__(self, fail_with: int | None = None):
        self.fail_with = fail_with
        self.saved = []

    def save_state(self, output_dir, safe_serialization=True):
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / MODEL_WEIGHTS).write_bytes(b"w" * 100)
        if self.fail_with is not None:
            raise OSError(self.fail_with, os.strerror(self.fail_with))
        (out / OPTIMIZER).write_bytes(b"o" * 50)
        self.saved.append(out)

    def wait_for_everyone(self):
        pass

    def reduce(self, tensor, reduction="sum"):
        return tensor


def manager(tmp_path, acc=None, **kw) -> CheckpointManager:
    return CheckpointManager(acc or FakeAccelerator(), tmp_path / "run", total_steps=kw.pop("total_steps", 100), run_id="r1", **kw)


def save(m: CheckpointManager, step: int) -> Path:
    return m.save(step, config={"steps": 100, "resume": False}, state={"step": step})


def names(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "run" / CHECKPOINTS).iterdir())


def test_step_dir_name_is_zero_padded_to_at_least_six_digits():
    assert step_dir_name(40, 100) == "000040"
    assert step_dir_name(40, 12_345_678) == "00000040"


def test_save_publishes_a_complete_checkpoint_and_points_last_at_it(tmp_path):
    m = manager(tmp_path)
    path = save(m, 40)
    assert path == tmp_path / "run" / CHECKPOINTS / "000040"
    assert verify_manifest(path) == []
    # Recorded relative to the run directory, so the record stays true when the run is moved.
    assert json.loads((path / TRAIN_CONFIG).read_text())["config_path"] == "checkpoints/000040/train_config.json"
    assert json.loads((path / TRAINING_STATE).read_text())["step"] == 40
    assert os.readlink(tmp_path / "run" / CHECKPOINTS / LAST) == "000040" == read_last(path.parent)
    assert names(tmp_path) == ["000040", LAST]  # no temp dir left behind


def test_saving_a_step_that_exists_replaces_it(tmp_path):
    m = manager(tmp_path)
    save(m, 40)
    (tmp_path / "run" / CHECKPOINTS / "000040" / "stale.txt").write_text("old")
    save(m, 40)
    assert not (tmp_path / "run" / CHECKPOINTS / "000040" / "stale.txt").exists()
    assert is_complete(tmp_path / "run" / CHECKPOINTS / "000040")
    assert names(tmp_path) == ["000040", LAST]


def test_keep_last_deletes_older_checkpoints_but_never_the_one_resumed_from(tmp_path):
    save(manager(tmp_path), 10)
    protect = tmp_path / "run" / CHECKPOINTS / "000010"
    m = manager(tmp_path, keep_last=2, protect=protect)
    for step in (20, 30, 40):
        save(m, step)
    assert names(tmp_path) == ["000010", "000030", "000040", LAST]


def test_keep_last_one_keeps_only_the_newest(tmp_path):
    m = manager(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        save(m, step)
    assert names(tmp_path) == ["000003", LAST]


@pytest.mark.parametrize("err, words", [(errno.ENOSPC, "disk is full"), (errno.EACCES, "not writable")])
def test_a_failed_save_says_why_and_leaves_the_previous_checkpoint_intact(tmp_path, err, words):
    save(manager(tmp_path), 10)
    m = manager(tmp_path, acc=FakeAccelerator(fail_with=err))
    with pytest.raises(RunError) as e:
        save(m, 20)
    assert words in str(e.value) and "000010 is intact" in str(e.value)
    assert names(tmp_path) == ["000010", LAST]  # the half-written temp dir is gone
    assert verify_manifest(tmp_path / "run" / CHECKPOINTS / "000010") == []
    assert os.readlink(tmp_path / "run" / CHECKPOINTS / LAST) == "000010"


def test_latest_skips_a_checkpoint_without_manifest(tmp_path):
    m = manager(tmp_path)
    save(m, 10)
    save(m, 20)
    (tmp_path / "run" / CHECKPOINTS / "000020" / MANIFEST).unlink()
    assert latest(tmp_path / "run") == tmp_path / "run" / CHECKPOINTS / "000010"
    assert find_checkpoint(tmp_path / "run") == (tmp_path / "run" / CHECKPOINTS / "000010").resolve()


def test_find_checkpoint_refuses_a_run_without_complete_checkpoints(tmp_path):
    (tmp_path / "run" / CHECKPOINTS / "000010").mkdir(parents=True)
    with pytest.raises(UserError, match="No complete checkpoint"):
        find_checkpoint(tmp_path / "run")
    with pytest.raises(UserError, match="does not exist"):
        find_checkpoint(tmp_path / "nope")


def test_clean_leftovers_removes_interrupted_saves_only(tmp_path):
    m = manager(tmp_path)
    save(m, 10)
    interrupted = tmp_dir(tmp_path / "run" / CHECKPOINTS, "000020", "x")
    interrupted.mkdir()
    (interrupted / MODEL_WEIGHTS).write_bytes(b"x")
    assert leftover_of(interrupted.name) == ("save", "000020")
    removed = clean_leftovers(tmp_path / "run")
    assert removed == [interrupted]
    assert names(tmp_path) == ["000010", LAST]


def test_a_save_reaches_every_named_fault_point_in_order(tmp_path, monkeypatch):
    """The points fault tests strike at (tests/save_faults.py) exist where a save passes: renaming or moving one
    fails here, not silently in a fault test."""
    m = manager(tmp_path, keep_last=1)
    save(m, 10)
    reached = []
    monkeypatch.setattr(faults, "hooks", [lambda name, path: reached.append((name, path.name))])
    save(m, 10)  # over an existing step: the stale one is hidden, then deleted
    save(m, 20)  # keep_last=1: step 10 is hidden, then deleted
    tmp10, tmp20 = (tmp_dir(m.root, n, "r1").name for n in ("000010", "000020"))
    old10 = old_dir(m.root, "000010", "r1").name
    first, second = reached[:7], reached[7:]
    assert [name for name, _ in first] == [name for name, _ in second] == [
        "state_saved", "json_synced", "json_synced", "json_synced", "publishing", "published", "retiring"]
    assert list(dict.fromkeys(name for name, _ in reached)) == list(faults.POINTS)
    assert [p for _, p in first] == [tmp10, TRAIN_CONFIG, TRAINING_STATE, MANIFEST, tmp10, "000010", old10]
    assert [p for _, p in second] == [tmp20, TRAIN_CONFIG, TRAINING_STATE, MANIFEST, tmp20, "000020", old10]
