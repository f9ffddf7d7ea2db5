"""Benchmark-only: `opentau train` taking turns with another process, one loop iteration each (turns.py,
benchmarks/bench_overhead.py). Put this directory on PYTHONPATH and set BENCH_TURNS=DIR:ME:OTHER:RECORD: the rank
takes a turn at the start of every training step and writes when it held each (`spans`) to RECORD (JSON) when it
leaves. Processes without the variable are untouched."""

from __future__ import annotations

import os


def _install(spec: str) -> None:
    import json

    from opentau_cli.process import runtime
    from turns import Turns

    directory, me, other, record = spec.split(":")
    turns = Turns(directory, me, other)
    paused = runtime.import_paused

    def import_paused(*modules):
        paused(*modules)
        if modules != runtime.RANK_IMPORTS:  # the rank's own imports (run_rank), not a package's paused import
            return
        from opentau_cli.train.trainer import Trainer

        if getattr(Trainer, "_bench_turns", False):
            return
        Trainer._bench_turns = True
        step = Trainer.train_step

        def train_step(self, *args, **kwargs):
            turns.next()
            return step(self, *args, **kwargs)

        Trainer.train_step = train_step

    exit_rank = runtime.exit_rank

    def recorded_exit(code):
        turns.done()
        with open(record, "w") as f:
            json.dump({"spans": turns.spans}, f)
        exit_rank(code)

    runtime.import_paused, runtime.exit_rank = import_paused, recorded_exit


if os.environ.get("BENCH_TURNS"):
    _install(os.environ["BENCH_TURNS"])
