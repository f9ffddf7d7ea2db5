"""`opentau eval --replay DATASET --env ENV`: a dataset's recorded actions replayed in the simulator from each
episode's recorded seed, and the share of episodes that succeed: the data's action convention checked against the
simulator before any policy is trained on it (docs/ARCHITECTURE.md, "Closed-loop evaluation")."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from opentau_cli.errors import UserError
from opentau_cli.sim.envs import make_env, parse_env


def recorded_episodes(root: Path, scene: str) -> list[tuple[int, np.ndarray]]:
    """(seed, actions) of every episode of a v3.0 dataset recorded in `scene` (EnvSpec.scene: whatever state it
    recorded, the actions are the same; its meta/episodes rows carry `seed` and `env`, as `dataset synth --env`
    writes them)."""
    import pyarrow.parquet as pq

    from opentau_cli.data.meta import read_meta

    meta = read_meta(root)
    if meta.version != "v3.0":
        raise UserError(f"{root}: --replay reads LeRobot v3.0 datasets that record each episode's seed (dataset synth --env).")
    rows = pq.read_table(sorted((root / "meta" / "episodes").rglob("*.parquet"))).to_pylist()
    if not rows or "seed" not in rows[0]:
        raise UserError(f"{root}: its episodes record no seed, so they cannot be replayed from the state they started in.")
    data = pq.read_table(sorted((root / "data").rglob("*.parquet")), columns=["episode_index", "action"])
    index = data.column("episode_index").to_numpy()
    actions = np.asarray(data.column("action").to_pylist(), np.float32)
    picked = [r for r in rows if str(r.get("env") or scene).partition("?")[0] == scene]
    if not picked:
        envs = sorted({str(r.get("env")) for r in rows})
        raise UserError(f"{root}: no episode was recorded in {scene} (its episodes are from {', '.join(envs)}).")
    return [(int(r["seed"]), actions[index == r["episode_index"]]) for r in picked]


def replay_dataset(root, env: str, *, progress=None) -> dict:
    """Replay every episode of `root` recorded in `env`; {"env", "episodes_run", "successes", "success_rate",
    "success_rate_95", "episodes": [{"seed", "success", "steps"}]}."""
    from opentau_cli.sim.rollout import wilson_interval

    spec = parse_env(env)
    root = Path(root).expanduser()
    if not (root / "meta" / "info.json").is_file():
        raise UserError(f"--replay {root}: not a LeRobot dataset (no meta/info.json).")
    episodes = recorded_episodes(root, spec.scene)
    sim = make_env(spec, (32, 32))  # images are not looked at: the smallest cheap render
    out = []
    try:
        for seed, actions in episodes:
            sim.reset(seed)
            success = False
            for action in actions:
                success = sim.step(action).success or success
            out.append({"seed": seed, "success": success, "steps": len(actions)})
            if progress is not None:
                progress(len(out), len(episodes), sum(e["success"] for e in out))
    finally:
        sim.close()
    wins = sum(e["success"] for e in out)
    return {"env": spec.name, "episodes_run": len(out), "successes": wins, "success_rate": wins / len(out),
            "success_rate_95": list(wilson_interval(wins, len(out))), "episodes": out}
