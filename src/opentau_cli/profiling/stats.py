"""Turn per-rank step timings into the numbers `opentau profile` reports (and writes with --json).

Everything here is plain data in, plain data out (JSON-ready dicts), so the same code serves the worker, the
CLI and the benchmarks, and is unit-tested without launching anything.
"""

from __future__ import annotations

import math
import resource
import statistics
import sys

from opentau_cli.train.timing import PHASES

# Rows of the phase table, in order: the timed phases, time spent outside any phase, the whole step.
REPORT_PHASES = (*PHASES, "other", "total")

PHASE_LABELS = {
    "data": "data wait",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step (incl. unscale/clip)",
    "zero_grad_sched": "zero-grad + scheduler",
    "sync": "metric gather / sync",
    "other": "other (outside phases)",
    "total": "total step",
}

# Dense bf16 peak per device, FLOP/s (vendor datasheets). Used only for MFU; unknown devices give "n/a".
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,  # fp16 tensor cores; V100 has no bf16
}

# Where each backend's time lands, said next to the table (the phase names alone would mislead under DeepSpeed).
ACCOUNTING_NOTES = {
    "deepspeed": (
        "DeepSpeed: 'backward' is engine.backward() (incl. the gradient reduce-scatter / all-reduce) and 'optimizer "
        "step' is engine.step() (unscale, gradient clipping, the optimizer step, the ZeRO parameter update), which "
        "the training step runs separately where Accelerate's backward() would run both."
    ),
    "ddp": "DDP: the gradient all-reduce overlaps with backward and is counted in 'backward'.",
    "single": "Single process: no gradient communication.",
    "fsdp": "FSDP: parameter all-gathers are counted in forward/backward, the gradient reduce-scatter in 'backward'.",
}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), like numpy's default."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def with_other(step: dict[str, float]) -> dict[str, float]:
    """A step record plus 'other': step time not inside any phase (never negative from clock jitter)."""
    inside = sum(step.get(name, 0.0) for name in PHASES)
    return {**{name: step.get(name, 0.0) for name in PHASES}, "other": max(0.0, step["total"] - inside), "total": step["total"]}


def phase_stats(steps: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per phase: mean, median, p95 (seconds) and share of the mean step time."""
    if not steps:
        raise ValueError("no measured steps")
    rows = [with_other(s) for s in steps]
    mean_total = statistics.fmean(r["total"] for r in rows)
    out = {}
    for name in REPORT_PHASES:
        values = [r[name] for r in rows]
        mean = statistics.fmean(values)
        out[name] = {
            "mean_s": mean,
            "median_s": statistics.median(values),
            "p95_s": percentile(values, 95),
            "share": mean / mean_total if mean_total > 0 else 0.0,
        }
    return out


def peak_memory() -> dict:
    """This process's peak memory: CUDA peak allocated when on a GPU, else the process peak RSS."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return {"bytes": int(torch.cuda.max_memory_allocated()), "kind": "cuda_peak_allocated"}
    except ImportError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return {"bytes": int(rss if sys.platform == "darwin" else rss * 1024), "kind": "process_peak_rss"}


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return "cpu"


def device_peak_flops(name: str) -> float | None:
    """Known bf16 peak of a device by its name, else None (then MFU is 'n/a')."""
    for key, flops in PEAK_FLOPS_BF16.items():
        if key.lower() in name.lower():
            return flops
    return None


def rank_result(rank: int, steps: list[dict[str, float]]) -> dict:
    """What each rank sends to rank 0 after the measured steps."""
    return {"rank": rank, "steps": steps, "peak_memory": peak_memory(), "device": device_name()}


def summarize(
    ranks: list[dict],
    *,
    global_batch_size: int,
    backend: str = "single",
    flops_per_sample: float | None = None,
    peak_flops_per_device: float | None = None,
    run: dict | None = None,
) -> dict:
    """The full profile report from every rank's result (see REPORT_FIELDS).

    Throughput uses the slowest rank: a synchronous step finishes when its last rank does.
    """
    if not ranks or not all(r["steps"] for r in ranks):
        raise ValueError("every rank needs at least one measured step")
    ranks = sorted(ranks, key=lambda r: r["rank"])
    slowest = max(ranks, key=lambda r: sum(s["total"] for s in r["steps"]))
    n_steps = len(slowest["steps"])
    elapsed = sum(s["total"] for s in slowest["steps"])
    steps_per_s = n_steps / elapsed if elapsed > 0 else float("inf")
    samples_per_s = steps_per_s * global_batch_size
    world_size = len(ranks)
    if peak_flops_per_device is None:
        peak_flops_per_device = device_peak_flops(slowest.get("device", "cpu"))
    mfu = None
    if flops_per_sample and peak_flops_per_device:
        mfu = flops_per_sample * samples_per_s / (peak_flops_per_device * world_size)
    return {
        "mode": "train_step",
        "model_built": True,
        "run": dict(run or {}),
        "backend": backend,
        "world_size": world_size,
        "global_batch_size": global_batch_size,
        "measured_steps": n_steps,
        "slowest_rank": slowest["rank"],
        "phases": phase_stats(slowest["steps"]),
        "per_rank_step_time_s": {str(r["rank"]): statistics.fmean(s["total"] for s in r["steps"]) for r in ranks},
        "step_time_s": elapsed / n_steps,
        "steps_per_s": steps_per_s,
        "samples_per_s": samples_per_s,
        "peak_memory": [{"rank": r["rank"], **r["peak_memory"]} for r in ranks],
        "device": slowest.get("device", "cpu"),
        "flops_per_sample": flops_per_sample,
        "peak_flops_per_device": peak_flops_per_device,
        "mfu": mfu,
        "accounting": ACCOUNTING_NOTES.get(backend, ""),
    }


REPORT_FIELDS = (
    "mode", "model_built", "run", "backend", "world_size", "global_batch_size", "measured_steps", "slowest_rank",
    "phases", "per_rank_step_time_s", "step_time_s", "steps_per_s", "samples_per_s", "peak_memory", "device",
    "flops_per_sample", "peak_flops_per_device", "mfu", "accounting",
)  # fmt: skip


def compare_row(label: str, report: dict, baseline: dict | None) -> dict:
    """One row of `--compare`: throughput, step time, peak memory, speedup vs the first config."""
    peak = max(m["bytes"] for m in report["peak_memory"])
    speedup = report["samples_per_s"] / baseline["samples_per_s"] if baseline and baseline["samples_per_s"] else 1.0
    return {
        "accelerate_config": label,
        "backend": report["run"].get("backend_label", report["backend"]),
        "world_size": report["world_size"],
        "samples_per_s": report["samples_per_s"],
        "step_time_s": report["step_time_s"],
        "peak_memory_bytes": peak,
        "memory_kind": report["peak_memory"][0]["kind"],
        "speedup": speedup,
    }
