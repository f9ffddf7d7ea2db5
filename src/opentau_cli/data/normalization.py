"""State and action normalization (docs/ARCHITECTURE.md, "Normalization statistics").

pi05 uses quantile normalization, which maps the 1st..99th percentile onto [-1, 1]; pi0 uses mean / std. Both use
openpi's formulas and epsilon, so the statistics shipped with a published checkpoint mean the same thing here.
The functions take torch tensors (the policy) or numpy arrays (the data layer, which carries a mixture member's
values into the policy's statistics); this module imports neither, so data workers do not load the policy package.
"""

from __future__ import annotations

EPS = 1e-6
QUANTILE, MEAN_STD = "quantile", "mean_std"
STATS = ("mean", "std", "q01", "q99")  # what a policy holds per feature, whichever mode it normalizes with
# Which statistics each mode reads, and the values that make it the identity until real ones are set.
STATS_OF = {QUANTILE: ("q01", "q99"), MEAN_STD: ("mean", "std")}
IDENTITY = {"mean": 0.0, "std": 1.0, "q01": -1.0, "q99": 1.0}


def mode_of(policy_type: str) -> str:
    return MEAN_STD if policy_type == "pi0" else QUANTILE


def normalize(x, stats: dict, mode: str):
    """Raw values -> model space; `stats` hold at least x's width (real dims first)."""
    width = x.shape[-1]
    if mode == QUANTILE:
        q01, q99 = stats["q01"][:width], stats["q99"][:width]
        return (x - q01) / (q99 - q01 + EPS) * 2.0 - 1.0
    return (x - stats["mean"][:width]) / (stats["std"][:width] + EPS)


def unnormalize(x, stats: dict, mode: str):
    """Model space -> raw values: the exact inverse of `normalize`."""
    width = x.shape[-1]
    if mode == QUANTILE:
        q01, q99 = stats["q01"][:width], stats["q99"][:width]
        return (x + 1.0) / 2.0 * (q99 - q01 + EPS) + q01
    return x * (stats["std"][:width] + EPS) + stats["mean"][:width]
