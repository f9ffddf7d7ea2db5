"""PhaseTimer: the timer `opentau profile` hands to TRAIN's `Trainer.train_step` (a `train.timing.StepTimer`), so
it times the real code path; `opentau train` steps with `train.timing.NO_TIMER` instead.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from opentau_cli.train.timing import PHASES


class PhaseTimer:
    """Times named phases of each training step; `end_step()` closes a step.

    `sync` (e.g. torch.cuda.synchronize) is called at both boundaries of every phase, so queued device work is
    charged to the phase that launched it rather than to whichever phase happens to block next.
    """

    def __init__(self, sync: Callable[[], None] | None = None):
        self._sync = sync
        self._steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._step_start: float | None = None
        self._open: str | None = None

    @property
    def steps(self) -> list[dict[str, float]]:
        """One dict per closed step: seconds per phase (every name in PHASES, 0.0 if absent) plus "total"."""
        return self._steps

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._open is not None:
            # Nested phases would count the same seconds twice and break "phases add up to the step".
            raise RuntimeError(f"phase {name!r} opened inside phase {self._open!r}")
        self._do_sync()
        start = time.perf_counter()
        if self._step_start is None:
            self._step_start = start
        self._open = name
        try:
            yield
        finally:
            self._do_sync()
            self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - start
            self._open = None

    def end_step(self) -> None:
        """Close the step: its total is the wall time since the previous end_step (or its first phase)."""
        now = time.perf_counter()
        start = self._step_start if self._step_start is not None else now
        record = {name: 0.0 for name in PHASES}
        record.update(self._current)
        record["total"] = now - start
        self._steps.append(record)
        self._current = {}
        # The next step starts now, so time spent between steps (logging, etc.) is not silently dropped.
        self._step_start = now

    def reset(self) -> None:
        """Forget recorded steps (e.g. after warm-up); the next step starts at its first phase."""
        self._steps = []
        self._current = {}
        self._step_start = None

    def _do_sync(self) -> None:
        if self._sync is not None:
            self._sync()
