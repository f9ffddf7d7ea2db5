"""Test-only: record the weights a real `opentau train` / `opentau resume` launch trains, step by step.

Put this directory on PYTHONPATH and set TEST_RECORD_WEIGHTS=DIR: before the launch's first step and after each
step, rank 0 writes every trainable parameter's full fp32 value (DeepSpeed's master weight, gathered with
DeepSpeed's own `safe_get_full_fp32_param`; otherwise the parameter itself) to DIR/step_<k>.safetensors. Every rank
takes part (the gather is a collective). With an EMA, the one the launch starts from is recorded the same way
(DIR/step_<k>_ema.safetensors, read while the EMA is swapped in). Python processes without the variable are untouched.
"""

from __future__ import annotations

import os


def _record(trainer, directory: str, suffix: str = "") -> None:
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    acc = trainer.accelerator
    module = acc.unwrap_model(trainer.model)
    engine = getattr(acc, "deepspeed_engine_wrapped", None)
    weights = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if engine is not None:
            from deepspeed.utils import safe_get_full_fp32_param

            value = safe_get_full_fp32_param(p)
        else:
            value = p.detach()
        weights[name] = value.detach().to("cpu", torch.float32).clone().contiguous()
    if acc.is_main_process:
        save_file(weights, str(Path(directory) / f"step_{trainer.step}{suffix}.safetensors"))


def _install(directory: str) -> None:
    from opentau_cli.train.trainer import Trainer

    step = Trainer.train_step

    def recorded(self, *args, **kwargs):
        if not getattr(self, "_recorded_start", False):
            self._recorded_start = True
            _record(self, directory)
            if self.ema is not None:  # the EMA the launch starts with, read the same way inside its swap_in
                with self.ema.swap_in():
                    _record(self, directory, "_ema")
        result = step(self, *args, **kwargs)
        _record(self, directory)
        return result

    Trainer.train_step = recorded


if os.environ.get("TEST_RECORD_WEIGHTS"):
    _install(os.environ["TEST_RECORD_WEIGHTS"])
