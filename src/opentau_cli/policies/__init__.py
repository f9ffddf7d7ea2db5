"""Policies: build from config, count parameters, start from pretrained weights (policies/pretrained.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from opentau_cli.config.model import PolicyConfig

# Imported here, not inside build_policy: transformers imports lazily, and an import that happens inside DeepSpeed's
# zero.Init (which patches tensor construction) fails in torch._dynamo.
from opentau_cli.policies.pi05 import Pi05Policy
from opentau_cli.policies.pretrained import LoadReport, check_pretrained, load_pretrained

__all__ = ["build_policy", "check_pretrained", "count_parameters", "load_pretrained", "LoadReport"]


def build_policy(policy_cfg: PolicyConfig, stats: dict | None = None) -> torch.nn.Module:
    """Build the policy on the current default device / init context (meta, zero.Init); fp32 weights.

    Sets requires_grad per the config and turns on activation checkpointing when asked. A `tokenizer_path` that is
    a Hugging Face repo id is resolved to its local snapshot first. Does not load `pretrained_path` (call
    `load_pretrained` once the weights are materialized) and does not compile.
    """
    policy_cfg = _with_local_tokenizer(policy_cfg)
    policy = _build_under_zero3(policy_cfg) if _zero3_init_active() else Pi05Policy(policy_cfg)
    if stats is not None:
        policy.set_stats(stats)
    if policy_cfg.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    return policy


def _with_local_tokenizer(policy_cfg: PolicyConfig) -> PolicyConfig:
    path = policy_cfg.tokenizer_path
    if path is None or Path(path).exists():
        return policy_cfg
    from opentau_cli.policies import hub

    return policy_cfg.model_copy(update={"tokenizer_path": hub.resolve(str(path), "policy.tokenizer_path")})


def _zero3_init_active() -> bool:
    partition = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return partition is not None and partition.zero_init_context > 0


def _build_under_zero3(policy_cfg: PolicyConfig) -> torch.nn.Module:
    """Build inside the caller's deepspeed.zero.Init with the same initial weights as an ordinary build.

    Sub-modules are partitioned as soon as their own __init__ returns, so transformers' post_init would initialize
    empty shards: run it on gathered parameters, in the same order (and so with the same random draws) as without
    ZeRO-3. zero.Init also casts floating tensors created inside it (RoPE frequencies, statistics buffers): recompute
    those in fp32.
    """
    import deepspeed
    import transformers.modeling_utils as hf_modeling
    from deepspeed.runtime.zero import partition_parameters
    from transformers.modeling_utils import PreTrainedModel

    original_init, original_flag = PreTrainedModel.init_weights, hf_modeling.is_deepspeed_zero3_enabled

    def init_weights(self):
        with deepspeed.zero.GatheredParameters(list(self.parameters()), modifier_rank=0):
            original_init(self)

    PreTrainedModel.init_weights = init_weights
    # Seeing ZeRO-3 on, transformers would open its own zero.Init with weight init off (it expects a checkpoint load).
    hf_modeling.is_deepspeed_zero3_enabled = lambda: False
    try:
        policy = Pi05Policy(policy_cfg)
    finally:
        PreTrainedModel.init_weights, hf_modeling.is_deepspeed_zero3_enabled = original_init, original_flag
    partition_parameters.shutdown_init_context()
    try:
        policy.reset_fp32_buffers()
    finally:
        partition_parameters.restore_init_context()
    return policy


def count_parameters(policy_cfg: PolicyConfig) -> dict[str, int]:
    """Total and trainable parameter counts, from a build on the meta device (no memory, about a second); with
    policy.lora on, of the adapted policy (which also checks that its targets exist)."""
    from opentau_cli.policies.lora import apply_lora

    with torch.device("meta"):
        policy = build_policy(policy_cfg)
        if policy_cfg.lora.enabled:
            apply_lora(policy, policy_cfg.lora)
    params = list(policy.parameters())
    return {"total": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad)}
