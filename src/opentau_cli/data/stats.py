"""Mean/std of state and action (docs/ARCHITECTURE.md, "Normalization statistics"): from the dataset's meta files when it has them, else computed."""

from __future__ import annotations

import numpy as np

from opentau_cli.data.meta import DatasetMeta


def aggregate(parts: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Pool (count, mean, std) of episodes into one mean/std (parallel-variance formula)."""
    counts = np.array([c for c, _, _ in parts], dtype=np.float64)
    means = np.stack([m for _, m, _ in parts])
    stds = np.stack([s for _, _, s in parts])
    total = counts.sum()
    mean = (counts[:, None] * means).sum(0) / total
    var = (counts[:, None] * (stds**2 + (means - mean) ** 2)).sum(0) / total
    return mean, np.sqrt(np.maximum(var, 0.0))


def _from_episodes(meta: DatasetMeta, episodes: list[int], key: str, width: int):
    parts = []
    for ep in episodes:
        s = meta.episodes[ep].stats.get(key)
        if not s or "mean" not in s or "std" not in s:
            return None
        mean, std = s["mean"].reshape(-1), s["std"].reshape(-1)
        if mean.size != width or std.size != width:
            return None
        count = int(np.asarray(s.get("count", meta.episodes[ep].length)).reshape(-1)[0])
        parts.append((count, mean, std))
    return aggregate(parts) if parts else None


def _from_stats_json(meta: DatasetMeta, key: str, width: int):
    s = (meta.stats or {}).get(key)
    if not s or "mean" not in s or "std" not in s:
        return None
    mean, std = s["mean"].reshape(-1), s["std"].reshape(-1)
    return (mean, std) if mean.size == width and std.size == width else None


def dataset_stats(meta: DatasetMeta, episodes: list[int], state_key: str, action_key: str, state: np.ndarray, action: np.ndarray) -> dict:
    """Stats of the chosen episodes: per-episode stats pooled; else meta/stats.json (whole dataset); else computed."""
    out = {}
    for name, key, values in (("state", state_key, state), ("action", action_key, action)):
        width = values.shape[1]
        found = _from_episodes(meta, episodes, key, width) or _from_stats_json(meta, key, width)
        if found is None:
            found = (values.astype(np.float64).mean(0), values.astype(np.float64).std(0))
        out[name] = {"mean": [float(x) for x in found[0]], "std": [float(x) for x in found[1]]}
    return out


def feature_stats(values: np.ndarray) -> dict:
    """LeRobot's per-feature stats record for a (frames, width) array."""
    values = values.astype(np.float64)
    return {
        "min": values.min(0).tolist(),
        "max": values.max(0).tolist(),
        "mean": values.mean(0).tolist(),
        "std": values.std(0).tolist(),
        "count": [int(values.shape[0])],
    }
