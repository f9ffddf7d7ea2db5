"""The training loop reads nothing back from the device between log steps: each value read (`.item()`, `float()`,
`.tolist()` of a tensor) waits for the device's queued work, so it is left to the steps that log."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_trainer import make_trainer  # noqa: F401  (the fixture: trainers over a real single-process Accelerator)


class DeviceReads(TorchDispatchMode):
    """Counts the reads of a tensor's value into Python (aten._local_scalar_dense), except of AdamW's step counters,
    which torch keeps on the host (not capturable, not fused) whatever the device of the parameters."""

    def __init__(self, optimizer_state: dict):
        super().__init__()
        self.count = 0
        self.host_tensors = optimizer_state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            if not any(args[0] is state.get("step") for state in self.host_tensors.values()):
                self.count += 1
        return func(*args, **(kwargs or {}))


def test_steps_between_log_steps_read_no_value_back_and_the_log_step_does(make_trainer):
    trainer = make_trainer([1, 2, 3, 4], log_freq="4")
    reads = []
    for _ in range(4):
        with DeviceReads(trainer.optimizer.optimizer.state) as mode:
            result = trainer.train_step()
        reads.append(mode.count)
    assert reads[:3] == [0, 0, 0], reads
    assert reads[3] > 0 and result.record["loss"] == 2.5 and result.record["grad_norm"] == 0.0
