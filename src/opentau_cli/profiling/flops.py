"""Model FLOPs per training sample, counted (not guessed) on one real warm-up step.

`FlopCountingTimer` is a PhaseTimer that runs the forward and backward phases of one chosen step under
torch's FlopCounterMode, so the count covers exactly the ops training runs (frozen parts, masks, expert and all).
The counted step is a warm-up step: the counter's overhead never reaches the measured steps.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from opentau_cli.profiling.phases import PhaseTimer

COUNTED_PHASES = ("forward", "backward")


class FlopCountingTimer(PhaseTimer):
    def __init__(self, sync: Callable[[], None] | None = None, *, count_step: int | None = 0):
        super().__init__(sync)
        self._count_step = count_step
        self._step_index = 0
        self.flops: int | None = None  # total FLOPs of the counted step (forward + backward), None if not counted

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        counting = self._step_index == self._count_step and name in COUNTED_PHASES
        if not counting:
            with super().phase(name):
                yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with super().phase(name), counter:
            yield
        self.flops = (self.flops or 0) + counter.get_total_flops()

    def end_step(self) -> None:
        super().end_step()
        self._step_index += 1
