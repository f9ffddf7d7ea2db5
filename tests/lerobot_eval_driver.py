"""Run with LeRobot 0.4.4's own package plus the simulators (the lerobot-sim venv of scripts/peer_envs.sh): LeRobot's
env wrappers and eval pipeline acting with LeRobot's pi05 loaded from opentau's LeRobot export.

  python lerobot_eval_driver.py record EXPORT TOKENIZER_DIR SIZES.json ENV --seed S --episodes N --steps K [--task T]
                                       [--follow OURS.npz] --output STEPS.npz
  python lerobot_eval_driver.py eval   EXPORT TOKENIZER_DIR SIZES.json ENV --seed S --episodes N --envs E
                                       [--max-steps M] [--task T] --output INFO.json

ENV: metaworld:TASK | pusht | aloha:transfer_cube | aloha:insertion, built by `lerobot.envs.factory.make_env` from
LeRobot's own env configs (MetaworldEnv, PushtEnv, AlohaEnv with their defaults).

record: episode i (seed S+i) runs through `lerobot_eval.rollout` alone in a one-env vector env, cut to its first K
steps, and STEPS.npz holds `ep{i}/obs/<key>` (the first K observations `rollout` hands the policy's preprocessor:
`preprocess_observation`'s output, float32 CHW images in [0, 1] under LeRobot's keys, the state), `ep{i}/action`
(K, action_dim) float32 as sent to `env.step`, `ep{i}/seed` and `ep{i}/task` (the prompt LeRobot gives the policy).
With `--follow OURS.npz` (a steps.npz of opentau's eval), LeRobot's policy acts at every step as usual but the env is
stepped with the actions OURS.npz recorded for the episode: both sides then see the same trajectory, whatever the
fp32 differences of the two policies' actions (which a closed loop amplifies: a 1e-6 difference moves an object by
less than a pixel, which changes a few pixels at an edge a few steps later, which changes the next chunk), so every
observation and every chunk can be compared. `ep{i}/action` then holds LeRobot's actions, not the ones stepped with.
eval: `lerobot_eval.eval_policy` over N episodes from seed S on E envs at once (as `lerobot-eval` runs them); INFO.json
holds its aggregated results, the env steps taken and the seconds the episodes took.

Two settings are the driver's, not LeRobot's; both are documented choices of the comparison:
- Sampling noise. LeRobot's pi05 draws the flow's starting noise from torch's global RNG when `predict_action_chunk`
  is given none. Here every episode owns a `torch.Generator` seeded with the episode's seed, and each chunk of that
  episode is the next `torch.randn(1, chunk_size, max_action_dim)` of it, handed to LeRobot through its own `noise`
  argument of `predict_action_chunk` (a batch stacks its episodes' draws). opentau's eval draws the same way, so the
  same episode gets the same noise whatever the batch it runs in.
- MetaWorld's seed. LeRobot's MetaWorld wrapper passes the seed to MetaWorld's `reset`, which ignores it: object and
  goal positions come from numpy's global RNG. Each episode's inner MetaWorld env is seeded here as MetaWorld
  documents (`env.seed(seed)` with `seeded_rand_vec`) before `rollout` resets it, which makes the episode a function
  of its seed, as opentau's eval does.
- MetaWorld's first frame. MetaWorld's reset moves the goal site in the model but nothing recomputes the site's
  position before LeRobot's wrapper renders, so LeRobot's first frame of an episode shows the goal marker where the
  previous reset left it (push-v3: a red dot away from the goal). opentau's eval places the target sites after the
  reset (`_set_pos_site`, as MetaWorld's own `step` does); the driver does the same after the inner env's reset, so
  that the comparison is not of that stale marker (and the policy's first chunk sees the same frame).
- The instruction of an env that has none: LeRobot 0.4.4's PushT and ALOHA wrappers carry no task text, so its
  rollout hands the policy an empty prompt. `--task TEXT` sets it on each env (`task_description`, the attribute
  LeRobot's `add_envs_task` reads), so that the rest of the pipeline is compared with the same words.

SIZES.json: the model's sizes (LeRobot's pi05 builds PaliGemma-3B's; see lerobot_policy_driver.py and
peer_model_sizes.py). TOKENIZER_DIR: a local tokenizer given to LeRobot's tokenizer step in place of PaliGemma's.
"""

import argparse
import contextlib
import io
import json
import os
import sys
import time

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import torch
from transformers import AutoModel  # noqa: F401  transformers' lazy modules first: LeRobot's import chain otherwise
                                    # hits a circular import inside transformers 4.53
from transformers import AutoTokenizer

import lerobot.policies.pi05.modeling_pi05 as modeling_pi05
from lerobot.envs.configs import AlohaEnv, MetaworldEnv, PushtEnv
from lerobot.envs.factory import make_env, make_env_pre_post_processors
from lerobot.policies.pi05.modeling_pi05 import PI05Policy
from lerobot.processor import PolicyProcessorPipeline
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
from lerobot.scripts.lerobot_eval import eval_policy, rollout
from lerobot.utils.constants import ACTION
from peer_model_sizes import size_lerobot_pi05

ALOHA_TASKS = {"transfer_cube": "AlohaTransferCube-v0", "insertion": "AlohaInsertion-v0"}


def env_config(spec: str):
    """LeRobot's own config of the env named `spec` (its defaults: images as LeRobot renders them)."""
    family, _, task = spec.partition(":")
    if family == "metaworld":
        return MetaworldEnv(task=task)
    if family == "pusht":
        return PushtEnv()
    if family == "aloha":
        return AlohaEnv(task=ALOHA_TASKS[task])
    raise SystemExit(f"unknown env {spec!r}")


def load_policy(export: str, tokenizer_dir: str, sizes_path: str):
    with open(sizes_path) as f:
        sizes = json.load(f)

    size_lerobot_pi05(modeling_pi05, sizes)
    with contextlib.redirect_stdout(io.StringIO()):  # its loader's report; tests/test_peer_models.py checks the load
        policy = PI05Policy.from_pretrained(export)
    policy.eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    pre = PolicyProcessorPipeline.from_pretrained(export, config_filename="policy_preprocessor.json",
                                                  overrides={"tokenizer_processor": {"tokenizer": tokenizer}})
    post = PolicyProcessorPipeline.from_pretrained(export, config_filename="policy_postprocessor.json",
                                                   to_transition=policy_action_to_transition,
                                                   to_output=transition_to_policy_action)
    return policy, pre, post


class EpisodeNoise:
    """The noise of each chunk: the next draw of its episode's generator (seeded with the episode's seed), given to
    LeRobot's `predict_action_chunk` through its `noise` argument."""

    def __init__(self, policy):
        self.policy, self.generators = policy, []
        self.predict = policy.predict_action_chunk
        policy.predict_action_chunk = self

    def start(self, seeds: list[int]) -> None:
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, batch, **kwargs):
        shape = (1, self.policy.config.chunk_size, self.policy.config.max_action_dim)
        noise = torch.cat([torch.randn(shape, generator=g) for g in self.generators])
        return self.predict(batch, noise=noise, **kwargs)


def seed_metaworld(vec_env, seeds: list[int]) -> None:
    """Make each MetaWorld episode a function of its seed, its first frame showing its own goal (see the module
    docstring); other envs seed on reset."""
    for env, seed in zip(vec_env.envs, seeds):
        inner = getattr(env.unwrapped, "_env", None)
        if inner is not None and hasattr(inner, "seeded_rand_vec"):
            inner.seed(int(seed))
            inner.seeded_rand_vec = True
            if "reset" not in vars(inner):
                inner.reset = placing_targets(inner, inner.reset)


def placing_targets(inner, reset):
    def reset_placing_targets(*args, **kwargs):
        out = reset(*args, **kwargs)
        for site in inner._target_site_config:
            inner._set_pos_site(*site)
        return out

    return reset_placing_targets


def only_env(envs: dict, task: str | None):
    (suite,) = envs.values()
    (vec_env,) = suite.values()
    if task is not None:
        for env in vec_env.envs:
            env.task_description = task
    return vec_env


class FollowActions:
    """In place of the env postprocessor: LeRobot's action (after its env postprocessor) is kept, the env is handed
    the recorded one of the same step."""

    def __init__(self, env_post, recorded: np.ndarray):
        self.env_post, self.recorded, self.kept = env_post, recorded, []

    def __call__(self, transition):
        out = self.env_post(transition)
        self.kept.append(out[ACTION][0].numpy().astype(np.float32))
        return {**out, ACTION: torch.from_numpy(self.recorded[len(self.kept) - 1])[None]}


def record(args, policy, pre, post, env_pre, env_post) -> None:
    cfg = env_config(args.env)
    noise = EpisodeNoise(policy)
    follow = np.load(args.follow) if args.follow else None
    out = {}
    for i in range(args.episodes):
        seed = args.seed + i
        vec_env = only_env(make_env(cfg, n_envs=1), args.task)
        vec_env.envs[0].set_wrapper_attr("_max_episode_steps", args.steps)  # rollout stops at K steps
        seed_metaworld(vec_env, [seed])
        noise.start([seed])
        task = vec_env.call("task_description")[0] if hasattr(vec_env.envs[0], "task_description") else ""
        stepped = env_post if follow is None else FollowActions(env_post, follow[f"ep{i}/action"])
        ran = rollout(vec_env, policy, env_pre, stepped, pre, post, seeds=[seed], return_observations=True)
        vec_env.close()
        for key, value in ran["observation"].items():
            out[f"ep{i}/obs/{key}"] = value[0, : args.steps].numpy().astype(np.float32)
        actions = ran[ACTION][0].numpy() if follow is None else np.stack(stepped.kept)
        out[f"ep{i}/action"] = actions[: args.steps].astype(np.float32)
        out[f"ep{i}/seed"] = np.array(seed)
        out[f"ep{i}/task"] = np.array(task)
    np.savez(args.output, **out)


def evaluate(args, policy, pre, post, env_pre, env_post) -> None:
    vec_env = only_env(make_env(env_config(args.env), n_envs=args.envs), args.task)
    if args.max_steps:
        for env in vec_env.envs:  # where rollout stops an episode
            env.set_wrapper_attr("_max_episode_steps", args.max_steps)
    noise = EpisodeNoise(policy)
    steps = 0
    reset, step = vec_env.reset, vec_env.step

    def seeded_reset(*a, seed=None, **k):  # each batch of episodes: their seeds, their noise
        seeds = list(seed) if seed is not None else [0] * vec_env.num_envs
        seed_metaworld(vec_env, seeds)
        noise.start(seeds)
        return reset(*a, seed=seed, **k)

    def counted_step(actions):
        nonlocal steps
        steps += vec_env.num_envs
        return step(actions)

    vec_env.reset, vec_env.step = seeded_reset, counted_step
    start = time.perf_counter()
    with torch.no_grad():
        info = eval_policy(vec_env, policy, env_pre, env_post, pre, post, n_episodes=args.episodes,
                           start_seed=args.seed)
    seconds = time.perf_counter() - start
    vec_env.close()
    with open(args.output, "w") as f:
        json.dump({"aggregated": info["aggregated"], "per_episode": info["per_episode"], "env_steps": steps,
                   "seconds": seconds, "envs": args.envs}, f, default=float)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["record", "eval"])
    parser.add_argument("export")
    parser.add_argument("tokenizer")
    parser.add_argument("sizes")
    parser.add_argument("env")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--envs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="eval: steps per episode (default: the env's).")
    parser.add_argument("--follow", default=None, help="Step the env with these recorded actions (see above).")
    parser.add_argument("--task", default=None, help="The instruction of an env that has none (see above).")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    policy, pre, post = load_policy(args.export, args.tokenizer, args.sizes)
    env_pre, env_post = make_env_pre_post_processors(env_config(args.env), policy.config)
    (record if args.mode == "record" else evaluate)(args, policy, pre, post, env_pre, env_post)


if __name__ == "__main__":
    sys.exit(main())
