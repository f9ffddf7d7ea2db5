"""What the training step tells a timer: the names of its phases, and the two calls it makes.

`opentau train` steps with NO_TIMER (free); `opentau profile` hands the same `Trainer.train_step` a PhaseTimer
(`opentau_cli.profiling.phases`), so what it measures is what trains. See docs/ARCHITECTURE.md "Profiling".
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

# The phases of one training step, in the order they happen.
PHASES = ("data", "forward", "backward", "optimizer", "zero_grad_sched", "sync")


class StepTimer(Protocol):
    def phase(self, name: str) -> AbstractContextManager[None]:
        """Time the enclosed work as phase `name` (one of PHASES)."""

    def end_step(self) -> None:
        """The step is over, its collectives included."""


class _NoTimer:
    def phase(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()

    def end_step(self) -> None:
        pass


NO_TIMER: StepTimer = _NoTimer()
