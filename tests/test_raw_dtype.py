"""Raw data is never rounded: under DDP bf16 (fp32 weights, bf16 autocast) and under DeepSpeed ZeRO-2 bf16 (every
weight cast to bf16 by DeepSpeed's own engine code) the policy receives the batch as the data pipeline made it and
computes the normalized state, the binned prompt, the normalized actions and the flow-matching targets in fp32, bit
for bit the same under both."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch

from opentau_cli.config.model import PolicyConfig
from opentau_cli.policies import build_policy
from opentau_cli.policies.pi05.modeling import flow_matching_pair
from opentau_cli.train.trainer import to_device

pytestmark = pytest.mark.full

STATE_DIM, ACTION_DIM, CHUNK = 4, 3, 6
# Statistics of a robot whose raw readings are near 1000 (joint encoders in ticks, positions in mm): bf16 keeps 8
# significant bits, so a reading there moves by up to 4 when cast.
STATS = {
    "state": {"mean": [1000.0] * STATE_DIM, "std": [10.0] * STATE_DIM, "q01": [980.0] * STATE_DIM, "q99": [1020.0] * STATE_DIM},
    "action": {"mean": [1000.0] * ACTION_DIM, "std": [10.0] * ACTION_DIM, "q01": [990.0] * ACTION_DIM, "q99": [1010.0] * ACTION_DIM},
}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest.one_thread says why)."""


def tiny_policy() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = PolicyConfig(preset="pi05_tiny", chunk_size=CHUNK, n_action_steps=CHUNK, max_state_dim=8, max_action_dim=8,
                       image_resolution=(32, 32), tokenizer_max_length=48)
    return build_policy(cfg, stats=STATS)


def raw_batch(batch_size: int = 3) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "images": torch.rand(batch_size, 1, 3, 32, 32, generator=g),
        "image_masks": torch.ones(batch_size, 1, dtype=torch.bool),
        "state": 1000.0 + torch.randn(batch_size, STATE_DIM, generator=g) * 7,
        "actions": 1000.0 + torch.randn(batch_size, CHUNK, ACTION_DIM, generator=g) * 3,
        "action_is_pad": torch.zeros(batch_size, CHUNK, dtype=torch.bool),
        "task": ["pick up the bottle"] * batch_size,
    }


def zero2_bf16(policy: torch.nn.Module) -> torch.nn.Module:
    """The policy as DeepSpeed's bf16 engine holds it: its own cast (parameters to bf16, buffers kept)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    held = copy.deepcopy(policy)
    DeepSpeedEngine._cast_module_mixed_precision(types.SimpleNamespace(module=held), torch.bfloat16, None, False)
    assert held.compute_dtype == torch.bfloat16 and held.state_q01.dtype == torch.float32
    return held


def training_inputs(policy, batch: dict, noise: torch.Tensor, time: torch.Tensor) -> dict:
    """What the trainer hands the policy (to_device) and what the policy computes from it before its layers."""
    inputs = policy._prepare(to_device(batch, "cpu"), with_actions=True)
    inputs["noisy"], inputs["target"] = flow_matching_pair(inputs["actions"], noise, time)
    return inputs


def test_the_trainer_moves_the_raw_batch_without_any_cast():
    batch = raw_batch()
    moved = to_device(batch, "cpu")
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert moved[key].dtype == value.dtype and torch.equal(moved[key], value), key
    # The raw values this file uses are ones bf16 would move: the test below could fail.
    assert not torch.equal(batch["state"].bfloat16().float(), batch["state"])


def test_ddp_bf16_and_zero2_bf16_normalize_and_target_bit_identically():
    ddp = tiny_policy()
    zero2 = zero2_bf16(ddp)
    batch = raw_batch()
    g = torch.Generator().manual_seed(2)
    noise, time = torch.randn(3, CHUNK, 8, generator=g), torch.rand(3, generator=g)

    with torch.autocast("cpu", dtype=torch.bfloat16):  # Accelerate's DDP bf16: fp32 weights under autocast
        seen_ddp = training_inputs(ddp, batch, noise, time)
    seen_zero2 = training_inputs(zero2, batch, noise, time)  # DeepSpeed bf16: no autocast, bf16 weights

    for key in ("state", "actions", "images", "noisy", "target"):
        assert seen_ddp[key].dtype == seen_zero2[key].dtype == torch.float32, key
        assert torch.equal(seen_ddp[key], seen_zero2[key]), key
    assert torch.equal(seen_ddp["input_ids"], seen_zero2["input_ids"])  # the binned state in the prompt

    # Against openpi's quantile formula on the raw values in float64 (independent of opentau's helpers): the fp32
    # result is within fp32 rounding, where a bf16 cast of the raw batch moves it by up to 0.1 (2 / 40 * 2).
    q01, q99 = np.float64(980.0), np.float64(1020.0)
    expected = (batch["state"].double().numpy() - q01) / (q99 - q01 + 1e-6) * 2 - 1
    np.testing.assert_allclose(seen_zero2["state"][:, :STATE_DIM].double().numpy(), expected, rtol=0, atol=1e-5)
    rounded = (batch["state"].bfloat16().double().numpy() - q01) / (q99 - q01 + 1e-6) * 2 - 1
    assert np.abs(rounded - expected).max() > 1e-2
    a01, a99 = np.float64(990.0), np.float64(1010.0)
    actions = (batch["actions"].double().numpy() - a01) / (a99 - a01 + 1e-6) * 2 - 1
    np.testing.assert_allclose(seen_zero2["target"][..., :ACTION_DIM].double().numpy(),
                               noise[..., :ACTION_DIM].double().numpy() - actions, rtol=0, atol=1e-5)


def test_both_bf16_backends_train_on_the_raw_fp32_batch():
    """No cast of the batch is needed: the policy casts what enters its layers itself."""
    ddp = tiny_policy().train()
    zero2 = zero2_bf16(ddp).train()
    batch = raw_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ddp = ddp(to_device(batch, "cpu"))["loss"]
    loss_zero2 = zero2(to_device(batch, "cpu"))["loss"]
    loss_ddp.backward()
    loss_zero2.backward()
    assert torch.isfinite(loss_ddp) and torch.isfinite(loss_zero2)
    assert all(p.grad is not None for p in zero2.parameters() if p.requires_grad)


def test_fsdp2_bf16_hands_the_policy_the_raw_fp32_batch_and_computes_what_ddp_bf16_computes():
    """Under FSDP2's bf16 policy (bf16 parameters inside each unit, fp32 reduction) the root does not cast its inputs:
    the policy receives the batch bit for bit as the data pipeline made it and computes the normalized state and
    actions and the flow-matching target in fp32, equal to what DDP bf16 computes. One process, a gloo group of one."""
    import torch.distributed as dist

    from opentau_cli.config.accelerate import FsdpSettings
    from opentau_cli.train.fsdp import shard_policy

    ddp = tiny_policy()
    batch = raw_batch()
    g = torch.Generator().manual_seed(2)
    noise, time = torch.randn(3, CHUNK, 8, generator=g), torch.rand(3, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen_ddp = training_inputs(ddp, batch, noise, time)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = shard_policy(copy.deepcopy(ddp), FsdpSettings(mixed_precision="bf16"), torch.device("cpu"))
        received = {}
        prepare = sharded._prepare

        def recording(inputs, **kwargs):
            received.update({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return prepare(inputs, **kwargs)

        sharded._prepare = recording
        loss = sharded(to_device(batch, "cpu"))["loss"]  # through the root's forward, where FSDP2 would cast
        assert torch.isfinite(loss)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                assert received[key].dtype == value.dtype and torch.equal(received[key], value), key
        seen_fsdp = training_inputs(sharded, batch, noise, time)
        for key in ("state", "actions", "noisy", "target"):
            assert seen_fsdp[key].dtype == torch.float32 and torch.equal(seen_fsdp[key], seen_ddp[key]), key
    finally:
        dist.destroy_process_group()
