"""The learning-rate schedule: linear warm-up, then a cosine from lr down to decay_lr over decay_steps.

Torch-free, so the plan can say what a new --steps does to the rate at the resume step (plan.describe_schedule_change)
with the same function the trainer's LambdaLR uses.
"""

from __future__ import annotations

import math


def lr_factor(sched, lr: float, steps: int):
    """The multiplier of `lr` at each step, for a scheduler section `sched` and a run of `steps` steps (the cosine
    decays over sched.decay_steps when set, else over the run's steps)."""
    warmup, final = sched.warmup_steps, sched.decay_lr / lr
    decay_steps = sched.decay_steps or steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if sched.type == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def lr_at(step: int, lr: float, sched, steps: int) -> float:
    """The learning rate of the optimizer step after `step` steps (what LambdaLR's get_last_lr says then)."""
    return lr * lr_factor(sched, lr, steps)(step)
