"""Statistics of state and action (docs/ARCHITECTURE.md, "Normalization statistics").

mean / std (pi0's normalization) come from the dataset's meta files when it has them, else they are computed.
q01 / q99 (pi05's quantile normalization) come from meta/stats.json when it has them and the run uses every episode
(then they describe exactly the frames trained on); else they are computed from the chosen episodes' frames, which
are in memory anyway. Per-episode quantiles are not pooled: a mean of quantiles is not a quantile.
"""

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


def quantiles(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1st and 99th percentile of each column of a (frames, width) array (linear interpolation)."""
    q01, q99 = np.quantile(values.astype(np.float64), [0.01, 0.99], axis=0)
    return q01, q99


def _quantiles_from_stats_json(meta: DatasetMeta, key: str, width: int):
    s = (meta.stats or {}).get(key)
    if not s or "q01" not in s or "q99" not in s:
        return None
    q01, q99 = s["q01"].reshape(-1), s["q99"].reshape(-1)
    return (q01, q99) if q01.size == width and q99.size == width else None


def dataset_stats(meta: DatasetMeta, episodes: list[int], state_key: str, action_key: str, state: np.ndarray, action: np.ndarray) -> dict:
    """mean/std/q01/q99 of the chosen episodes' state and action (where each comes from: see the module docstring)."""
    every_episode = set(episodes) == set(meta.episodes)
    out = {}
    for name, key, values in (("state", state_key, state), ("action", action_key, action)):
        width = values.shape[1]
        moments = _from_episodes(meta, episodes, key, width) or _from_stats_json(meta, key, width)
        if moments is None:
            moments = (values.astype(np.float64).mean(0), values.astype(np.float64).std(0))
        bounds = _quantiles_from_stats_json(meta, key, width) if every_episode else None
        if bounds is None:
            bounds = quantiles(values)
        out[name] = {stat: [float(x) for x in array] for stat, array in zip(("mean", "std", "q01", "q99"), (*moments, *bounds))}
    return out


def feature_stats(values: np.ndarray) -> dict:
    """LeRobot's per-feature stats record for a (frames, width) array, with the q01/q99 that LeRobot v3.0 writes too."""
    values = values.astype(np.float64)
    q01, q99 = quantiles(values)
    return {
        "min": values.min(0).tolist(),
        "max": values.max(0).tolist(),
        "mean": values.mean(0).tolist(),
        "std": values.std(0).tolist(),
        "q01": q01.tolist(),
        "q99": q99.tolist(),
        "count": [int(values.shape[0])],
    }
