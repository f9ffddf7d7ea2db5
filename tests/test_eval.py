"""`opentau eval`: a tiny policy fine-tuned (`opentau train`) from a pretrained one (trained in-process on the demo
task, published in the LeRobot layout) beats the mean action on its held-out episodes, as eval.json and the console
say, from its checkpoint and from its export; mistakes exit 2 in one line, nothing written."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from typer.testing import CliRunner

from conftest import EXAMPLES, SINGLE_PROCESS_ENV, run_cli, run_cli_in_process
from opentau_cli.cli.main import app
from opentau_cli.config.load import load_config
from opentau_cli.data.build import split_episodes
from opentau_cli.data.synth import resolve_dataset_root
from opentau_cli.policies.layouts import LEROBOT
from published import write_published
from test_policy_learning import STEPS, learning, train

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
runner = CliRunner()
LEARNED: dict = {}  # what the fixture's in-process training achieved (first / last losses, held-out errors)


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """(the pretrained model's directory, the fine-tuned run, the held-out episodes of the tiny config's split)."""
    import torch

    root = tmp_path_factory.mktemp("eval")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as test_policy_learning trains: other jobs share the CPU
    try:
        policy, data, losses = train("pi05", STEPS, root)
        learned = learning(policy, data, losses)  # test_policy_learning's check of pi05, on this same training
    finally:
        torch.set_num_threads(threads)
    LEARNED.update(learned)
    pretrained = write_published(policy, root / "pretrained", LEROBOT)
    run = root / "run"
    trained = run_cli(["train", f"--config_path={TINY}", f"--output_dir={run}", f"--policy.pretrained_path={pretrained}",
                       "--steps=20", "--save_freq=20", "--optimizer.lr=1e-4", "--scheduler.type=constant",
                       "--scheduler.warmup_steps=1", "--validation.val_freq=0"],
                      env={"HF_HOME": str(root / "hf_home"), **SINGLE_PROCESS_ENV})
    assert trained.returncode == 0, trained.stderr[-3000:]
    cfg = load_config(TINY, [])
    _, held_out = split_episodes(resolve_dataset_root(cfg.dataset.root), cfg.validation.val_split, cfg.seed)
    return pretrained, run, held_out


def test_the_pretrained_tiny_pi05_learned_the_demo_task_and_beats_the_mean_action_on_held_out_episodes(fine_tuned):
    """tests/test_policy_learning.py's promise for pi05, checked on the in-process training this module starts from."""
    assert LEARNED["last"] <= 0.6 * LEARNED["first"], f"flow-matching loss {LEARNED['first']:.3f} -> {LEARNED['last']:.3f}"
    assert LEARNED["policy_err"] < LEARNED["mean_err"], LEARNED


def test_a_policy_fine_tuned_from_a_pretrained_one_beats_the_mean_action_on_held_out_episodes(fine_tuned, tmp_path):
    _, run, held_out = fine_tuned
    out = tmp_path / "eval"
    result = run_cli_in_process(["eval", str(run), "--output", str(out), "--stride", "2"])  # launches nothing
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["held_out"] is True and report["episodes"] == held_out
    # Which weights of which checkpoint the run directory resolved to (a run without an EMA: its live weights).
    assert report["weights"] == "live" and report["step"] == 20
    assert report["checkpoint"] == {"path": str((run / "checkpoints" / "000020").resolve()), "step": 20,
                                    "resolved_from": str(run)}
    assert report["beats_mean_action"] is True and report["policy"]["mse"] < report["mean_action"]["mse"]
    assert report["mse_ratio"] == pytest.approx(report["policy"]["mse"] / report["mean_action"]["mse"])
    for errors in (report["policy"], report["mean_action"]):
        assert len(errors["per_joint"]["mse"]) == report["action_dim"] == 2
        assert len(errors["per_step"]["mae"]) == report["n_action_steps"] == 10
    # The per-joint errors average to the overall one (each joint over the same valid steps).
    assert sum(report["policy"]["per_joint"]["mse"]) / 2 == pytest.approx(report["policy"]["mse"])
    assert "beats the mean action" in result.stdout and "held-out" in result.stdout
    with Image.open(out / "eval.png") as image:
        assert image.format == "PNG" and image.width > 300 and image.height > 300


def test_an_exported_model_is_evaluated_from_its_published_files(fine_tuned, tmp_path):
    _, run, held_out = fine_tuned
    model = tmp_path / "openpi"
    exported = runner.invoke(app, ["checkpoint", "export", str(run), "--output", str(model), "--layout", "openpi"])
    assert exported.exit_code == 0, exported.output
    out = tmp_path / "eval"
    episodes = ",".join(map(str, held_out[:4]))
    result = run_cli_in_process(["eval", str(model), "--episodes", episodes, "--output", str(out), "--stride", "2", "--plot-episodes", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["layout"] == "openpi pi05" and report["held_out"] is False and report["episodes"] == held_out[:4]
    assert report["preset"] == "pi05_tiny" and "assets/demo/norm_stats.json" in report["statistics"]
    assert (report["weights"], report["step"]) == ("live", 20)  # what the export recorded of its checkpoint
    assert report["beats_mean_action"] is True


def _refused(result, *needles) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_eval_mistakes_exit_2_in_one_line_and_write_nothing(fine_tuned, tmp_path):
    pretrained, run, _ = fine_tuned
    out = tmp_path / "eval"
    _refused(runner.invoke(app, ["eval", str(tmp_path / "nope"), "--output", str(out)]), "no such file or directory")
    _refused(runner.invoke(app, ["eval", str(run), "--episodes", "0,999", "--output", str(out)]), "[999]")
    _refused(runner.invoke(app, ["eval", str(run), "--episodes", "first", "--output", str(out)]), "--episodes=first")
    _refused(runner.invoke(app, ["eval", str(pretrained), "--policy.max_action_dim=4", "--output", str(out)]), "does not match")
    assert not out.exists()
