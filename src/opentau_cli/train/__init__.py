"""The per-rank training code: build (Accelerator, data, policy, optimizer), the step, the loop, validation, metrics.

`run_steps` is the hook `opentau profile` calls to run exactly what `opentau train` runs (no checkpoints, a PhaseTimer on).
Import heavy pieces lazily: the launcher imports this package without needing torch at import time.
"""


def __getattr__(name):
    if name in ("build_trainer", "run_steps", "Trainer"):
        from opentau_cli.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)


__all__ = ["Trainer", "build_trainer", "run_steps"]
