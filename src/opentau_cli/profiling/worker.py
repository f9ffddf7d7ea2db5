"""The per-rank profile process: `python -m opentau_cli.profiling.worker --config ... --launch ...` (via the launcher).

It runs under opentau's per-rank runtime (`opentau_cli.process.runtime`), builds exactly what `train` builds (TRAIN's
`build_trainer`) and runs `train`'s loop without checkpoints and validation: TRAIN's `train_step`, its per-step
collectives included, with a phase timer. Then every rank's timings go to rank 0, which writes them to
<output_dir>/profile_result.json. A rank that runs out of memory writes profile_oom_rank<N>.json.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path

from opentau_cli.profiling.flops import FlopCountingTimer
from opentau_cli.profiling.launcher import OOM_FILE, REQUEST_FILE, RESULT_FILE


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


def gather(accelerator, item: dict) -> list[dict]:
    if accelerator.num_processes == 1:
        return [item]
    import torch.distributed as dist

    out: list = [None] * accelerator.num_processes
    dist.all_gather_object(out, item)
    return out


def profile(cfg, setup, request: dict) -> dict | None:
    import torch

    from opentau_cli.process.runtime import keep_until_exit
    from opentau_cli.profiling.stats import rank_result
    from opentau_cli.train.trainer import build_trainer

    warmup, steps = request["warmup"], request["steps"]
    cuda = torch.cuda.is_available()
    count_step = 0 if request.get("count_flops") and warmup > 0 else None
    timer = FlopCountingTimer(sync=torch.cuda.synchronize if cuda else None, count_step=count_step)
    trainer = build_trainer(cfg, setup)
    keep_until_exit(trainer)  # freed only by os._exit (runtime.keep_until_exit says why)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(warmup + steps):  # `train`'s loop, less checkpoints and validation
            if i == warmup:
                timer.reset()
            trainer.train_step(timer)
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
        "warnings": warnings,
    }


def work(cfg, setup, launch: dict, _console) -> int:
    """One rank of a profile: run the request in the scratch run dir, write the result (rank 0) or an OOM record."""
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(cfg.output_dir)
    request = json.loads((run_dir / REQUEST_FILE).read_text())
    limit = request.get("memory_limit")
    watch_memory(limit, run_dir, rank)
    try:
        result = profile(cfg, setup, request)
    except BaseException as e:
        if is_oom(e):
            record_oom(run_dir, rank, (str(e).strip() or type(e).__name__).splitlines()[0][:300])
        raise
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if limit and peak > limit:
        record_oom(run_dir, rank, f"peak resident memory {peak >> 20} MiB passed --memory-limit {limit >> 20} MiB")
        return 1
    if result is not None:
        tmp = run_dir / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps(result) + "\n")
        tmp.replace(run_dir / RESULT_FILE)
    return 0


def main(argv: list[str] | None = None) -> None:
    from opentau_cli.process.runtime import run_rank

    run_rank(work, argv, description=__doc__)


if __name__ == "__main__":
    main()
