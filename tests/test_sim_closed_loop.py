"""The loop closes on a CPU, in a real simulator: a tiny policy trained on a MetaWorld expert's demonstration succeeds
when rolled out from that episode's seed, where the same policy untrained does not. (Seed 1: the untrained tiny
policy's drift happens to reach seed 0's goal, not those of seeds 1-6.) (The smaller version of
benchmarks/bench_closed_loop.py, which trains on many seeds and evaluates on others.)"""

from __future__ import annotations

import json

import pytest

from conftest import EXAMPLES, require_simulators, run_cli

pytestmark = [pytest.mark.full, pytest.mark.slow]


def _train(data, out, *extra: str) -> None:
    done = run_cli(["train", "--config_path", str(EXAMPLES / "pi05_tiny_config.json"), f"--dataset.root={data}",
                    f"--output_dir={out}", "--validation.val_split=0", "--validation.val_freq=0", *extra],
                   env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _success(run_dir, out) -> dict:
    done = run_cli(["eval", str(run_dir), "--env", "metaworld:reach-v3", "--rollouts", "1", "--seed", "1",
                    "--max-steps", "80", "--output", str(out)])
    assert done.returncode == 0, done.stderr
    return json.loads((out / "eval_info.json").read_text())


def test_a_policy_trained_on_an_expert_episode_succeeds_from_its_seed_where_the_untrained_one_fails(tmp_path):
    require_simulators()
    data = tmp_path / "reach"
    done = run_cli(["dataset", "synth", str(data), "--env", "metaworld:reach-v3", "--episodes", "1", "--seed", "1",
                    "--image-size", "32"])
    assert done.returncode == 0, done.stderr
    _train(data, tmp_path / "trained", "--steps=300", "--save_freq=300")
    _train(data, tmp_path / "untrained", "--steps=1", "--save_freq=1", "--optimizer.lr=1e-12")
    trained = _success(tmp_path / "trained", tmp_path / "eval_trained")
    untrained = _success(tmp_path / "untrained", tmp_path / "eval_untrained")
    assert trained["episodes"][0]["success"] and trained["success_rate"] == 1.0
    assert not untrained["episodes"][0]["success"] and untrained["episodes"][0]["steps"] == 80
