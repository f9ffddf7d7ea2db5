"""The per-rank profile process: `python -m opentau_cli.profiling.worker --config ... --launch ...` (via the launcher).

It builds exactly what `train` builds (TRAIN's `build_trainer`) and runs TRAIN's `train_step` with a timer, plus the
collectives `train`'s loop runs around each step (preemption agreement, metric gathering every log_freq steps), and
no checkpoints. Then every rank's timings go to rank 0, which
writes them to <output_dir>/profile_result.json. A rank that runs out of memory writes profile_oom_rank<N>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import sys
import time
from pathlib import Path

from opentau_cli.profiling.flops import FlopCountingTimer
from opentau_cli.profiling.launcher import OOM_FILE, REQUEST_FILE, RESULT_FILE


class ProfileTimer(FlopCountingTimer):
    """TRAIN's train_step closes its step itself; the profile loop still has the per-step collectives of `train`'s
    loop to run, so train_step's end_step is ignored and the loop closes the step with close_step()."""

    def end_step(self) -> None:
        pass

    def close_step(self) -> None:
        super().end_step()

    def sync_device(self) -> None:
        self._do_sync()

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Re-attribute time measured inside phase `src` to `dst` (both stay inside the same step)."""
        if self.enabled:
            self._current[src] = self._current.get(src, 0.0) - seconds
            self._current[dst] = self._current.get(dst, 0.0) + seconds


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def watch_memory(limit: int | None, run_dir: Path, rank: int) -> None:
    """--memory-limit on CPU: a process whose resident memory passes the limit has run out of memory.

    A watchdog thread checks RSS every 20 ms and ends the process on sight (after writing the OOM record); the peak
    RSS is checked again after the steps, for a spike shorter than the polling interval. (A hard RLIMIT makes
    allocations fail anywhere, including inside locks of native libraries, where it can hang a worker instead.)
    """
    if not limit:
        return
    import psutil

    me = psutil.Process()

    def watch():
        while True:
            rss = me.memory_info().rss
            if rss > limit:
                record_oom(run_dir, rank, f"resident memory {rss >> 20} MiB passed --memory-limit {limit >> 20} MiB")
                os._exit(1)
            time.sleep(0.02)

    threading.Thread(target=watch, name="opentau-memory-limit", daemon=True).start()


def record_oom(run_dir: Path, rank: int, message: str) -> None:
    (run_dir / OOM_FILE.format(rank=rank)).write_text(json.dumps({"rank": rank, "error": message}))


def time_deepspeed_step(trainer, timer: ProfileTimer) -> bool:
    """Accelerate's backward() runs DeepSpeed's engine.step() (clip, optimizer step, ZeRO update) at the boundary;
    time it and report it as 'optimizer' instead of 'backward'. Only timing is added; the call is unchanged."""
    wrapped = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        return False
    engine = wrapped.engine
    original = engine.step

    def timed_step(*args, **kwargs):
        timer.sync_device()
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timer.sync_device()
            timer.move("backward", "optimizer", time.perf_counter() - start)

    engine.step = timed_step
    return True


def gather(accelerator, item: dict) -> list[dict]:
    if accelerator.num_processes == 1:
        return [item]
    import torch.distributed as dist

    out: list = [None] * accelerator.num_processes
    dist.all_gather_object(out, item)
    return out


def profile(cfg, setup, request: dict) -> dict | None:
    import torch

    from opentau_cli.profiling.stats import rank_result
    from opentau_cli.train.trainer import any_rank, build_trainer

    warmup, steps = request["warmup"], request["steps"]
    cuda = torch.cuda.is_available()
    count_step = 0 if request.get("count_flops") and warmup > 0 else None
    timer = ProfileTimer(enabled=True, sync=torch.cuda.synchronize if cuda else None, count_step=count_step)
    trainer = build_trainer(cfg, setup)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ds_split = time_deepspeed_step(trainer, timer)
    try:
        for i in range(warmup + steps):
            if i == warmup:
                timer.reset()
            trainer.train_step(timer)
            # What `train`'s loop does around each step (no checkpoints, no validation): agree across ranks on
            # preemption, and every log_freq steps gather the loss terms from every rank. Both are collectives.
            with timer.phase("sync"):
                any_rank(trainer.accelerator, False)
                if trainer.step % cfg.log_freq == 0:
                    trainer.collect_metrics()
            timer.close_step()
    finally:
        trainer.data.stream.close()
    acc = trainer.accelerator
    mine = rank_result(acc.process_index, timer.steps)
    mine["flops"] = timer.flops
    ranks = gather(acc, mine)
    if not acc.is_main_process:
        return None
    flops = ranks[0]["flops"]
    warnings = []
    if count_step is not None and flops is None:
        warnings.append("FLOPs were not counted (the forward/backward phases did not run under the counter).")
    return {
        "ranks": [{k: v for k, v in r.items() if k != "flops"} for r in ranks],
        # Every rank runs the same model on the same micro-batch size: rank 0's count per sample stands for all.
        "flops_per_sample": flops / cfg.batch_size if flops else None,
        "deepspeed_step_timed_separately": ds_split,
        "warnings": warnings,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--launch", required=True)
    args = parser.parse_args(argv)
    launch = json.loads(Path(args.launch).read_text())
    rank = int(os.environ.get("RANK", "0"))

    from opentau_cli.train.worker import close_process_group, redirect_output, report_failure

    redirect_output(Path(launch["log_dir"]), rank)
    from opentau_cli.config import TrainConfig
    from opentau_cli.config import setup_from_dict

    cfg = TrainConfig.model_validate(json.loads(Path(args.config).read_text()))
    run_dir = Path(cfg.output_dir)
    request = json.loads((run_dir / REQUEST_FILE).read_text())
    limit = request.get("memory_limit")
    watch_memory(limit, run_dir, rank)
    try:
        result = profile(cfg, setup_from_dict(launch["accelerate"]), request)
        close_process_group()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if limit and peak > limit:
            record_oom(run_dir, rank, f"peak resident memory {peak >> 20} MiB passed --memory-limit {limit >> 20} MiB")
            return 1
        if result is not None:
            tmp = run_dir / (RESULT_FILE + ".tmp")
            tmp.write_text(json.dumps(result) + "\n")
            tmp.replace(run_dir / RESULT_FILE)
        return 0
    except BaseException as e:
        code = report_failure(e)
        if is_oom(e):
            record_oom(run_dir, rank, (str(e).strip() or type(e).__name__).splitlines()[0][:300])
        return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip native teardown: with the work done and logs flushed, gloo/DeepSpeed threads torn down at interpreter
    # exit sometimes abort a rank ("terminate called without an active exception"), failing a finished run.
    os._exit(code)
