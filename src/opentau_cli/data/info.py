"""`describe_dataset`: what `opentau dataset info` prints, as plain data."""

from __future__ import annotations

from pathlib import Path

from opentau_cli.data.meta import read_meta
from opentau_cli.data.stats import aggregate


def _feature_stats(meta, key: str) -> dict | None:
    """Mean/std of one feature over all episodes, from the meta files only (None when they do not have it)."""
    parts = []
    for ep in meta.episodes.values():
        s = ep.stats.get(key)
        if not s or "mean" not in s or "std" not in s:
            parts = []
            break
        count = int(s["count"].reshape(-1)[0]) if "count" in s else ep.length
        parts.append((count, s["mean"].reshape(-1), s["std"].reshape(-1)))
    if parts:
        mean, std = aggregate(parts)
        return {"mean": mean.tolist(), "std": std.tolist(), "source": "per-episode stats"}
    s = (meta.stats or {}).get(key)
    if s and "mean" in s and "std" in s:
        return {"mean": s["mean"].reshape(-1).tolist(), "std": s["std"].reshape(-1).tolist(), "source": "meta/stats.json"}
    return None


def describe_dataset(root: str | Path) -> dict:
    meta = read_meta(root)
    features = {
        key: {"dtype": f.get("dtype"), "shape": list(f.get("shape", []))} for key, f in meta.features.items()
    }
    vectors = [k for k, f in meta.features.items() if f.get("dtype") in ("float32", "float64") and k != "timestamp"]
    return {
        "root": str(meta.root),
        "codebase_version": meta.info.get("codebase_version"),
        "robot_type": meta.info.get("robot_type"),
        "fps": meta.fps,
        "episodes": len(meta.episodes),
        "frames": sum(e.length for e in meta.episodes.values()),
        "tasks": [meta.tasks[i] for i in sorted(meta.tasks)],
        "cameras": meta.camera_features,
        "features": features,
        "stats": {k: _feature_stats(meta, k) for k in vectors},
    }


def verify_dataset(root: str | Path, *, state_key: str = "observation.state", action_key: str = "action", on_episode=None,
                   files=None) -> int:
    """Read every frame the way training does (numbers, every camera decoded); returns frames read.

    Raises UserError naming the file / key / episode at the first problem (missing file or column, corrupt image,
    missing or short video), so a dataset can be checked before a long run instead of failing mid-way.
    """
    from opentau_cli.data.dataset import LeRobotDataset
    from opentau_cli.data.files import LOCAL

    meta = read_meta(root)
    ds = LeRobotDataset(
        root, chunk_size=1, image_resolution=(8, 8), num_cameras=max(1, len(meta.camera_features)),
        state_key=state_key, action_key=action_key, files=files or LOCAL,
    )
    for idx in range(len(ds)):  # frames are in episode order
        ds[idx]
        if on_episode and (idx + 1 == len(ds) or ds.episode_of(idx + 1) != ds.episode_of(idx)):
            on_episode(ds.episode_of(idx))
    return len(ds)


def describe_mixture(cfg) -> dict:
    """Each dataset a config trains on (the mixture's members, or its one dataset): weight, share of the draws, the
    episode split, and how often an epoch goes through its training frames. From the meta files only."""
    from opentau_cli.data.build import split_episodes
    from opentau_cli.data.mixture import draw_counts
    from opentau_cli.data.remote import member_files

    members = cfg.dataset.members()
    rows = []
    for m in members:
        root, files = member_files(m, cfg.dataset)
        meta = read_meta(root)
        train_eps, val_eps = split_episodes(root, cfg.validation.val_split, cfg.seed, m.episodes)
        rows.append({
            "name": m.label, "root": files.url or str(root), "codebase_version": meta.info.get("codebase_version"),
            "robot_type": meta.info.get("robot_type"), "fps": meta.fps, "weight": m.weight,
            "train_episodes": len(train_eps), "val_episodes": len(val_eps),
            "train_frames": sum(meta.episodes[e].length for e in train_eps),
            "state": f"{m.state_key} ({meta.width(m.state_key)})" if m.state_key in meta.features else m.state_key,
            "action": f"{m.action_key} ({meta.width(m.action_key)})" if m.action_key in meta.features else m.action_key,
            "cameras": meta.camera_features,
        })
    draws = sum(r["train_frames"] for r in rows)
    # One dataset is read in a permutation of its frames; a mixture draws by weight (data/mixture.py).
    counts = draw_counts([m.weight for m in members], draws) if cfg.dataset.mixture is not None else [draws]
    for row, count in zip(rows, counts):
        row["draws_per_epoch"] = int(count)
        row["share"] = int(count) / draws if draws else 0.0
        row["passes_per_epoch"] = int(count) / row["train_frames"] if row["train_frames"] else 0.0
    return {"mixture": cfg.dataset.mixture is not None, "draws_per_epoch": draws, "seed": cfg.seed,
            "val_split": cfg.validation.val_split, "members": rows}
