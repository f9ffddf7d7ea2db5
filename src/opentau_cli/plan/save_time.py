"""Whether a save fits the grace a stop signal leaves: the checkpoint's bytes (the memory plan's parameter counts) at
conservative write and upload rates, against `checkpoint.save_grace_seconds` or SLURM's `--signal` time
(docs/ARCHITECTURE.md, "Schedulers"). A warning, never a refusal: the rates are estimates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from opentau_cli.config import AccelerateSetup, TrainConfig

# Conservative rates, measured here (BENCHMARKS.md): a save's sequential write + fsync ran at 172 MiB/s ("Checkpoint
# save bandwidth", the slower run), an upload of a checkpoint to S3 at 50 MB/s (bench_remote's slowest opentau
# figure). A GPU node's local NVMe and a datacenter link are usually faster, so the warning errs towards early.
WRITE_BYTES_PER_SECOND = 170e6
UPLOAD_BYTES_PER_SECOND = 50e6


def checkpoint_bytes(cfg: TrainConfig, setup: AccelerateSetup) -> int:
    """The bytes one checkpoint of `cfg` holds, from the policy's parameter counts: the weights in the dtype they
    are held in (a LoRA run saves only what trains, policies/lora.py), AdamW's two fp32 moments of what trains,
    ZeRO's fp32 master copy, and the EMA's fp32 copy. Every machine's share together: conservative for a machine
    that writes only its own."""
    from opentau_cli.plan.memory import DTYPE_BYTES, cached_sizes, step_precision

    s = cached_sizes(cfg.policy)
    weights_dtype, _ = step_precision(setup)
    w = DTYPE_BYTES[weights_dtype]
    total = w * (s.trainable if cfg.policy.lora.enabled else s.total) + 8 * s.trainable
    if setup.backend == "deepspeed":
        total += 4 * s.trainable
    if cfg.ema.enabled:
        total += 4 * s.trainable
    return total


def grace(cfg: TrainConfig, environ: Mapping[str, str] | None = None) -> tuple[float, str] | None:
    """(seconds, what says so) a stop signal leaves: checkpoint.save_grace_seconds, else SLURM's --signal time."""
    from opentau_cli.config.scheduler import signal_grace

    if cfg.checkpoint.save_grace_seconds is not None:
        return cfg.checkpoint.save_grace_seconds, "checkpoint.save_grace_seconds"
    return signal_grace(os.environ if environ is None else environ)


def save_seconds(cfg: TrainConfig, nbytes: int) -> float:
    """How long a save of `nbytes` may take at the rates above, with checkpoint.remote its upload too."""
    seconds = nbytes / WRITE_BYTES_PER_SECOND
    if cfg.checkpoint.remote:
        seconds += nbytes / UPLOAD_BYTES_PER_SECOND
    return seconds


def check_save_grace(cfg: TrainConfig, setup: AccelerateSetup, resume_from: Path | None = None,
                     environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning when the save a stop signal starts may outlast the grace it leaves, naming both numbers. A resume
    counts the bytes of the checkpoint it continues (what this run's saves write), a fresh run the plan's estimate."""
    from opentau_cli.train.manager import dir_bytes

    if not cfg.checkpoint.save_on_preemption:
        return []
    given = grace(cfg, environ)
    if given is None:
        return []
    seconds, source = given
    measured = dir_bytes(resume_from) if resume_from is not None else 0
    nbytes = measured or checkpoint_bytes(cfg, setup)
    size = f"{nbytes / 1e9:.1f} GB" + (f" (as {resume_from.name}, which this resumes)" if measured else "")
    needed = save_seconds(cfg, nbytes)
    if needed <= seconds:
        return []
    rates = f"{WRITE_BYTES_PER_SECOND / 1e6:g} MB/s to disk"
    what = "save"
    if cfg.checkpoint.remote:
        rates += f", {UPLOAD_BYTES_PER_SECOND / 1e6:g} MB/s to {cfg.checkpoint.remote}"
        what = "save and upload"
    if source == "checkpoint.save_grace_seconds":
        fix = "give the job a longer grace (and checkpoint.save_grace_seconds with it)"
    else:
        fix = f"raise it (--signal=B:USR1@{int(needed * 1.5) + 30})"
    if cfg.checkpoint.remote and cfg.checkpoint.remote_drain_seconds < nbytes / UPLOAD_BYTES_PER_SECOND:
        fix += (f", and checkpoint.remote_drain_seconds={cfg.checkpoint.remote_drain_seconds:g} above the upload's "
                f"~{nbytes / UPLOAD_BYTES_PER_SECOND:.0f} s")
    return [f"A checkpoint of {size} may take ~{needed:.0f} s to {what} (at {rates}), more than the "
            f"{seconds:g} s {source} gives before the job is killed: {fix}."]
