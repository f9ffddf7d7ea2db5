"""Benchmark-only: how long each rank of a real `opentau train` / `opentau resume` spends in the checkpoint save
(CheckpointManager.save: what training waits for) and in the restore (Trainer.restore: reading the checkpoint into
the model, optimizer, scheduler and RNG), timed around the product's own calls, not reported by it.

Put this directory on PYTHONPATH and set BENCH_TIMING_RECORD=DIR: each rank writes DIR/rank<N>.json with `save_s`
(a list, one per save) and `load_s` (a list, one per restore) when it leaves. Processes without the variable are
untouched.
"""

from __future__ import annotations

import os


def _install(directory: str) -> None:
    import json
    import time
    from pathlib import Path

    from opentau_cli.process import runtime

    record: dict = {"save_s": [], "load_s": []}
    paused = runtime.import_paused

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record[key].append(time.perf_counter() - start)
        return wrapper

    def import_paused(*modules):
        paused(*modules)
        if modules != runtime.RANK_IMPORTS:  # the rank's own imports (run_rank), not a package's paused import
            return
        from opentau_cli.train.manager import CheckpointManager
        from opentau_cli.train.trainer import Trainer

        if getattr(Trainer, "_bench_timing", False):
            return
        Trainer._bench_timing = True
        CheckpointManager.save = timed(CheckpointManager.save, "save_s")
        Trainer.restore = timed(Trainer.restore, "load_s")

    exit_rank = runtime.exit_rank

    def recorded_exit(code):
        Path(directory, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
        exit_rank(code)

    runtime.import_paused, runtime.exit_rank = import_paused, recorded_exit


if os.environ.get("BENCH_TIMING_RECORD"):
    _install(os.environ["BENCH_TIMING_RECORD"])
