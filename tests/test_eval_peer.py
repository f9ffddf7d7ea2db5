"""`opentau eval` against LeRobot 0.4.4's own env wrappers and eval pipeline: for the same seeded MetaWorld (push-v3)
and PushT episodes, the observations our eval hands the policy and the actions it sends the env are those LeRobot's
`make_env` + `preprocess_observation` + `rollout` produce with its pi05 loaded from our LeRobot export of the same
checkpoint (tests/lerobot_eval_driver.py runs LeRobot's side in the lerobot-sim venv of scripts/peer_envs.sh).

The checkpoint: pi05_small (LeRobot's pi05, like openpi's, reshapes attention with 8 heads: pi05_tiny's 4 fail
inside it), every weight drawn off its initial value (the expert's adaRMS gates start at zero), statistics in each
env's ranges, one camera named as LeRobot's envs name it (`observation.image`). Its image size is the env's rendered
size (MetaWorld 480, as LeRobot's wrapper always renders; PushT 96), so neither side resizes: LeRobot's pi05 resizes
inside the model with torch's bilinear interpolation, opentau with PIL's (antialiased) as in its training, and a
resized image differs by a few levels, enough to move the actions by ~1e-2. Both sides render with the simulators'
shipped scene settings (`--render shipped`) and draw each chunk's noise from a generator seeded with the episode's
seed (tests/lerobot_eval_driver.py says how LeRobot is given it).

Compared over the first K steps (two chunks of 5 executed actions): LeRobot's env is stepped with the actions our
eval sent (the driver's --follow; its policy still acts at every step), so that the fp32 differences of the two
policies' actions, which a closed loop amplifies into different pixels a few steps later, do not hide the rest.
Observations `==`; actions within 1e-5 of the action's range (q99 - q01), i.e. in the policy's normalized units:
PushT's actions are pixel targets up to 512, where fp32 itself is 3e-5 apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import EXAMPLES, run_cli, run_cli_in_process
from peer_envs import byte_level_tokenizer, lerobot_sim_python, sizes_for_peers

pytestmark = [pytest.mark.full, pytest.mark.timeout(1800)]

HERE = Path(__file__).parent
TOLERANCE = 1e-5
STEPS = 10  # two chunks of 5 executed actions
SEED = 3
# Each env's widths and the ranges its statistics are drawn in: MetaWorld's hand xyz + gripper and its [-1, 1]
# actions; PushT's agent position and absolute target, both in [0, 512].
# LeRobot 0.4.4's PushT wrapper carries no instruction (its rollout hands the policy an empty prompt); the driver gives
# it the words of LeRobot's PushT dataset, which opentau's eval uses.
PUSHT_TASK = "Push the T-shaped block onto the T-shaped target."
ENVS = {
    "metaworld:push-v3": {"state": 4, "action": 4, "state_range": (-0.5, 0.9), "action_range": (-1.0, 1.0),
                          "size": 480, "episodes": 1, "task": None},
    "pusht": {"state": 2, "action": 2, "state_range": (0.0, 512.0), "action_range": (0.0, 512.0),
              "size": 96, "episodes": 2, "task": PUSHT_TASK},
}


def _stats(width: int, low: float, high: float, generator: torch.Generator) -> dict:
    q01 = low + torch.rand(width, generator=generator) * (high - low) * 0.2
    q99 = high - torch.rand(width, generator=generator) * (high - low) * 0.2
    return {"q01": q01.tolist(), "q99": q99.tolist(), "mean": ((q01 + q99) / 2).tolist(),
            "std": ((q99 - q01) / 4).tolist()}


def sim_checkpoint(root: Path, env: str, tokenizer: Path, *, preset: str = "pi05_small",
                   resolution: int = 64) -> tuple[Path, dict]:
    """A run holding one pi05 checkpoint for `env` (its state/action widths, camera `observation.image`) with drawn
    weights: the run directory (its checkpoint is checkpoints/000001) and the statistics it holds."""
    from safetensors.torch import save_file

    from opentau_cli.config.load import load_config
    from opentau_cli.policies import build_policy
    from opentau_cli.store.layout import MODEL_WEIGHTS, TRAIN_CONFIG, TRAINING_STATE
    from opentau_cli.store.manifest import write_manifest

    widths = ENVS[env]
    run = root / env.replace(":", "_")
    cfg = load_config(str(EXAMPLES / "pi05_tiny_config.json"), [
        f"--output_dir={run}", f"--policy.preset={preset}", f"--policy.image_resolution=[{resolution},{resolution}]",
        "--policy.chunk_size=10", "--policy.n_action_steps=5", "--policy.tokenizer_max_length=128",
        f"--policy.tokenizer_path={tokenizer}",
        f"--dataset.root={root / 'no_dataset'}", '--dataset.camera_keys={"observation.image": "camera0"}'])
    generator = torch.Generator().manual_seed(11)
    stats = {"state": _stats(widths["state"], *widths["state_range"], generator),
             "action": _stats(widths["action"], *widths["action_range"], generator)}
    torch.manual_seed(7)
    policy = build_policy(cfg.policy, stats)
    with torch.no_grad():  # every weight drawn off its initial value: the expert's adaRMS gates start at zero
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    ckpt = run / "checkpoints" / "000001"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous().clone() for k, v in policy.state_dict().items()}, str(ckpt / MODEL_WEIGHTS))
    (ckpt / TRAIN_CONFIG).write_text(json.dumps(cfg.to_json_dict()))
    (ckpt / TRAINING_STATE).write_text(json.dumps({"step": 1}))
    write_manifest(ckpt)
    return run, stats


def lerobot_export(run: Path, output: Path) -> Path:
    """`opentau checkpoint export --layout lerobot` in this process: it launches nothing, and this process has torch and
    the policy imported already (the start-up of a new interpreter, seconds each, is all a subprocess would add)."""
    done = run_cli_in_process(["checkpoint", "export", str(run / "checkpoints" / "000001"), "--layout", "lerobot",
                               "--output", str(output)])
    assert done.returncode == 0, done.stderr[-3000:]
    return output


def run_driver(python: str, mode: str, export: Path, tokenizer: Path, sizes: Path, env: str, output: Path, *args: str,
               timeout: float = 1500) -> None:
    proc = subprocess.run([python, str(HERE / "lerobot_eval_driver.py"), mode, str(export), str(tokenizer), str(sizes),
                           env, *args, "--output", str(output)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MUJOCO_GL": "egl"})
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    python = lerobot_sim_python()
    root = tmp_path_factory.mktemp("eval_peer")
    sizes = root / "sizes.json"
    sizes.write_text(json.dumps(sizes_for_peers("pi05_small")))
    return {"python": python, "root": root, "tokenizer": byte_level_tokenizer(root / "tokenizer"), "sizes": sizes}


def _both_sides(common, env: str) -> tuple[dict, dict, np.ndarray]:
    """(ours, LeRobot's) recorded steps of the same seeded episodes of `env`, and the action's range (q99 - q01)."""
    root, case = common["root"], ENVS[env]
    run, stats = sim_checkpoint(root, env, common["tokenizer"], resolution=case["size"])
    export = lerobot_export(run, root / f"export_{run.name}")
    ours_dir = root / f"ours_{run.name}"
    done = run_cli(["eval", str(run), "--env", env, "--rollouts", str(case["episodes"]), "--seed", str(SEED),
                    "--output", str(ours_dir), "--record-steps", str(STEPS), "--max-steps", str(STEPS),
                    "--image-size", str(case["size"]), "--render", "shipped"], env={"MUJOCO_GL": "egl"}, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = root / f"lerobot_{run.name}.npz"
    run_driver(common["python"], "record", export, common["tokenizer"], common["sizes"], env, theirs,
               "--seed", str(SEED), "--episodes", str(case["episodes"]), "--steps", str(STEPS),
               "--follow", str(ours_dir / "steps.npz"), *(["--task", case["task"]] if case["task"] else []))
    with np.load(ours_dir / "steps.npz") as ours, np.load(theirs) as lerobot:
        action_range = np.array(stats["action"]["q99"], np.float32) - np.array(stats["action"]["q01"], np.float32)
        return {k: ours[k] for k in ours.files}, {k: lerobot[k] for k in lerobot.files}, action_range


@pytest.fixture(scope="module")
def metaworld(common):
    return _both_sides(common, "metaworld:push-v3")


@pytest.fixture(scope="module")
def pusht(common):
    return _both_sides(common, "pusht")


def _assert_same_episodes(ours: dict, theirs: dict, action_range: np.ndarray, episodes: int, record, what: str) -> None:
    assert sorted(k for k in ours if k.endswith("/seed")) == [f"ep{i}/seed" for i in range(episodes)]
    for i in range(episodes):
        assert int(ours[f"ep{i}/seed"]) == int(theirs[f"ep{i}/seed"]) == SEED + i
        keys = sorted(k for k in theirs if k.startswith(f"ep{i}/obs/"))
        assert sorted(k for k in ours if k.startswith(f"ep{i}/obs/")) == keys
        for key in keys:
            assert ours[key].dtype == theirs[key].dtype == np.float32, key
            assert ours[key].shape == theirs[key].shape, key
            difference = np.abs(ours[key] - theirs[key]).max()
            assert np.array_equal(ours[key], theirs[key]), f"{key}: max abs difference {difference:.3g}"
        action = f"ep{i}/action"
        assert ours[action].shape == theirs[action].shape == (STEPS, len(action_range))
        difference = float((np.abs(ours[action] - theirs[action]) / action_range).max())
        record(f"eval vs LeRobot max action difference / range, {what} episode {i}", f"{difference:.3g}")
        assert difference <= TOLERANCE, f"{action}: max difference {difference:.3g} of the range > {TOLERANCE}"
        assert np.abs(theirs[action][1:] - theirs[action][:-1]).max() > 0  # a policy that acts, not a silent one


def test_metaworld_push_episodes_give_the_policy_lerobots_observations_and_the_env_its_actions(metaworld,
                                                                                               record_property):
    ours, theirs, action_range = metaworld
    assert theirs["ep0/obs/observation.image"].shape == (STEPS, 3, 480, 480)  # corner2 at MetaWorld's render size
    assert theirs["ep0/obs/observation.state"].shape == (STEPS, 4)
    assert str(theirs["ep0/task"]) == "Push the puck to a goal"
    _assert_same_episodes(ours, theirs, action_range, ENVS["metaworld:push-v3"]["episodes"], record_property,
                          "metaworld push-v3")


def test_pusht_episodes_give_the_policy_lerobots_observations_and_the_env_its_actions(pusht, record_property):
    ours, theirs, action_range = pusht
    assert theirs["ep0/obs/observation.image"].shape == (STEPS, 3, 96, 96)
    assert theirs["ep0/obs/observation.state"].shape == (STEPS, 2)
    _assert_same_episodes(ours, theirs, action_range, ENVS["pusht"]["episodes"], record_property, "pusht")
    # Two seeds reach the simulator on both sides: two different first frames.
    assert not np.array_equal(theirs["ep0/obs/observation.image"][0], theirs["ep1/obs/observation.image"][0])


def test_eval_benchmark_smoke_prints_both_sides_steps_per_second_memory_per_env_and_their_ratio(tmp_path):
    results = tmp_path / "BENCHMARKS.md"
    done = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "bench_eval.py"), "--smoke", "--results",
                           str(results)], capture_output=True, text=True, timeout=1500, env={**os.environ, "MUJOCO_GL": "egl"})
    assert done.returncode == 0, done.stderr[-4000:]
    text = results.read_text()
    assert "## Simulator evaluation speed (" in text and "smoke run" in text
    for row in ("| LeRobot eval_policy: env steps/s |", "| LeRobot eval_policy: peak RSS, per env |",
                "| opentau eval --render fast: env steps/s |", "| opentau eval --render fast: peak RSS, per env |",
                "| opentau eval --render fast: image difference vs LeRobot |",
                "| env steps/s, opentau --render fast / LeRobot |"):
        assert row in text, row
    assert "| LeRobot eval_policy: env steps, wall s (episodes only) | 10, " in text  # 1 episode of 10 steps
    assert "| opentau eval --render fast: env steps, wall s | 10, " in text
