"""Policies: build from config (policies/build.py), count parameters, start from pretrained weights
(policies/pretrained.py), LoRA (policies/lora.py)."""

from __future__ import annotations

import torch

from opentau_cli.config.model import PolicyConfig
from opentau_cli.process.runtime import import_paused

# torch and transformers' Gemma and PaliGemma, imported with the garbage collector paused (docs/ARCHITECTURE.md
# "Start-up"): every command and rank that builds a policy starts here.
import_paused("torch", "transformers", "opentau_cli.policies.pi05")

from opentau_cli.policies.build import build_policy
from opentau_cli.policies.lora import apply_lora
from opentau_cli.policies.pretrained import LoadReport, build_pretrained, check_pretrained, load_pretrained

__all__ = ["build_policy", "build_pretrained", "check_pretrained", "count_parameters", "load_pretrained", "LoadReport"]


def count_parameters(policy_cfg: PolicyConfig) -> dict[str, int]:
    """Total and trainable parameter counts, from a build on the meta device (no memory, about a second); with
    policy.lora on, of the adapted policy (which also checks that its targets exist)."""
    with torch.device("meta"):
        policy = build_policy(policy_cfg)
        if policy_cfg.lora.enabled:
            apply_lora(policy, policy_cfg.lora)
    params = list(policy.parameters())
    return {"total": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad)}
