"""State and action normalization (docs/ARCHITECTURE.md, "Normalization statistics").

pi05 uses quantile normalization, which maps the 1st..99th percentile onto [-1, 1]; pi0 uses mean / std. Both use
openpi's formulas and epsilon, so the statistics shipped with a published checkpoint mean the same thing here.
"""

from __future__ import annotations

import torch

EPS = 1e-6
QUANTILE, MEAN_STD = "quantile", "mean_std"
# Which statistics each mode reads, and the values that make it the identity until real ones are set.
STATS_OF = {QUANTILE: ("q01", "q99"), MEAN_STD: ("mean", "std")}
IDENTITY = {"mean": 0.0, "std": 1.0, "q01": -1.0, "q99": 1.0}


def mode_of(policy_type: str) -> str:
    return MEAN_STD if policy_type == "pi0" else QUANTILE


def normalize(x: torch.Tensor, stats: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
    """Raw values -> model space; `stats` hold at least x's width (real dims first)."""
    width = x.shape[-1]
    if mode == QUANTILE:
        q01, q99 = stats["q01"][:width], stats["q99"][:width]
        return (x - q01) / (q99 - q01 + EPS) * 2.0 - 1.0
    return (x - stats["mean"][:width]) / (stats["std"][:width] + EPS)


def unnormalize(x: torch.Tensor, stats: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
    """Model space -> raw values: the exact inverse of `normalize`."""
    width = x.shape[-1]
    if mode == QUANTILE:
        q01, q99 = stats["q01"][:width], stats["q99"][:width]
        return (x + 1.0) / 2.0 * (q99 - q01 + EPS) + q01
    return x * (stats["std"][:width] + EPS) + stats["mean"][:width]
