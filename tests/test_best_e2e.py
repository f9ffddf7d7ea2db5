"""checkpoint.keep_best through the installed CLI: one single-process run validated and saved every step with
keep_last=1 and keep_best=2; the kept checkpoints, checkpoints/best, and `RUN:best` in export and eval.
(Which checkpoints win for a metric that rises and falls is tested in-process: tests/test_lineage.py.)"""

from __future__ import annotations

import json

import pytest

from conftest import EXAMPLES, run_cli, run_cli_in_process
from opentau_cli.checkpoint.layout import BEST, CHECKPOINTS, METRICS, MODEL_WEIGHTS, TRAINING_STATE

pytestmark = pytest.mark.e2e

STEPS = 6


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("best")
    env = {"HF_HOME": str(tmp / "hf_home")}
    out = tmp / "run"
    ok(run_cli(["train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={out}", "--steps", str(STEPS),
                "--save_freq=1", "--log_freq=1", "--batch_size=4", "--validation.val_split=0.25", "--validation.val_freq=1",
                "--validation.max_batches=2", "--checkpoint.keep_last=1", "--checkpoint.keep_best=2"], env=env))
    return tmp, out, env


def test_the_two_best_by_val_loss_and_the_newest_are_kept_and_best_points_at_the_best(run):
    _, out, _ = run
    val = {r["step"]: r for r in map(json.loads, (out / METRICS).read_text().splitlines()) if r.get("kind") == "val"}
    assert sorted(val) == list(range(1, STEPS + 1))
    ranked = sorted(val, key=lambda s: (val[s]["val_loss"], -s))
    kept = sorted(p.name for p in (out / CHECKPOINTS).iterdir() if p.name.isdigit())
    assert kept == sorted({f"{s:06d}" for s in ranked[:2]} | {f"{STEPS:06d}"})
    assert (out / CHECKPOINTS / BEST).resolve().name == f"{ranked[0]:06d}"
    for name in kept:  # each checkpoint carries the validation of its step, as metrics.jsonl logged it
        state = json.loads((out / CHECKPOINTS / name / TRAINING_STATE).read_text())
        assert state["validation"] == val[int(name)]


def test_export_and_eval_take_run_best(run):
    tmp, out, env = run
    best = (out / CHECKPOINTS / BEST).resolve()
    # In-process: export and eval launch nothing (the run above is the launch).
    ok(run_cli_in_process(["checkpoint", "export", f"{out}:best", "--output", str(tmp / "by_name")], env=env))
    ok(run_cli_in_process(["checkpoint", "export", str(best), "--output", str(tmp / "by_dir")], env=env))
    assert (tmp / "by_name" / MODEL_WEIGHTS).read_bytes() == (tmp / "by_dir" / MODEL_WEIGHTS).read_bytes()
    ok(run_cli_in_process(["eval", f"{out}:best", "--output", str(tmp / "eval_best"), "--device", "cpu", "--stride", "10",
                "--plot-episodes", "0"], env=env))
    report = (tmp / "eval_best" / "eval.json").read_text()
    assert json.dumps(str(best)) in report  # evaluated the checkpoint checkpoints/best points to
    missing = run_cli_in_process(["checkpoint", "export", f"{tmp / 'nowhere'}:best", "--output", str(tmp / "x")], env=env)
    assert missing.returncode == 2 and "keep_best" in missing.stderr and "Traceback" not in missing.stderr
