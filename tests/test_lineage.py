"""A run's history in-process: lineage records, the branch `last` is on, rollbacks, and paths that travel."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import xxhash

from opentau_cli.config import load_config
from opentau_cli.config import paths as config_paths
from opentau_cli.config.paths import missing_paths, record_paths
from opentau_cli.errors import UserError
from opentau_cli.store import layout
from opentau_cli.store.layout import CHECKPOINTS, MANIFEST, METRICS, TRAIN_CONFIG, TRAINING_STATE, point_last, read_last
from opentau_cli.store.lineage import (
    LINEAGE, ROLLED_BACK, archive_of, current_branch, newer_checkpoints, resume_point, roll_back, rolled_back,
)
from opentau_cli.store.runs import find_checkpoint
from opentau_cli.train.manager import CheckpointManager

from test_train_checkpoint_manager import FakeAccelerator

pytestmark = pytest.mark.full


def manager(run: Path, run_id: str, parent: Path | None = None) -> CheckpointManager:
    return CheckpointManager(FakeAccelerator(), run, total_steps=100, run_id=run_id, parent=parent)


def save(m: CheckpointManager, step: int) -> Path:
    return m.save(step, config={"steps": 100, "resume": False, "output_dir": str(m.run_dir)}, state={"step": step})


def state(ckpt: Path) -> dict:
    return json.loads((ckpt / TRAINING_STATE).read_text())


def xxh3_of(path: Path) -> str:
    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


def test_each_checkpoint_names_its_parent_by_step_and_manifest_hash_and_the_launch_that_wrote_it(tmp_path):
    run = tmp_path / "run"
    m = manager(run, "launch-a")
    first, second = save(m, 10), save(m, 20)
    assert state(first)[LINEAGE] == {"parent": None, "launch": "launch-a"}
    assert state(second)[LINEAGE] == {
        "parent": {"step": 10, "name": "000010", "manifest_xxh3": xxh3_of(first / MANIFEST)}, "launch": "launch-a"}
    # A second launch resumed from 000010 records it as the parent of its first save.
    resumed = manager(run, "launch-b", parent=first)
    third = save(resumed, 30)
    assert state(third)[LINEAGE]["parent"]["name"] == "000010"
    assert state(third)[LINEAGE]["launch"] == "launch-b"


def test_the_current_branch_follows_parents_from_last_and_resume_continues_last_not_the_newest_step(tmp_path):
    run = tmp_path / "run"
    m = manager(run, "a")
    c10, c20, c30 = save(m, 10), save(m, 20), save(m, 30)
    # Another branch from 000010 whose newest save is older than 000030 (as an older opentau could leave a run).
    branch = manager(run, "b", parent=c10)
    c15 = save(branch, 15)
    assert read_last(run / CHECKPOINTS) == "000015"
    assert current_branch(run) == [c10, c15]
    assert resume_point(run) == c15
    assert find_checkpoint(run) == c15.resolve()
    assert newer_checkpoints(run, c15) == [c20, c30]


def test_a_replaced_parent_ends_the_branch_instead_of_adopting_the_impostor(tmp_path):
    run = tmp_path / "run"
    m = manager(run, "a")
    c10, c20 = save(m, 10), save(m, 20)
    manifest = json.loads((c10 / MANIFEST).read_text())
    manifest["note"] = "rewritten"
    (c10 / MANIFEST).write_text(json.dumps(manifest))
    assert current_branch(run) == [c20]


def test_checkpoints_without_lineage_form_one_linear_branch(tmp_path):
    run = tmp_path / "run"
    m = manager(run, "a")
    saved = [save(m, s) for s in (10, 20, 30)]
    for ckpt in saved:  # as written before lineage was recorded
        record = state(ckpt)
        record.pop(LINEAGE)
        (ckpt / TRAINING_STATE).write_text(json.dumps(record))
    assert current_branch(run) == saved


def test_a_rollback_moves_newer_checkpoints_and_their_metrics_aside_and_points_last_back(tmp_path):
    run = tmp_path / "run"
    m = manager(run, "a")
    c10, c20, c30 = save(m, 10), save(m, 20), save(m, 30)
    weights = {c.name: (c / layout.MODEL_WEIGHTS).read_bytes() for c in (c20, c30)}
    records = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in range(5, 35, 5)]
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))

    done = roll_back(run, c10, stamp="20261201-120000")

    into = run / ROLLED_BACK / "20261201-120000"
    assert sorted(p.name for p in (run / CHECKPOINTS).iterdir() if p.name[0].isdigit()) == ["000010"]
    assert read_last(run / CHECKPOINTS) == "000010"
    for name, data in weights.items():  # moved whole, nothing rewritten
        assert (into / CHECKPOINTS / name / layout.MODEL_WEIGHTS).read_bytes() == data
    assert [json.loads(x)["step"] for x in (run / METRICS).read_text().splitlines()] == [5, 10]
    assert [json.loads(x)["step"] for x in (into / METRICS).read_text().splitlines()] == [15, 20, 25, 30]
    assert [p.name for _, p in rolled_back(run)] == ["000020", "000030"]
    assert done.records == 4 and len(done.moved) == 2
    assert "000020, 000030" in done.line() and str(into) in done.line()
    # Retention and `latest` no longer see them.
    assert resume_point(run) == c10


def test_what_a_rollback_moved_is_known_as_an_archive_and_a_folder_merely_named_rolled_back_is_not(tmp_path):
    run = tmp_path / "run"
    m = manager(run, "a")
    c10, _ = save(m, 10), save(m, 20)
    done = roll_back(run, c10, stamp="20261201-120000")
    (moved,) = done.moved
    assert archive_of(moved) == run and archive_of(moved.parent.parent) == run  # the checkpoint, its rollback's folder
    assert archive_of(run / ROLLED_BACK) == run
    assert archive_of(c10) is None
    lookalike = tmp_path / "mine" / ROLLED_BACK / "x" / CHECKPOINTS / "000010"
    lookalike.mkdir(parents=True)
    assert archive_of(lookalike) is None  # tmp_path/mine is no run


def test_a_second_rollback_at_the_same_second_gets_its_own_folder(tmp_path):
    run = tmp_path / "run"
    m = manager(run, "a")
    c10, _ = save(m, 10), save(m, 20)
    roll_back(run, c10, stamp="same")
    save(manager(run, "b", parent=c10), 20)
    second = roll_back(run, c10, stamp="same")
    assert second.into.name == "same-1"
    assert len(rolled_back(run)) == 2


def test_paths_resolve_against_where_they_were_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "reach").mkdir(parents=True)
    (tmp_path / "tok").mkdir()
    cfg = load_config(None, ["--output_dir=runs/a", "--dataset.root=data/reach", "--policy.tokenizer_path=tok",
                             "--policy.pretrained_path=lerobot/pi05_base"], environ={})
    assert cfg.output_dir == tmp_path / "runs" / "a"
    assert cfg.dataset.root == str(tmp_path / "data" / "reach")
    assert cfg.policy.tokenizer_path == tmp_path / "tok"
    assert str(cfg.policy.pretrained_path) == "lerobot/pi05_base"  # a repo id, not a local path: left as it is


def test_mixture_roots_resolve_and_take_an_indexed_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = {"dataset": {"num_cameras": 2, "mixture": [{"root": "data/a", "name": "a"}, {"root": "data/b", "name": "b"}]}}
    (tmp_path / "mix.json").write_text(json.dumps(config))
    cfg = load_config("mix.json", ["--dataset.mixture.1.root=elsewhere/b"], environ={})
    assert [m.root for m in cfg.dataset.mixture] == [str(tmp_path / "data" / "a"), str(tmp_path / "elsewhere" / "b")]
    with pytest.raises(UserError, match=r"dataset.mixture' has 2 item\(s\)"):
        load_config("mix.json", ["--dataset.mixture.5.root=x"], environ={})


def test_a_checkpoint_records_run_paths_relative_and_others_absolute(tmp_path):
    run = tmp_path / "run"
    data = {"output_dir": str(run), "dataset": {"root": str(tmp_path / "data"), "mixture": None},
            "policy": {"pretrained_path": str(run / "base" / "model.safetensors"), "tokenizer_path": "google/paligemma-3b-pt-224"}}
    recorded = record_paths(data, run)
    assert recorded["output_dir"] == "."
    assert recorded["dataset"]["root"] == str(tmp_path / "data")
    assert recorded["policy"]["pretrained_path"] == "base/model.safetensors"
    assert recorded["policy"]["tokenizer_path"] == "google/paligemma-3b-pt-224"


def test_a_moved_checkpoint_config_resolves_run_paths_against_its_new_run_dir(tmp_path, monkeypatch):
    run = tmp_path / "run"
    m = manager(run, "a")
    ckpt = m.save(10, config={"output_dir": str(run), "steps": 100, "dataset": {"root": str(run / "data")}},
                  state={"step": 10})
    moved = tmp_path / "elsewhere" / "run2"
    moved.parent.mkdir()
    os.replace(run, moved)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(moved / CHECKPOINTS / ckpt.name / TRAIN_CONFIG, environ={})
    assert cfg.output_dir == moved
    assert cfg.dataset.root == str(moved / "data")


def test_a_missing_recorded_path_is_named_with_where_it_came_from_and_the_override(tmp_path):
    origin = tmp_path / "run" / "checkpoints" / "000010" / TRAIN_CONFIG
    data = {"output_dir": str(tmp_path / "run"), "dataset": {"root": "/gone/data", "mixture": None},
            "policy": {"pretrained_path": "/gone/base", "tokenizer_path": None}}
    assert missing_paths(data, origin=origin, overridden=set(), lora=False) == [
        f"dataset.root '/gone/data' (recorded in {origin}) does not exist on this machine: the run or the data moved? "
        "Pass --dataset.root=WHERE_IT_IS_NOW."]
    lines = missing_paths(data, origin=origin, overridden={"dataset.root"}, lora=True)
    assert len(lines) == 1 and lines[0].startswith("policy.pretrained_path '/gone/base'")
    mixture = {"dataset": {"mixture": [{"root": str(tmp_path)}, {"root": "/gone/b"}]}}
    assert "Pass --dataset.mixture.1.root=WHERE_IT_IS_NOW." in missing_paths(mixture, origin=origin, overridden=set(), lora=False)[0]


def test_the_config_packages_copies_of_the_run_layout_names_agree_with_layout():
    assert (config_paths.CHECKPOINTS, config_paths.TRAINING_STATE, config_paths.LINEAGE) == (
        layout.CHECKPOINTS, layout.TRAINING_STATE, LINEAGE)


def test_a_kill_between_publishing_and_repointing_last_resumes_the_published_child(tmp_path):
    run = tmp_path / "run"
    m = manager(run, "a")
    c10, c20 = save(m, 10), save(m, 20)
    point_last(run / CHECKPOINTS, c10.name)  # as left by a kill right after 000020 was renamed into place
    assert current_branch(run) == [c10, c20]
    assert resume_point(run) == c20
    assert newer_checkpoints(run, c20) == []


def test_a_first_deepspeed_cpu_launch_says_it_builds_its_op_and_later_ones_or_a_prebuilt_op_do_not(tmp_path):
    """In fresh interpreters that find DeepSpeed where PYTHONPATH says: a package as PyPI's DeepSpeed installs it
    (no compiled op), then the same package with the op compiled in; and the DeepSpeed scripts/test.sh's set-up
    installed."""
    import subprocess
    import sys

    extensions = tmp_path / "torch_extensions"
    pypi, prebuilt = tmp_path / "pypi", tmp_path / "prebuilt"
    for root in (pypi, prebuilt):
        (root / "deepspeed" / "ops" / "comm").mkdir(parents=True)
        (root / "deepspeed" / "__init__.py").write_text("")
    (prebuilt / "deepspeed" / "ops" / "comm" / "deepspeed_shm_comm_op.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    script = """import json
from opentau_cli.config import setup_from_dict
from opentau_cli.process.launch import deepspeed_op_note
zero2 = setup_from_dict({"backend": "deepspeed", "zero_stage": 2, "num_processes": 2})
ddp = setup_from_dict({"backend": "ddp", "num_processes": 2})
print(json.dumps([deepspeed_op_note(zero2, cuda=False), deepspeed_op_note(ddp, cuda=False),
                  deepspeed_op_note(zero2, cuda=True)]))"""

    def notes(pythonpath: str) -> list:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": pythonpath}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    first, ddp, cuda = notes(str(pypi))
    assert first and "builds its CPU communication op" in first and "30-60 s" in first
    assert ddp is None and cuda is None
    assert notes(str(prebuilt)) == [None, None, None]
    # An earlier launch built it into torch's extensions folder.
    built = extensions / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / "deepspeed_shm_comm"
    built.mkdir(parents=True)
    (built / "deepspeed_shm_comm.so").write_bytes(b"")
    assert notes(str(pypi)) == [None, None, None]
    # scripts/test.sh's set-up compiles it into DeepSpeed on this CPU torch: no launch here says it builds.
    shutil.rmtree(built)
    assert notes("") == [None, None, None]


def test_keep_best_keeps_the_best_by_a_metric_that_rises_and_falls_beside_the_newest(tmp_path):
    from opentau_cli.store.layout import BEST
    from opentau_cli.train.manager import BestCheckpoints

    run = tmp_path / "run"
    m = CheckpointManager(FakeAccelerator(), run, total_steps=100, run_id="a", keep_last=2,
                          best=BestCheckpoints(keep=2, metric="val_loss", mode="min"))
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 4: 1.0, 5: 6.0, 6: 2.0, 7: 7.0, 8: 8.0}
    for step, loss in losses.items():
        m.save(step, config={"steps": 100, "resume": False}, state={"step": step, "validation": {"val_loss": loss}})
    assert [p.name for p in current_branch(run)] == ["000004", "000006", "000007", "000008"]
    assert read_last(run / CHECKPOINTS, BEST) == "000004"
    assert find_checkpoint(f"{run}:best") == (run / CHECKPOINTS / "000004").resolve()


def test_keep_best_by_a_larger_is_better_metric_and_never_the_resume_source(tmp_path):
    from opentau_cli.store.layout import BEST
    from opentau_cli.train.manager import BestCheckpoints

    run = tmp_path / "run"
    m = manager(run, "a")
    source = m.save(1, config={"steps": 100}, state={"step": 1, "validation": {"val_acc": 0.1}})
    resumed = CheckpointManager(FakeAccelerator(), run, total_steps=100, run_id="b", keep_last=1, protect=source,
                                parent=source, best=BestCheckpoints(keep=1, metric="val_acc", mode="max"))
    for step, acc in ((2, 0.5), (3, 0.9), (4, 0.2), (5, None)):
        resumed.save(step, config={"steps": 100}, state={"step": step, "validation": {"val_acc": acc} if acc else None})
    assert [p.name for p in current_branch(run)] == ["000001", "000003", "000005"]
    assert read_last(run / CHECKPOINTS, BEST) == "000003"


def test_keep_best_without_validation_is_refused_before_launch():
    from opentau_cli.config import Machine, resolve_accelerate_config, validate

    cfg = load_config(None, ["--checkpoint.keep_best=2"], environ={})
    with pytest.raises(UserError, match="checkpoint.keep_best ranks checkpoints by their validation val_loss"):
        validate(cfg, resolve_accelerate_config(None), Machine(cuda=False, gpus=0))
    cfg = load_config(None, ["--checkpoint.keep_best=2", "--checkpoint.best_metric=loss", "--validation.val_freq=5",
                             "--validation.val_split=0.2"], environ={})
    with pytest.raises(UserError, match="'loss' is not a validation key"):
        validate(cfg, resolve_accelerate_config(None), Machine(cuda=False, gpus=0))
