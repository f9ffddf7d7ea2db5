"""pi05's attention calls are ones PyTorch's fused kernels take: every scaled_dot_product_attention call of a pi05
forward meets the memory-efficient kernel's documented constraints (no grouped-query attention, which CUDA runs only
in the flash and math kernels, while flash takes no mask), the CPU's fused (flash) kernel runs the whole forward and
backward with the math kernel disabled, and the expanded heads compute exactly what grouped-query attention does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel

from opentau_cli.config.model import PolicyConfig
from opentau_cli.policies import build_policy
from opentau_cli.policies.pi05.modeling import _attend, attention_kernels

pytestmark = pytest.mark.full

STATS = {
    "state": {"q01": [-1.0] * 4, "q99": [1.0] * 4, "mean": [0.0] * 4, "std": [1.0] * 4},
    "action": {"q01": [-1.0] * 3, "q99": [1.0] * 3, "mean": [0.0] * 3, "std": [1.0] * 3},
}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest.one_thread says why)."""


def tiny_policy(**overrides):
    torch.manual_seed(0)
    cfg = PolicyConfig(preset="pi05_tiny", chunk_size=5, n_action_steps=5, max_state_dim=8, max_action_dim=8,
                       image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False, **overrides)
    return build_policy(cfg, stats=STATS).train()


def batch(batch_size: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "images": torch.rand(batch_size, 1, 3, 32, 32, generator=g),
        "image_masks": torch.ones(batch_size, 1, dtype=torch.bool),
        "state": torch.randn(batch_size, 4, generator=g),
        "actions": torch.randn(batch_size, 5, 3, generator=g),
        "action_is_pad": torch.zeros(batch_size, 5, dtype=torch.bool),
        "task": ["pick"] * batch_size,
    }


def meets_memory_efficient_constraints(q, k, v, attn_mask=None, enable_gqa=False, **_) -> list[str]:
    """PyTorch's documented limits of the CUDA memory-efficient kernel (scaled_dot_product_attention's docstring and
    sdp_utils): no grouped-query attention, one head count for q, k and v, a head dim that is a multiple of 8 (bf16),
    contiguous last dims, and a boolean or same-dtype mask broadcastable to (batch, heads, queries, keys)."""
    problems = []
    if enable_gqa:
        problems.append("enable_gqa")
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        problems.append(f"head counts {q.shape[1]}/{k.shape[1]}/{v.shape[1]}")
    if q.shape[-1] % 8 or k.shape[-1] != q.shape[-1]:
        problems.append(f"head dim {q.shape[-1]}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        problems.append("last dim not contiguous")
    if attn_mask is not None:
        if attn_mask.dtype not in (torch.bool, q.dtype):
            problems.append(f"mask dtype {attn_mask.dtype}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
        except RuntimeError:
            problems.append(f"mask shape {tuple(attn_mask.shape)}")
    return problems


@pytest.mark.parametrize("discrete_action_loss", [False, True])
def test_every_attention_call_of_a_pi05_forward_meets_the_memory_efficient_kernels_constraints(monkeypatch, discrete_action_loss):
    policy = tiny_policy(discrete_action_loss=discrete_action_loss)
    assert policy.arch.vlm_config.text_config.num_key_value_heads < policy.arch.vlm_config.text_config.num_attention_heads
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, *args, **kwargs):
        calls.append(meets_memory_efficient_constraints(q, k, v, attn_mask, **kwargs))
        return real(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    policy(batch())["loss"].backward()
    policy.eval().sample_actions(batch())
    layers = len(policy.language_model.layers)
    assert len(calls) >= 2 * layers - 1  # prefix layers (the last one without its queries unless CE) + expert layers
    assert all(problems == [] for problems in calls), [p for p in calls if p]


def test_the_fused_cpu_kernel_runs_pi05_forward_and_backward_with_the_math_kernel_disabled():
    policy = tiny_policy()

    def step():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            policy(batch())["loss"].backward()

    used = attention_kernels(step)
    assert used.get("flash (CPU)", 0) > 0 and "math" not in used, used


def test_expanded_heads_compute_exactly_what_grouped_query_attention_computes():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 8, 10, 32, generator=g), torch.randn(2, 1, 12, 32, generator=g), torch.randn(2, 1, 12, 32, generator=g)
    mask = torch.rand(2, 10, 12, generator=g) > 0.4
    mask[..., 0] = True
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True).transpose(1, 2).flatten(2)
    assert torch.equal(_attend(q, k, v, mask), grouped)
    # And the reference formula in float64 (query head h reads key/value head h // 8).
    qd, kd, vd = q.double(), k.double().expand(-1, 8, -1, -1), v.double().expand(-1, 8, -1, -1)
    scores = (qd @ kd.transpose(-1, -2) / 32 ** 0.5).masked_fill(~mask[:, None], float("-inf"))
    expected = (scores.softmax(-1) @ vd).transpose(1, 2).flatten(2)
    # fp32 against an fp64 reference: the two precisions differ by rounding, so here (only) a tolerance.
    torch.testing.assert_close(_attend(q, k, v, mask).double(), expected, rtol=0, atol=1e-5)
