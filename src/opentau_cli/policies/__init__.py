"""Policies: build from config (never download), count parameters, load local weights."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from opentau_cli.checkpoint.layout import MODEL_WEIGHTS, WEIGHTS_INDEX
from opentau_cli.config.model import PolicyConfig
from opentau_cli.errors import UserError

# Imported here, not inside build_policy: transformers imports lazily, and an import that happens inside DeepSpeed's
# zero.Init (which patches tensor construction) fails in torch._dynamo.
from opentau_cli.policies.pi05 import Pi05Policy

__all__ = ["build_policy", "count_parameters", "load_pretrained", "LoadReport"]


def build_policy(policy_cfg: PolicyConfig, stats: dict | None = None) -> torch.nn.Module:
    """Build the policy on the current default device / init context (meta, zero.Init); fp32 weights.

    Sets requires_grad per the config and turns on activation checkpointing when asked. Does not load
    `pretrained_path` (call `load_pretrained` once the weights are materialized) and does not compile.
    """
    policy = _build_under_zero3(policy_cfg) if _zero3_init_active() else Pi05Policy(policy_cfg)
    if stats is not None:
        policy.set_stats(stats)
    if policy_cfg.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    return policy


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
    """Total and trainable parameter counts, from a build on the meta device (no memory, about a second)."""
    with torch.device("meta"):
        policy = build_policy(policy_cfg)
    params = list(policy.parameters())
    return {"total": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad)}


@dataclass
class LoadReport:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self, limit: int = 8) -> str:
        parts = []
        for label, keys in (("missing", self.missing), ("unexpected", self.unexpected), ("shape-mismatched", self.mismatched)):
            if keys:
                shown = ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
                parts.append(f"{len(keys)} {label} keys: {shown}")
        return "; ".join(parts)


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        if (path / MODEL_WEIGHTS).is_file():
            return [path / MODEL_WEIGHTS]
        index = path / WEIGHTS_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise UserError(f"{index}: not a safetensors index ({exc}).") from exc
            return [path / name for name in sorted(set(weight_map.values()))]
        raise UserError(f"{path}: holds neither {MODEL_WEIGHTS} nor {WEIGHTS_INDEX}.")
    raise UserError(f"{path}: no such file or directory.")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a model.safetensors file, a directory holding one, or Hugging Face shards + index."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        if not file.is_file():
            raise UserError(f"{file}: shard named by the index is missing.")
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{file}: not a readable safetensors file ({exc}).") from exc
    return tensors


def load_pretrained(policy: torch.nn.Module, path: str | Path, strict: bool = True) -> LoadReport:
    """Load local weights into `policy`. Strict: any missing / unexpected / mis-shaped key is a UserError listing them.

    Not strict: loads the keys that match and returns the report (the caller logs it).
    """
    tensors = read_state_dict(path)
    own = policy.state_dict()
    report = LoadReport(
        missing=sorted(k for k in own if k not in tensors),
        unexpected=sorted(k for k in tensors if k not in own),
        mismatched=sorted(k for k in tensors if k in own and tensors[k].shape != own[k].shape),
    )
    if strict and not report.clean:
        raise UserError(f"{path} does not match the policy ({report.describe()}); set policy.pretrained_strict=false to load what matches.")
    usable = {k: v for k, v in tensors.items() if k in own and k not in report.mismatched}
    policy.load_state_dict(usable, strict=False)
    return report
