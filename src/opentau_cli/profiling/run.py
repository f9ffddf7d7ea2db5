"""What `opentau profile` does, callable without the CLI: profile a run, compare backends, find the largest batch.

Training profiles go through the same launcher as `train` (`opentau_cli.process.launch`) and run the same per-rank
training code with checkpoints off; the request and the results travel as JSON files in a scratch run directory.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from opentau_cli.config import AccelerateSetup, Machine, TrainConfig, resolve_accelerate_config
from opentau_cli.errors import UserError
from opentau_cli.plan.run_plan import check_launch
from opentau_cli.profiling.launcher import OutOfMemory, launch_profile
from opentau_cli.profiling.stats import compare_row, summarize
from opentau_cli.units import parse_size


@dataclass
class ProfileOptions:
    steps: int = 20
    warmup: int = 5
    peak_tflops: float | None = None
    count_flops: bool = True
    memory_limit: int | None = None  # resident bytes per worker process (see worker.watch_memory), None = no cap
    keep_run_dir: bool = False


def parse_memory_limit(text: str) -> int:
    """--memory-limit in bytes (the one size convention of opentau_cli.units); refuses a cap no worker can start under."""
    value = parse_size(text, "--memory-limit")
    if value < 64 * 2**20:
        raise UserError(f"--memory-limit {text} is below 64 MiB; a Python process with torch cannot start in that.")
    return value


def parse_compare(text: str) -> list[Path]:
    paths = [Path(p.strip()) for p in text.split(",") if p.strip()]
    if not paths:
        raise UserError("--compare needs at least one Accelerate config, e.g. --compare a.yaml,b.yaml.")
    for p in paths:
        if not p.is_file():
            raise UserError(f"Accelerate config '{p}' (in --compare) not found.")
    return paths


def for_profile(cfg: TrainConfig, opts: ProfileOptions, run_dir: Path) -> TrainConfig:
    """The user's config, changed only where a profile must differ: step count, a scratch output dir, no side work."""
    cfg = cfg.model_copy(deep=True)
    cfg.steps = opts.warmup + opts.steps
    cfg.output_dir = run_dir
    cfg.overwrite = True
    cfg.resume = False
    cfg.validation.val_freq = 0  # periodic validation would land inside a measured step
    cfg.logging.tensorboard = False
    cfg.logging.trackers = []  # a profile is not a run to track
    return cfg


def _check(cfg: TrainConfig, accel: AccelerateSetup):
    checked = check_launch(cfg, accel, Machine.this())  # exactly what `train` refuses on this machine
    # Short profiles always end inside the LR warm-up; saying so would only be noise.
    checked.warnings = [w for w in checked.warnings if not w.startswith("scheduler.warmup_steps")]
    return checked


def profile_training(cfg: TrainConfig, accel: AccelerateSetup, opts: ProfileOptions, *, echo: Callable = print) -> dict:
    """Launch warmup + steps real training steps, checkpoints off; the report of stats.summarize (REPORT_FIELDS)."""
    run_dir = Path(tempfile.mkdtemp(prefix="opentau-profile-"))
    ok = False
    try:
        checked = _check(for_profile(cfg, opts, run_dir), accel)
        echo(f"Profiling {accel.label} x{accel.world_size}: {opts.warmup} warm-up + {opts.steps} measured steps ...")
        result = launch_profile(checked, opts, run_dir)
        c = checked.config
        run = {
            "config_path": str(cfg.config_path) if cfg.config_path else None,
            "accelerate_config": str(accel.path) if accel.path else None,
            "backend_label": accel.label,
            "zero_stage": accel.zero_stage,
            "mixed_precision": accel.mixed_precision,
            "policy": f"{c.policy.type}/{c.policy.preset}",
            "per_device_batch_size": c.per_device_batch_size,
            "gradient_accumulation_steps": c.gradient_accumulation_steps,
            "warmup_steps": opts.warmup,
            "use_torch_compile": c.policy.use_torch_compile,
            "gradient_checkpointing": c.policy.gradient_checkpointing,
        }
        flops = result.get("flops_per_sample")
        report = summarize(
            result["ranks"],
            global_batch_size=checked.global_batch_size,
            backend=accel.backend,
            flops_per_sample=flops,
            peak_flops_per_device=opts.peak_tflops * 1e12 if opts.peak_tflops else None,
            run=run,
        )
        report["warnings"] = checked.warnings + result.get("warnings", [])
        ok = True
        return report
    except (OutOfMemory, UserError):
        ok = True  # an expected outcome (a --find-max-batch trial, a bad input): nothing worth keeping
        raise
    finally:
        if ok and not opts.keep_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def compare(cfg: TrainConfig, accelerate_configs: list[Path], opts: ProfileOptions, *, echo: Callable = print) -> dict:
    """Profile the same training config under each Accelerate config, one after another; rows side by side."""
    reports, rows = [], []
    for path in accelerate_configs:
        report = profile_training(cfg, resolve_accelerate_config(path), opts, echo=echo)
        reports.append(report)
        rows.append(compare_row(str(path), report, reports[0]))
    return {"mode": "compare", "rows": rows, "reports": reports, "warnings": sorted({w for r in reports for w in r["warnings"]})}


def profile_dataloader_only(cfg: TrainConfig, accel: AccelerateSetup, opts: ProfileOptions) -> dict:
    """One rank's input pipeline ceiling (rank 0 of the launch's world size), in this process, with no model."""
    from opentau_cli.profiling.dataloader import profile_dataloader

    return profile_dataloader(cfg, steps=opts.steps, warmup=opts.warmup, rank=0, world_size=accel.world_size)


def samples_per_rank(cfg: TrainConfig, world_size: int) -> int:
    """How many training samples one rank's shard holds: no batch larger than this can be tried."""
    from opentau_cli.data import build_data

    probe = cfg.model_copy(deep=True)
    probe.per_device_batch_size, probe.batch_size = 1, probe.gradient_accumulation_steps
    data = build_data(probe, 0, world_size)
    try:
        return len(data.stream.sampler)
    finally:
        data.stream.close()


def _fits(cfg: TrainConfig, accel: AccelerateSetup, batch: int, opts: ProfileOptions, echo: Callable) -> tuple[bool, dict | None]:
    trial = cfg.model_copy(deep=True)
    trial.per_device_batch_size = batch
    trial.batch_size = batch * trial.gradient_accumulation_steps
    try:
        report = profile_training(trial, accel, opts, echo=lambda *_: None)
    except OutOfMemory:
        echo(f"  {accel.label}: per-device batch {batch}: out of memory")
        return False, None
    echo(f"  {accel.label}: per-device batch {batch}: fits ({report['samples_per_s']:.2f} samples/s)")
    return True, report


def search_max_batch(fits: Callable[[int], bool], limit: int) -> tuple[int, int | None]:
    """Largest batch in 1..limit for which fits(batch) holds, assuming fitting is monotone; (best, first failure).

    Doubling from 1 until a batch fails (or passes the limit, then the limit itself is tried), then bisecting
    between the last batch that fit and the first that did not.
    """
    best, failed, batch = 0, None, 1
    while batch <= limit:
        if not fits(batch):
            failed = batch
            break
        best, batch = batch, batch * 2
    if failed is None and 0 < best < limit:
        if fits(limit):
            return limit, None
        failed = limit
    while failed is not None and failed - best > 1:
        mid = (best + failed) // 2
        if fits(mid):
            best = mid
        else:
            failed = mid
    return best, failed


def find_max_batch(
    cfg: TrainConfig,
    accelerate_configs: list[Path | None],
    opts: ProfileOptions,
    *,
    max_batch: int = 256,
    memory_limit: int | None = None,
    echo: Callable = print,
) -> dict:
    """Per Accelerate config: the largest per-device batch (<= max_batch and <= one rank's samples) that runs without OOM.

    See search_max_batch. A trial runs 2 steps: the optimizer state is allocated on the first, so the second shows the steady peak.
    """
    from opentau_cli.config.rules import cuda_is_available

    if memory_limit is None and not cuda_is_available():
        raise UserError(
            "--find-max-batch on a machine without CUDA needs --memory-limit (e.g. --memory-limit 8GB): "
            "without a cap, running out of memory would mean swapping or the kernel's OOM killer, not an error."
        )
    trial_opts = ProfileOptions(steps=1, warmup=1, count_flops=False, memory_limit=memory_limit, peak_tflops=opts.peak_tflops)
    results = []
    for path in accelerate_configs:
        accel = resolve_accelerate_config(path)
        limit = min(max_batch, samples_per_rank(cfg, accel.world_size) // cfg.gradient_accumulation_steps)
        echo(f"Searching the largest per-device batch <= {limit} under {accel.label} ({path or 'default'}) ...")
        reports: dict[int, dict] = {}

        def fits(batch: int) -> bool:
            ok, report = _fits(cfg, accel, batch, trial_opts, echo)
            if ok:
                reports[batch] = report
            return ok

        best, failed = search_max_batch(fits, limit)
        best_report = reports.get(best)
        results.append(
            {
                "accelerate_config": str(path) if path else None,
                "backend": accel.label,
                "world_size": accel.world_size,
                "max_per_device_batch": best,
                "reached_limit": failed is None,  # no OOM up to the limit (--max-batch or one rank's samples)
                "limit": limit,
                "first_oom_batch": failed,
                "samples_per_s": best_report["samples_per_s"] if best_report else None,
                "peak_memory_bytes": max(m["bytes"] for m in best_report["peak_memory"]) if best_report else None,
            }
        )
    warnings = [f"{r['backend']} ({r['accelerate_config'] or 'default'}): even a per-device batch of 1 runs out of memory."
                for r in results if r["max_per_device_batch"] == 0]
    return {"mode": "find_max_batch", "memory_limit_bytes": memory_limit, "results": results, "warnings": warnings}
