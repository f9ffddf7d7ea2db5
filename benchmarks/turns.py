"""Benchmark-only: two processes take turns, one training step each, so that whatever else loads the machine falls
on both alike (benchmarks/bench_overhead.py; in `opentau train` through tests/hooks' BENCH_TURNS). Each holds the
turn from the start of one step to the start of its next (its whole loop iteration: the step and everything the loop
does around it) while the other waits in a blocking read of a pipe, using no CPU. The pipes are two FIFOs in one
directory, named after the two sides; the benchmark puts the first turn in one of them."""

from __future__ import annotations

import os
import select
import time


class Turns:
    def __init__(self, directory: str, me: str, other: str, timeout: float = 1800.0):
        # O_RDWR: opening a FIFO this way never waits for the other end (Linux).
        self._mine = os.open(os.path.join(directory, me), os.O_RDWR)
        self._theirs = os.open(os.path.join(directory, other), os.O_RDWR)
        self.timeout = timeout
        self.spans: list[tuple[float, float]] = []  # each turn held (monotonic clock, shared by the processes)
        self._since: float | None = None

    @property
    def durations(self) -> list[float]:
        """Seconds each turn was held: one loop iteration each."""
        return [end - start for start, end in self.spans]

    def next(self) -> None:
        """End this side's turn, if it holds one, and wait for the next: call at the start of every step."""
        if self._since is not None:
            self.spans.append((self._since, time.perf_counter()))
            os.write(self._theirs, b"x")
        if not select.select([self._mine], [], [], self.timeout)[0]:
            raise TimeoutError(f"the other side never gave the turn back in {self.timeout:.0f} s")
        os.read(self._mine, 1)
        self._since = time.perf_counter()

    def done(self) -> None:
        """Stop taking turns (the last one is not counted: it ends in the run's teardown); the other side runs on."""
        os.write(self._theirs, b"x" * 4096)
        self._since = None
