"""Benchmark-only: the cores split as on a GPU node's host (benchmarks/bench_remote.py). Put this directory on
PYTHONPATH and set BENCH_RANK_CPUS=0 and BENCH_OTHER_CPUS=1: a rank process (`python -m opentau_cli.train.worker`,
and the launcher that starts it) pins itself to the first cores, and the data workers it starts inherit them; every
other Python process with the variables (`opentau train` itself: the launcher, whose thread uploads) to the others."""

from __future__ import annotations

import os

_rank, _other = os.environ.get("BENCH_RANK_CPUS"), os.environ.get("BENCH_OTHER_CPUS")
if _rank or _other:
    with open("/proc/self/cmdline", "rb") as _f:
        _cpus = _rank if b"opentau_cli.train.worker" in _f.read() else _other
    if _cpus:
        os.sched_setaffinity(0, {int(c) for c in _cpus.split(",")})
