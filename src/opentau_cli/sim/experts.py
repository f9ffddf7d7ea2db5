"""Demonstrations from MetaWorld's scripted experts (`metaworld.policies`) as a LeRobot v3.0 dataset: what
`opentau dataset synth DIR --env metaworld:TASK[,TASK...]` writes (docs/ARCHITECTURE.md, "Closed-loop evaluation").

Every episode is recorded through the same adapter `opentau eval --env` drives (sim/envs.py), so the dataset holds
what eval hands the policy: the corner2 camera flipped on both axes under `observation.image`, the first 4 state
dims (hand xyz, gripper) under `observation.state`, the 4-d action (xyz delta, gripper) as sent to env.step (the
expert's, clipped to the action space [-1, 1] as MetaWorld clips it), the task's words, at MetaWorld's control rate
(80 fps). Episode i of task t runs from seed S + i (per task) and ends at its first success (as eval ends it), or
after the env's 500 steps; only successful episodes are kept unless `keep_failed`. Its seed, env and success are in
its row of meta/episodes (`seed`, `env`, `success`), which `opentau eval --replay` reads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from opentau_cli.errors import UserError
from opentau_cli.sim.envs import IMAGE_KEY, make_env, parse_env, split_options

SYNTH_COMMAND = "dataset synth"  # as data/synth.py names its outputs
DEFAULT_IMAGE_SIZE = 64
_POSE = [f"{part}_{axis}" for part in ("obj1", "obj2") for axis in ("x", "y", "z", "qx", "qy", "qz", "qw")]
_FRAME = ["hand_x", "hand_y", "hand_z", "gripper", *_POSE]  # 18 dims: hand, gripper, two objects' poses
# MetaWorld's 39-d observation: this frame, the previous frame, the goal (metaworld:TASK?state=full).
STATE_NAMES = {"hand": _FRAME[:4], "full": [*_FRAME, *(f"prev_{n}" for n in _FRAME), "goal_x", "goal_y", "goal_z"]}
ACTION_NAMES = ["dx", "dy", "dz", "gripper"]


def parse_tasks(env: str) -> list:
    """`metaworld:reach-v3,push-v3[?state=full]` -> [EnvSpec, EnvSpec]; only MetaWorld ships scripted experts."""
    base, state = split_options(env)
    family, _, tasks = base.partition(":")
    if family.strip().lower() != "metaworld":
        raise UserError(f"--env {env}: scripted experts exist for MetaWorld only (e.g. --env metaworld:reach-v3,push-v3).")
    option = f"?state={state}" if state != "hand" else ""
    return [parse_env(f"metaworld:{task.strip()}{option}") for task in tasks.split(",") if task.strip()] or [parse_env(env)]


def expert_episode(env, expert, seed: int, max_steps: int | None = None) -> dict:
    """One episode of `expert` from `seed`: frames, states and actions before each step, and whether it succeeded."""
    step = env.reset(seed)
    frames, states, actions, success = [], [], [], False
    for _ in range(max_steps or env.max_steps):
        action = np.clip(np.asarray(expert.get_action(env.raw), np.float32), env.action_low, env.action_high)
        frames.append(step.pixels[IMAGE_KEY])
        states.append(step.state)
        actions.append(action)
        step = env.step(action)
        if step.success:
            success = True
            break
    return {"task": env.text, "state": np.stack(states), "action": np.stack(actions), "frames": {IMAGE_KEY: frames},
            "fields": {"seed": int(seed), "env": env.spec.name, "success": success}}


def write_expert_dataset(out_dir, env: str, *, episodes: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                         keep_failed: bool = False, max_steps: int | None = None, force: bool = False,
                         progress=None) -> dict:
    """Record `episodes` expert episodes per task into `out_dir`; returns {"kept", "failed", "path"}. Same arguments
    -> the same data and metadata files, byte for byte, and the same rendered frames; the videos' H.264 bytes can
    differ (data/video.py, `write_mp4`)."""
    from opentau_cli.data.synth import write_v3_episodes
    from opentau_cli.data.video import import_av
    from opentau_cli.store.outputs import check_target, publishing, writable_parent

    specs = parse_tasks(env)
    if episodes < 1 or image_size < 2 or image_size % 2:
        raise UserError("--episodes must be at least 1 and --image-size an even number of pixels.")
    target = Path(out_dir)
    check_target(target, force=force, command=SYNTH_COMMAND)
    writable_parent(target)
    import_av()
    policies = import_experts()
    recorded, failed = [], 0
    for spec in specs:
        sim = make_env(spec, (image_size, image_size))
        try:
            expert = policies.ENV_POLICY_MAP[spec.task]()
            for i in range(episodes):
                ep = expert_episode(sim, expert, seed + i, max_steps)
                failed += not ep["fields"]["success"]
                if ep["fields"]["success"] or keep_failed:
                    recorded.append(ep)
                if progress is not None:
                    progress(len(recorded) + failed if not keep_failed else len(recorded), episodes * len(specs))
        finally:
            sim.close()
    if not recorded:
        raise UserError(f"None of the {failed} expert episodes succeeded; pass --keep-failed to record them anyway.")
    with publishing(target, force=force, command=SYNTH_COMMAND) as staging:
        staging.mkdir()
        write_v3_episodes(staging, recorded, fps=sim.fps, robot_type="metaworld_sawyer", state_names=STATE_NAMES[specs[0].state],
                          action_names=ACTION_NAMES,
                          extra_info={"opentau_synth": {"env": env, "seed": seed, "episodes_per_task": episodes,
                                                        "image_size": [image_size, image_size],
                                                        "camera": "corner2, flipped on both axes",
                                                        "keep_failed": keep_failed}})
    return {"kept": len(recorded), "failed": failed, "path": str(target)}


def import_experts():
    """metaworld.policies (its scripted experts by task: `ENV_POLICY_MAP`), or one sentence to install it."""
    import warnings

    from opentau_cli.sim.envs import SIM_EXTRA_FIX

    try:
        import metaworld.policies as policies
    except ImportError:
        raise UserError(f"MetaWorld is not installed: {SIM_EXTRA_FIX}.") from None
    # Its experts' gains go past [-1, 1] by design (the env clips; so do we, recording what the env executes).
    warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high", category=UserWarning)
    return policies
