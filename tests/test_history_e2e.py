"""A run's history end to end through the installed CLI: lineage, refusals and rollbacks, paths that travel, the
schedule lines and Ctrl-C, on 2-process DDP (three launches) and ZeRO-2 (two launches).

Every launch runs from a different working directory than the one before, with relative paths where a user types
them. DDP: train 6 steps (saves at 2, 4, 6; decay over 6 steps; openpi's augmentation on) from `work/` with a relative
dataset root and output_dir; the resume of
000002 is refused three ways; resumed from `other/` with --rollback=true and --steps=8; then the run directory and
the dataset are moved, the resume names the missing dataset, and a resume from `third/` with --dataset.root
continues until a Ctrl-C at its save of step 10. ZeRO-2: train 4 steps from `work/`, move the run, resume 000002
from `other/` with --rollback=true and --steps=6.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import xxhash

from conftest import EXAMPLES, opentau_bin, run_cli, run_cli_in_process
from opentau_cli.store.layout import CHECKPOINTS, LAST, LOGS, MANIFEST, METRICS, TENSORBOARD, TRAIN_CONFIG, TRAINING_STATE

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
DDP = str(EXAMPLES / "accelerate_cpu_ddp_config.yaml")
ZERO2 = str(EXAMPLES / "accelerate_cpu_deepspeed_config.yaml")
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
LR, WARMUP, DECAY_LR = 1e-3, 1, 1e-4  # pi05_tiny_config.json's lr and decay_lr; warm-up set below


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def tree(root: Path) -> dict[str, str]:
    """Every file under root (relative path -> sha1), links as their targets."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(root))] = "-> " + os.readlink(path)
        elif path.is_file():
            out[str(path.relative_to(root))] = hashlib.sha1(path.read_bytes()).hexdigest()
    return out


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / METRICS).read_text().splitlines()]


def state(ckpt: Path) -> dict:
    return json.loads((ckpt / TRAINING_STATE).read_text())


def published(run: Path) -> list[str]:
    return sorted(p.name for p in (run / CHECKPOINTS).iterdir() if p.name.isdigit())


def launch_ids(run: Path) -> set[str]:
    return {p.name for p in (run / LOGS).iterdir() if p.is_dir()}


def cosine_lr(step: int, steps: int) -> float:
    """The documented schedule, written out here: linear warm-up, then cosine from LR to DECAY_LR over `steps`."""
    if step < WARMUP:
        return LR * (step + 1) / (WARMUP + 1)
    progress = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return DECAY_LR + (LR - DECAY_LR) * 0.5 * (1 + math.cos(math.pi * progress))


class History:
    def __init__(self, tmp: Path, backend: str):
        self.tmp, self.backend = tmp, backend
        self.cwd = {name: tmp / name for name in ("work", "other", "third")}
        for d in self.cwd.values():
            d.mkdir()
        self.env = {"HF_HOME": str(tmp / "hf_home")}
        ok(run_cli_in_process(["dataset", "synth", "data/reach", "--episodes", "8", "--steps-per-episode", "20"],
                              cwd=self.cwd["work"], env=self.env))

    def cli(self, args: list[str], where: str, **env):
        return run_cli(args, cwd=self.cwd[where], env={**self.env, **env})

    def refused(self, args: list[str], where: str):
        """A command that stops at its checks, in-process (no interpreter start-up): the launches are run by `cli`."""
        return run_cli_in_process(args, cwd=self.cwd[where], env=self.env)

    def train(self, yaml: str, steps: int, *extra: str):
        return ok(self.cli(["train", f"--config_path={TINY}", f"--accelerate-config={yaml}", "--output_dir=runs/r", *extra,
                            "--dataset.root=data/reach", "--steps", str(steps), "--save_freq", "2", "--log_freq", "1",
                            "--batch_size", "4", "--scheduler.warmup_steps", str(WARMUP), "--validation.val_split=0",
                            "--validation.val_freq=0", "--dataset.num_workers=0"], "work"))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    h = History(tmp_path_factory.mktemp("history_ddp"), "ddp")
    run = h.cwd["work"] / "runs" / "r"
    # decay_steps fixed: the resume's new --steps keeps the schedule, so its steps 3-6 must repeat the first launch's
    # losses bit for bit (with openpi's augmentation on: per-sample draws from the data position).
    h.first = h.train(DDP, 6, "--scheduler.decay_steps=6", "--dataset.augment=openpi")
    h.first_launches = launch_ids(run)
    h.first_records = records(run)
    h.first_tree = tree(run / CHECKPOINTS)
    h.first_states = {name: state(run / CHECKPOINTS / name) for name in published(run)}
    h.first_manifests = {name: xxhash.xxh3_128((run / CHECKPOINTS / name / MANIFEST).read_bytes()).hexdigest()
                         for name in published(run)}
    old = run / CHECKPOINTS / "000002"
    h.refusals = {
        "resume": h.refused(["resume", str(old), "--steps=8"], "other"),
        "train": h.refused(["train", f"--config_path={old / TRAIN_CONFIG}", "--resume=true", "--steps=8"], "other"),
        "validate": h.refused(["config", "validate", str(old / TRAIN_CONFIG), "--resume=true", "--steps=8"], "other"),
    }
    h.tree_after_refusals = tree(run / CHECKPOINTS)
    h.rollback = ok(h.cli(["resume", str(old), "--rollback=true", "--steps=8"], "other"))
    h.rolled_launch = (launch_ids(run) - h.first_launches).pop()
    h.after_rollback = records(run)
    h.states = {name: state(run / CHECKPOINTS / name) for name in published(run)}
    # Move the run and its dataset, as to another cluster.
    h.moved = h.tmp / "moved" / "r"
    h.moved.parent.mkdir()
    shutil.move(run, h.moved)
    shutil.move(h.cwd["work"] / "data" / "reach", h.tmp / "moved" / "reach")
    h.missing = h.refused(["resume", "../moved/r", "--steps=12"], "third")
    # Ctrl-C reaches the launcher (which leads its own session, as in a terminal) once step 10 is published.
    h.interrupted = subprocess.run(
        [opentau_bin(), "resume", "../moved/r", "--dataset.root=../moved/reach", "--steps=12"], cwd=h.cwd["third"],
        env={**os.environ, **h.env, "PYTHONPATH": str(HOOKS), "TEST_KILL_AT": "before_last@10",
             "TEST_KILL_SIGNAL": "SIGINT"}, capture_output=True, text=True, timeout=600, start_new_session=True)
    return h


def test_each_checkpoint_names_its_parent_and_launch(ddp):
    (launch,) = ddp.first_launches
    assert [s["lineage"] for s in ddp.first_states.values()] == [
        {"parent": None, "launch": launch},
        {"parent": {"step": 2, "name": "000002", "manifest_xxh3": ddp.first_manifests["000002"]}, "launch": launch},
        {"parent": {"step": 4, "name": "000004", "manifest_xxh3": ddp.first_manifests["000004"]}, "launch": launch},
    ]


def test_a_resume_from_an_older_checkpoint_is_refused_the_same_way_by_every_form(ddp):
    for form, result in ddp.refusals.items():
        assert result.returncode == 2, (form, result.stderr[-2000:])
        assert "Checkpoint 000002 is older than the run's newest checkpoints (000004, 000006)" in result.stderr, form
        assert "--rollback=true" in result.stderr and "Traceback" not in result.stderr, form
    assert ddp.tree_after_refusals == ddp.first_tree  # nothing written, nothing replaced


def test_a_rollback_moves_the_newer_checkpoints_and_records_aside_and_continues_one_history(ddp):
    moved_root = ddp.moved / "rolled_back"
    (stamp,) = [p.name for p in moved_root.iterdir()]
    past = [r for r in ddp.first_records if r["step"] > 2]
    assert f"moved 2 newer checkpoint(s) (000004, 000006) and {len(past)} metrics record(s) into" in ddp.rollback.stderr
    # Moved whole: the rolled-back checkpoints are byte for byte what the first launch published.
    for name in ("000004", "000006"):
        moved = tree(moved_root / stamp / CHECKPOINTS / name)
        assert moved == {k.split("/", 1)[1]: v for k, v in ddp.first_tree.items() if k.startswith(name + "/")}
    rolled = [json.loads(line) for line in (moved_root / stamp / METRICS).read_text().splitlines()]
    assert rolled == past
    # One history in metrics.jsonl: steps 1..8 once each, 1-2 from the first launch, 3-8 from the resumed one.
    steps = [r["step"] for r in ddp.after_rollback if r.get("kind") == "train"]
    assert steps == list(range(1, 9))
    assert ddp.after_rollback[:2] == ddp.first_records[:2]
    # The new branch's checkpoints descend from 000002 and were written by the resumed launch.
    assert ddp.states["000004"]["lineage"]["parent"] == {"step": 2, "name": "000002", "manifest_xxh3": ddp.first_manifests["000002"]}
    assert ddp.states["000004"]["lineage"]["launch"] == ddp.rolled_launch != next(iter(ddp.first_launches))
    assert ddp.states["000008"]["lineage"]["parent"]["name"] == "000006"


def test_tensorboard_continues_from_the_rollback_step_in_one_run(ddp):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = sorted((ddp.moved / TENSORBOARD / "train").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    assert len(files) >= 2  # the first launch's, the rolled-back resume's (and the interrupted one's)
    starts = [e.step for e in EventFileLoader(str(files[1])).Load() if e.HasField("session_log")]
    assert starts == [3]  # purge_step: TensorBoard drops what earlier files logged from step 3 on


def test_a_fixed_decay_keeps_the_schedule_and_the_rolled_back_steps_repeat_exactly_with_augmentation(ddp):
    assert ("Schedule unchanged: scheduler.decay_steps=6 fixes the cosine decay, so --steps 6 -> 8 only changes where "
            "the run stops.") in ddp.rollback.stderr
    first = {r["step"]: r["loss"] for r in ddp.first_records if r.get("kind") == "train"}
    again = {r["step"]: r["loss"] for r in ddp.after_rollback if r.get("kind") == "train"}
    assert [again[s] for s in range(3, 7)] == [first[s] for s in range(3, 7)]


def test_a_moved_run_names_the_missing_dataset_and_resumes_with_the_override_from_another_directory(ddp):
    assert ddp.missing.returncode == 2, ddp.missing.stderr[-2000:]
    recorded = ddp.tmp / "work" / "data" / "reach"
    assert (f"dataset.root '{recorded}' (recorded in {ddp.moved.resolve() / CHECKPOINTS / '000008' / TRAIN_CONFIG}) "
            "does not exist on this machine") in ddp.missing.stderr
    assert "--dataset.root=" in ddp.missing.stderr and "Traceback" not in ddp.missing.stderr
    assert f"Resumed from {ddp.moved.resolve() / CHECKPOINTS / '000008'} at step 8" in ddp.interrupted.stderr + ddp.interrupted.stdout
    saved = json.loads((ddp.moved / CHECKPOINTS / "000010" / TRAIN_CONFIG).read_text())
    assert saved["output_dir"] == "."  # inside the run: relative, so the run can move again
    assert saved["dataset"]["root"] == str((ddp.tmp / "moved" / "reach").resolve())


def test_ctrl_c_says_what_was_kept_and_how_to_resume(ddp):
    assert ddp.interrupted.returncode == 130, ddp.interrupted.stderr[-3000:]
    line = [ln for ln in ddp.interrupted.stderr.splitlines() if ln.startswith("Interrupted:")]
    assert line and f"checkpoint {ddp.moved.resolve() / CHECKPOINTS / '000010'}" in line[0], ddp.interrupted.stderr[-2000:]
    assert "opentau resume" in line[0]


def test_a_zero2_run_records_lineage_and_rolls_back_after_moving(tmp_path_factory):
    h = History(tmp_path_factory.mktemp("history_zero2"), "zero2")
    # An earlier run in the same place, replaced with --overwrite=true: the launch names what it removes.
    old = h.cwd["work"] / "runs" / "r"
    (old / CHECKPOINTS / "000007").mkdir(parents=True)
    (old / METRICS).write_text('{"step": 7}\n')
    # Asynchronous saves: the lineage is recorded as by synchronous ones.
    first_launch = h.train(ZERO2, 4, "--overwrite=true", "--checkpoint.async_save=true")
    assert (f"--overwrite=true: removing checkpoints/ (000007) and metrics.jsonl of the earlier run in "
            f"{old.resolve()}") in first_launch.stderr
    moved = h.tmp / "moved" / "r"
    moved.parent.mkdir()
    shutil.move(h.cwd["work"] / "runs" / "r", moved)
    first = {name: state(moved / CHECKPOINTS / name) for name in published(moved)}
    assert first["000004"]["lineage"]["parent"]["name"] == "000002"
    resumed = ok(h.cli(["resume", "../moved/r/checkpoints/000002", "--rollback=true", "--steps=6"], "other"))
    # Without scheduler.decay_steps a new --steps re-plans the cosine, and the plan says by how much.
    assert (f"Schedule: --steps 4 -> 6 re-plans the cosine decay over 6 steps: the learning rate at step 2 goes from "
            f"{cosine_lr(2, 4):.3g} to {cosine_lr(2, 6):.3g}") in resumed.stderr
    assert "--scheduler.decay_steps=4" in resumed.stderr
    assert published(moved) == ["000002", "000004", "000006"]
    (stamp,) = [p.name for p in (moved / "rolled_back").iterdir()]
    assert published(moved / "rolled_back" / stamp) == ["000004"]
    again = state(moved / CHECKPOINTS / "000004")["lineage"]
    assert again["parent"]["name"] == "000002" and again["launch"] != first["000004"]["lineage"]["launch"]
    assert os.readlink(moved / CHECKPOINTS / LAST) == "000006"
    # The dataset root was recorded absolute, the run's own paths relative: the moved run needed no override.
    saved = json.loads((moved / CHECKPOINTS / "000004" / TRAIN_CONFIG).read_text())
    assert saved["output_dir"] == "." and saved["dataset"]["root"] == str((h.cwd["work"] / "data" / "reach").resolve())
