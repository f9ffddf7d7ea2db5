"""`opentau train ... --resume=auto`: the one command a scheduler's requeue runs again. It starts the run when
output_dir holds no checkpoint, continues from `last` when it does (the checks of `opentau resume`), refuses another
run's directory, and waits for a live run's lock before it refuses (docs/ARCHITECTURE.md, "Schedulers").

One process, the tiny preset: an uninterrupted 6-step run is the reference; the same command with --steps 3, then 6,
is the run that was stopped and started again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, SINGLE_PROCESS_ENV, opentau_bin, refused, run_cli, tree

pytestmark = pytest.mark.full

TINY = EXAMPLES / "pi05_tiny_config.json"
# decay_steps fixes the schedule, so that the 3-step launch and the 6-step one follow the uninterrupted run's rates.
COMMON = ["--save_freq", "3", "--log_freq", "1", "--scheduler.warmup_steps", "2", "--scheduler.decay_steps", "6",
          "--validation.val_freq", "0"]


def train(out: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return run_cli(["train", f"--config_path={TINY}", f"--output_dir={out}", *COMMON, *extra], env=env)


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every train record's (step, loss), in the order written: a step logged twice shows twice."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto")
    env = {"HF_HOME": str(tmp / "hf_home"), **SINGLE_PROCESS_ENV}
    reference = tmp / "reference"
    ok(train(reference, env, "--steps", "6"))
    auto = tmp / "auto"
    first = train(auto, env, "--steps", "3", "--resume=auto")
    ok(first)
    after_first = train_losses(auto)
    second = train(auto, env, "--steps", "6", "--resume=auto")
    ok(second)
    return dict(tmp=tmp, env=env, reference=reference, auto=auto, first=first, after_first=after_first, second=second)


def test_resume_auto_starts_a_run_in_an_empty_output_dir(runs):
    assert "holds no checkpoint: starting the run" in runs["first"].stderr
    assert [step for step, _ in runs["after_first"]] == [1, 2, 3]
    assert (runs["auto"] / "checkpoints" / "000003" / "manifest.json").is_file()


def test_resume_auto_continues_from_last_with_the_uninterrupted_losses_every_step_logged_once(runs):
    assert "--resume=auto: continuing from" in runs["second"].stderr
    assert "000003" in runs["second"].stderr
    assert train_losses(runs["auto"]) == train_losses(runs["reference"])
    assert [step for step, _ in train_losses(runs["auto"])] == [1, 2, 3, 4, 5, 6]


def test_resume_auto_of_a_finished_run_launches_nothing(runs):
    before = tree(runs["auto"])
    result = train(runs["auto"], runs["env"], "--steps", "6", "--resume=auto")
    ok(result)
    assert "Nothing to do" in result.stderr
    assert tree(runs["auto"]) == before


def test_resume_auto_refuses_another_runs_directory_and_writes_nothing(runs):
    before = tree(runs["auto"])
    result = train(runs["auto"], runs["env"], "--steps", "6", "--seed", "7", "--resume=auto")
    refused(result, f"output_dir '{runs['auto']}' holds another run", "seed 1000 there, 7 here",
            f"opentau resume {runs['auto']}")
    assert tree(runs["auto"]) == before


HOLD_LOCK = """
import sys, time
from opentau_cli.process import runlock
with runlock.held(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def hold_lock(run_dir: Path, seconds: float) -> subprocess.Popen:
    """A launcher of the run that still holds its lock (the job a requeue replaces, still saving)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir), str(seconds)], stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_resume_auto_waits_for_the_run_that_holds_the_lock_then_continues(runs):
    holder = hold_lock(runs["auto"], 600)
    waiting = subprocess.Popen([opentau_bin(), "train", f"--config_path={TINY}", f"--output_dir={runs['auto']}", *COMMON,
                                "--steps", "6", "--resume=auto"], env={**os.environ, **runs["env"]},
                               stderr=subprocess.PIPE, text=True)
    try:
        said = waiting.stderr.readline()  # the first thing it says: that it waits
        holder.kill()  # the old job ends
        holder.wait()
        rest = waiting.stderr.read()
        assert waiting.wait(timeout=600) == 0, said + rest
    finally:
        for proc in (holder, waiting):
            proc.kill()
            proc.wait()
    assert said.startswith(f"Run directory '{runs['auto']}' is in use by a live run (pid {holder.pid}"), said
    assert "Waiting up to 330 s for it to end (--resume=auto)." in said
    assert "Nothing to do" in rest


def test_resume_auto_refuses_a_lock_still_held_after_the_wait_naming_the_holder(runs):
    holder = hold_lock(runs["auto"], 120)
    try:
        before = tree(runs["auto"])
        result = train(runs["auto"], runs["env"], "--steps", "6", "--resume=auto",
                       "--distributed.lock_wait_seconds=2")
        assert result.returncode == 2, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("Error: ") and f"pid {holder.pid}" in last and "waited 2 s" in last
        assert "Traceback" not in result.stderr
        assert tree(runs["auto"]) == before
    finally:
        holder.kill()
        holder.wait()
