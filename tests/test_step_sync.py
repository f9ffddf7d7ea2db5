"""The training loop reads nothing back from the device between log steps: each value read (`.item()`, `float()`,
`.tolist()` of a tensor) waits for the device's queued work, so it is left to the steps that log."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_trainer import make_trainer  # noqa: F401  (the fixture: trainers over a real single-process Accelerator)

pytestmark = pytest.mark.full


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


def test_pi05_trains_on_a_data_worker_batch_without_reading_a_value_back_and_tokenizing_in_the_step_would():
    """The pi05 prompt path of a training step: the batch's tensors are fake (shapes, no values: any read of a value
    into Python raises), so its forward and backward read nothing back from the device. Without the workers' token
    ids (eval / serve batches) the policy reads the state to bin it, which this check sees."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from opentau_cli.policies import build_policy
    from test_policy import STATS, make_batch, tiny_cfg

    policy = build_policy(tiny_cfg(), STATS)
    batch = make_batch()
    batch["images"] = (batch["images"] * 255).to(torch.uint8)
    batch.update(policy.prompt_tokenizer().batch_tokens(batch))  # what the data workers' collate adds
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with mode:
        noise, time = torch.zeros(4, 10, 8), torch.full((4,), 0.5)
        policy(fake, noise=noise, time=time)["loss"].backward()
        untokenized = {k: v for k, v in fake.items() if k not in ("input_ids", "text_valid")}
        with pytest.raises(DataDependentOutputException):
            policy(untokenized, noise=noise, time=time)
