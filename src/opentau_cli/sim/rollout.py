"""Closed-loop evaluation: a policy drives simulated episodes from seeded resets; success rate with its Wilson 95%
interval, returns, lengths, per-episode records (eval_info.json), videos of the first episodes, and optionally the
first steps' observations and actions (steps.npz) (docs/ARCHITECTURE.md, "Closed-loop evaluation").

- Episode i runs from seed S + i. The policy's sampling noise for that episode comes from a torch.Generator seeded
  with S + i, chunk after chunk, so an episode's actions do not depend on `--envs` or on the other episodes.
- The policy is loaded and fed as `opentau serve` does (tools/serve.py: `load_served`, `ServedPolicy.batch`): the
  same normalization, resizing and prompt. Each chunk of `n_action_steps` actions is executed in order, then the
  policy is asked again, as an openpi client executes the chunks `opentau serve` answers.
- `--envs N` envs step in lockstep; every env whose chunk is used up is answered in one batched forward.
- Actions go to the env as the policy gives them (the env clips what it clips); the share outside the env's action
  space is reported.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from opentau_cli.errors import UserError
from opentau_cli.sim.envs import ENV_FPS, EnvSpec, SimEnv, make_env, parse_env, policy_inputs, prepare_rendering
from opentau_cli.sim.images import check_images

EVAL_INFO = "eval_info.json"
STEPS_FILE = "steps.npz"
VIDEOS = "videos"
COMMAND = "eval --env"  # its name in the output convention's marker (store/outputs.py)


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval of a success rate (95% by default): sensible at 0 and n successes, unlike p +- z*se."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # exact ends at 0 and n successes (the formula leaves a rounding error there)
    return (0.0 if successes == 0 else max(0.0, centre - half)), (1.0 if successes == n else min(1.0, centre + half))


def parse_camera_map(items: list[str] | None) -> dict[str, str]:
    """['policy_cam=env_cam', ...] -> {policy_cam: env_cam}."""
    out = {}
    for item in items or []:
        policy_cam, sep, env_cam = item.partition("=")
        if not sep or not policy_cam.strip() or not env_cam.strip():
            raise UserError(f"--camera-map {item}: expected POLICY_CAMERA=ENV_CAMERA, e.g. "
                            "observation.images.top=observation.image.")
        out[policy_cam.strip()] = env_cam.strip()
    return out


# ------------------------------------------------------------------------------------------- policy against env
def check_policy_env(served, env: SimEnv, camera_map: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """({policy camera: env camera}, warnings): what would make the rollout meaningless is a UserError naming the fix."""
    cameras = [c for c in served.cameras if c]
    for given in camera_map:
        if given not in cameras:
            raise UserError(f"--camera-map {given}=...: the policy has no camera '{given}' (its cameras: {', '.join(cameras)}).")
    mapping = {}
    for camera in cameras:
        source = camera_map.get(camera, camera)
        if source not in env.cameras:
            raise UserError(f"The policy was trained on camera '{camera}', which {env.spec.name} does not provide (it "
                            f"renders {', '.join(env.cameras)}): map one with --camera-map {camera}={env.cameras[0]}.")
        mapping[camera] = source
    if served.state_width != env.state_dim:
        raise UserError(f"The policy was trained on a {served.state_width}-dim state but {env.spec.name} gives "
                        f"{env.state_dim} dims: it was trained for another robot or another state convention.")
    if served.action_width != env.action_dim:
        raise UserError(f"The policy acts with {served.action_width} dims but {env.spec.name} takes {env.action_dim}: "
                        "it was trained for another robot or another action convention.")
    notes = []
    height, width = served.policy.cfg.image_resolution
    if env.image_size and tuple(env.image_size) != (height, width):
        notes.append(f"{env.spec.name} renders {env.image_size[0]}x{env.image_size[1]} images; the policy sees "
                     f"{height}x{width} (resized with padding, as in training).")
    mean = served.policy.action_mean[: env.action_dim].float().cpu().numpy()
    outside = (mean < env.action_low - 1e-6) | (mean > env.action_high + 1e-6)
    if outside.any():
        notes.append(f"the mean action of the policy's statistics lies outside {env.spec.name}'s action space in dims "
                     f"{np.flatnonzero(outside).tolist()}: the data may use another action convention (check it with "
                     "`opentau eval --replay DATASET`).")
    return mapping, notes


# ------------------------------------------------------------------------------------------- rollouts
@dataclass
class Episode:
    index: int
    seed: int
    success: bool = False
    steps: int = 0
    ret: float = 0.0
    clipped: int = 0  # action entries outside the env's action space
    frames: list = field(default_factory=list)  # first camera's pixels, for a video
    obs: list = field(default_factory=list)  # policy inputs of the first recorded steps
    actions: list = field(default_factory=list)

    def record(self) -> dict:
        return {"index": self.index, "seed": self.seed, "success": self.success, "steps": self.steps,
                "return": self.ret}


class _Running:
    def __init__(self, episode: Episode, first, generator):
        self.episode, self.last, self.generator, self.queue = episode, first, generator, []


def run_episodes(served, spec: EnvSpec | str, seeds: list[int], *, envs: int = 1, camera_map: dict | None = None,
                 image_size: tuple[int, int] | None = None, max_steps: int | None = None, videos: int = 0,
                 record_steps: int = 0, fast_render: bool = True, progress=None, echo=None,
                 announce: str | None = None, overrides: dict | None = None,
                 dataset: str | None = None) -> list[Episode]:
    """Episodes from `seeds` driven by `served` (a tools.serve.ServedPolicy), `envs` at a time. `progress(done,
    total, successes)` after each episode; the warnings of the policy-against-env check, then `announce`, go to
    `echo`. `overrides` and `dataset` name the training data the env's images are held against, as they named it
    when the policy was loaded."""
    import torch

    spec = parse_env(spec) if isinstance(spec, str) else spec
    if envs < 1:
        raise UserError("--envs must be at least 1.")
    size = tuple(image_size) if image_size else tuple(served.policy.cfg.image_resolution)
    pool = [make_env(spec, size, fast_render)]
    try:
        mapping, notes = check_policy_env(served, pool[0], camera_map or {})
        notes += check_images(served, pool[0], mapping, pool[0].reset(seeds[0]), overrides, dataset)
        for note in notes:
            (echo or warnings.warn)(f"Warning: {note}")
        if announce and echo:
            echo(announce)
        pool += [make_env(spec, size, fast_render) for _ in range(min(envs, len(seeds)) - 1)]
        limit = max_steps or pool[0].max_steps
        pending = list(enumerate(seeds))
        slots: list[_Running | None] = [None] * len(pool)
        done: list[Episode] = []
        while True:
            for k, env in enumerate(pool):
                if slots[k] is None and pending:
                    index, seed = pending.pop(0)
                    slots[k] = _Running(Episode(index, int(seed)), env.reset(seed), torch.Generator().manual_seed(int(seed)))
                    if index < videos:
                        slots[k].episode.frames.append(next(iter(slots[k].last.pixels.values())))
            active = [k for k, run in enumerate(slots) if run is not None]
            if not active:
                break
            asking = [k for k in active if not slots[k].queue]
            if asking:
                chunks = served.infer_many([_observation(served, mapping, pool[k], slots[k].last) for k in asking],
                                           [slots[k].generator for k in asking])
                for k, chunk in zip(asking, chunks):
                    slots[k].queue = list(chunk)
            for k in active:
                run, env = slots[k], pool[k]
                ep = run.episode
                action = np.asarray(run.queue.pop(0), np.float32)
                if ep.steps < record_steps:
                    ep.obs.append(policy_inputs(run.last))
                    ep.actions.append(action)
                ep.clipped += int(((action < env.action_low) | (action > env.action_high)).sum())
                run.last = env.step(action)
                ep.steps += 1
                ep.ret += run.last.reward
                ep.success = ep.success or run.last.success
                if ep.index < videos:
                    ep.frames.append(next(iter(run.last.pixels.values())))
                if run.last.done or ep.steps >= limit:
                    done.append(ep)
                    slots[k] = None
                    if progress is not None:
                        progress(len(done), len(seeds), sum(e.success for e in done))
    finally:
        for env in pool:
            env.close()
    return sorted(done, key=lambda e: e.index)


def _observation(served, mapping: dict[str, str], env: SimEnv, step) -> dict:
    """The env's step as the observation `opentau serve` takes: each policy camera from its env camera (uint8
    pixels), the state, the task's words."""
    from opentau_cli.tools.serve import PROMPT_KEY

    obs = {camera: step.pixels[source] for camera, source in mapping.items()}
    obs[served.state_key] = step.state
    obs[PROMPT_KEY] = env.text
    return obs


def summary(episodes: list[Episode], action_dim: int) -> dict:
    n, wins = len(episodes), sum(e.success for e in episodes)
    low, high = wilson_interval(wins, n)
    actions = sum(e.steps for e in episodes) * action_dim
    return {
        "episodes_run": n, "successes": wins, "success_rate": wins / n if n else 0.0,
        "success_rate_95": [low, high],
        "mean_return": float(np.mean([e.ret for e in episodes])) if n else 0.0,
        "mean_steps": float(np.mean([e.steps for e in episodes])) if n else 0.0,
        "clipped_action_share": sum(e.clipped for e in episodes) / actions if actions else 0.0,
    }


def video_name(episode: Episode) -> str:
    return f"episode_{episode.index:03d}_seed{episode.seed}_{'success' if episode.success else 'failure'}.mp4"


def steps_arrays(episodes: list[Episode]) -> dict[str, np.ndarray]:
    """What steps.npz holds: `ep{i}/obs/<policy input key>` (K, ...) float32, `ep{i}/action` (K, action_dim)
    float32 as sent to env.step, `ep{i}/seed`."""
    arrays = {}
    for ep in episodes:
        if not ep.obs:
            continue
        for key in ep.obs[0]:
            arrays[f"ep{ep.index}/obs/{key}"] = np.stack([o[key] for o in ep.obs]).astype(np.float32)
        arrays[f"ep{ep.index}/action"] = np.stack(ep.actions).astype(np.float32)
        arrays[f"ep{ep.index}/seed"] = np.int64(ep.seed)
    return arrays


# ------------------------------------------------------------------------------------------- the library entry points
def load_policy(source, *, overrides: dict | None = None, dataset: str | None = None, device: str | None = None,
                weights: str | None = None):
    """The policy of any source `opentau eval` takes (a run, RUN:STEP, RUN:best, a remote URL, a Hub repo id, an
    export), loaded as `opentau serve` loads it."""
    from opentau_cli.tools.serve import load_served

    return load_served(source, overrides=overrides, dataset=dataset, device=device, weights=weights)


def record_steps(source, env: str, seeds: list[int], steps: int, *, camera_map: dict | None = None,
                 image_size: tuple[int, int] | None = None, device: str | None = None, envs: int = 1,
                 fast_render: bool = True) -> dict:
    """The first `steps` observations (as handed to the policy's preprocessing, LeRobot's keys) and actions (as sent
    to env.step) of the episodes from `seeds`: {"ep{i}/obs/<key>": ..., "ep{i}/action": ..., "ep{i}/seed": ...},
    the arrays steps.npz holds."""
    served = load_policy(source, device=device)
    episodes = run_episodes(served, env, seeds, envs=envs, camera_map=camera_map, image_size=image_size,
                            max_steps=steps, record_steps=steps, fast_render=fast_render)
    return steps_arrays(episodes)


def evaluate_in_sim(source, env: str, *, rollouts: int = 50, seed: int = 0, output: Path | None = None,
                    envs: int = 1, videos: int = 0, record: int = 0, camera_map: dict | None = None,
                    image_size: tuple[int, int] | None = None, max_steps: int | None = None,
                    overrides: dict | None = None, dataset: str | None = None, device: str | None = None,
                    weights: str | None = None, force: bool = False, fast_render: bool = True,
                    echo=print, progress=None) -> dict:
    """Roll out `source` in `env` from seeds seed..seed+rollouts-1 and write eval_info.json (and videos/, steps.npz)
    into `output`; returns eval_info. Callable from another process with a checkpoint directory."""
    from opentau_cli.store.manifest import write_json_atomic
    from opentau_cli.store.outputs import check_target, publishing, writable_parent
    from opentau_cli.tools.inference import describe_weights

    spec = parse_env(env)
    if rollouts < 1 or videos < 0 or record < 0:
        raise UserError("--rollouts must be at least 1, --videos and --record-steps at least 0.")
    prepare_rendering(spec)  # a missing GL library is said before the policy loads
    path = Path(str(source)).expanduser()
    env_part = re.sub(r"[^\w.-]", "-", spec.name)  # metaworld:reach-v3?state=full -> metaworld-reach-v3-state-full
    output = Path(output) if output is not None else Path("outputs") / "eval" / f"{path.name or 'model'}-{env_part}"
    check_target(output, force=force, source=path, command=COMMAND)
    writable_parent(output)
    if videos:
        from opentau_cli.data.video import import_av

        import_av()
    served = load_policy(source, overrides=overrides, dataset=dataset, device=device, weights=weights)
    seeds = list(range(seed, seed + rollouts))
    announce = (f"Evaluating the {describe_weights(served.origin)} in {spec.name}: {rollouts} episodes from seed "
                f"{seed}, {envs} env(s) at a time...")
    episodes = run_episodes(served, spec, seeds, envs=envs, camera_map=camera_map, image_size=image_size,
                            max_steps=max_steps, videos=videos, record_steps=record, fast_render=fast_render,
                            progress=progress, echo=echo, announce=announce, overrides=overrides, dataset=dataset)
    info = {
        "env": spec.name, "source": str(source), "seed": seed, "rollouts": rollouts,
        "weights": served.origin.get("weights"), "step": served.origin.get("step"),
        "n_action_steps": served.policy.cfg.n_action_steps,
        "image_size": list(image_size or served.policy.cfg.image_resolution), "fast_render": fast_render,
        "camera_map": camera_map or {},
        **summary(episodes, served.action_width),
        "episodes": [e.record() for e in episodes],
        "videos": [f"{VIDEOS}/{video_name(e)}" for e in episodes if e.index < videos],
    }
    with publishing(output, force=force, source=path, command=COMMAND) as staging:
        staging.mkdir()
        write_json_atomic(staging / EVAL_INFO, info)
        if videos:
            from opentau_cli.data.video import write_mp4

            fps = ENV_FPS[spec.family]
            for ep in episodes[:videos]:
                write_mp4(staging / VIDEOS / video_name(ep), _even(ep.frames), fps)
        if record:
            with open(staging / STEPS_FILE, "wb") as f:
                np.savez(f, **steps_arrays(episodes))
    return {**info, "output": str(output)}


def _even(frames: list[np.ndarray]) -> list[np.ndarray]:
    """H.264 in yuv420p needs even sides: drop a last odd row or column."""
    h, w = frames[0].shape[:2]
    return [f[: h - h % 2, : w - w % 2] for f in frames]
