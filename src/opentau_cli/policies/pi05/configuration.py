"""Architecture presets for pi05 / pi0, expressed as a transformers `PI0Config`.

`PI0Config` already knows how to hold a PaliGemma VLM config (SigLIP + Gemma) and a Gemma expert ("dit") config, so
the presets only state the sizes. Image size comes from the policy config (SigLIP's position table depends on it).
"""

from __future__ import annotations

from transformers import PI0Config

from opentau_cli.config.model import PolicyConfig
from opentau_cli.errors import UserError

# Sizes of each preset. vision: SigLIP; vlm: Gemma language model; expert: Gemma action expert.
# VLM and expert share head count / head dim because every layer attends jointly over both streams.
PRESETS: dict[str, dict] = {
    # PaliGemma-3B (SigLIP So400m/14 + Gemma 2B) with the Gemma-300M expert: about 3.3B parameters.
    "pi05": dict(
        vision=dict(hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, intermediate_size=4304, patch_size=14),
        vlm=dict(hidden_size=2048, num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                 intermediate_size=16384, vocab_size=257152),
        expert=dict(hidden_size=1024, num_hidden_layers=18, intermediate_size=4096),
    ),
    # ~80M: for CPU benchmarks. Patch 16 keeps the image token count low (49 per camera at 112 px, 196 at 224 px).
    "pi05_small": dict(
        vision=dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536, patch_size=16),
        vlm=dict(hidden_size=640, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                 intermediate_size=2560, vocab_size=1024),
        expert=dict(hidden_size=384, num_hidden_layers=8, intermediate_size=1536),
    ),
    # ~2M: unit tests and the demo; a training step takes milliseconds on a CPU.
    "pi05_tiny": dict(
        vision=dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, intermediate_size=192, patch_size=8),
        vlm=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                 intermediate_size=512, vocab_size=1024),
        expert=dict(hidden_size=64, num_hidden_layers=4, intermediate_size=256),
    ),
}


def hidden_size(policy_cfg: PolicyConfig) -> int:
    """The model's width as Accelerate reads it for DeepSpeed's "auto" bucket sizes: the language model's, as a
    PaliGemma config states it (docs/ARCHITECTURE.md, "Memory plan")."""
    if policy_cfg.preset not in PRESETS:
        raise UserError(f"policy.preset={policy_cfg.preset!r} is unknown; choose one of {', '.join(PRESETS)}.")
    return PRESETS[policy_cfg.preset]["vlm"]["hidden_size"]


def image_size_of(policy_cfg: PolicyConfig) -> int:
    """The square image side SigLIP is built for; refuses shapes it cannot patch."""
    height, width = policy_cfg.image_resolution
    patch = PRESETS[policy_cfg.preset]["vision"]["patch_size"]
    if height != width:
        raise UserError(f"policy.image_resolution={list(policy_cfg.image_resolution)}: the vision tower needs square images (e.g. [{height}, {height}]).")
    if height % patch:
        raise UserError(f"policy.image_resolution={height}: must be a multiple of the {policy_cfg.preset} patch size {patch}.")
    return height


def arch_config(policy_cfg: PolicyConfig) -> PI0Config:
    """The transformers `PI0Config` of a preset, sized by the policy config (chunk, dims, image size)."""
    if policy_cfg.preset not in PRESETS:
        raise UserError(f"policy.preset={policy_cfg.preset!r} is unknown; choose one of {', '.join(PRESETS)}.")
    sizes = PRESETS[policy_cfg.preset]
    vlm, expert = sizes["vlm"], sizes["expert"]
    shared_attention = {k: vlm[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}
    return PI0Config(
        vlm_config={
            "model_type": "paligemma",
            "text_config": {"model_type": "gemma", **vlm},
            "vision_config": {"model_type": "siglip_vision_model", "image_size": image_size_of(policy_cfg),
                              "vision_use_head": False, **sizes["vision"]},
            "projection_dim": vlm["hidden_size"],
            # Not used by opentau (images are placed by position, not by placeholder tokens); kept in range.
            "image_token_id": vlm["vocab_size"] - 1,
        },
        dit_config={"model_type": "gemma", **expert, **shared_attention},
        chunk_size=policy_cfg.chunk_size,
        max_state_dim=policy_cfg.max_state_dim,
        max_action_dim=policy_cfg.max_action_dim,
        num_inference_steps=policy_cfg.num_inference_steps,
    )
