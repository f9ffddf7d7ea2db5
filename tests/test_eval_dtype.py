"""`opentau eval` samples in bf16 on CUDA (openpi's inference layout: the fp32 set kept) and in fp32 elsewhere; the
bf16 layout samples the same actions as fp32 up to bf16 rounding."""

from __future__ import annotations

import copy

import pytest
import torch

from opentau_cli.config.model import PolicyConfig
from opentau_cli.policies import build_policy
from opentau_cli.tools.inference import inference_dtype

pytestmark = pytest.mark.quick

STATS = {
    "state": {"q01": [-1.0] * 4, "q99": [1.0] * 4, "mean": [0.0] * 4, "std": [1.0] * 4},
    "action": {"q01": [-2.0] * 3, "q99": [2.0] * 3, "mean": [0.0] * 3, "std": [1.0] * 3},
}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest.one_thread says why)."""


def test_eval_runs_bf16_on_cuda_and_fp32_elsewhere():
    assert inference_dtype(torch.device("cuda")) == inference_dtype(torch.device("cuda:1")) == torch.bfloat16
    assert inference_dtype(torch.device("cpu")) == torch.float32


def test_the_bf16_layout_samples_the_fp32_actions_up_to_bf16_rounding():
    torch.manual_seed(0)
    fp32 = build_policy(PolicyConfig(preset="pi05_tiny", chunk_size=5, n_action_steps=5, max_state_dim=8, max_action_dim=8,
                                     image_resolution=(32, 32), tokenizer_max_length=48), stats=STATS).eval()
    bf16 = copy.deepcopy(fp32).cast_weights(torch.bfloat16)
    assert bf16.compute_dtype == torch.bfloat16 and bf16.action_out_proj.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    batch = {"images": torch.rand(2, 1, 3, 32, 32, generator=g), "image_masks": torch.ones(2, 1, dtype=torch.bool),
             "state": torch.randn(2, 4, generator=g), "task": ["pick", "place"]}
    noise = torch.randn(2, 5, 8, generator=g)
    want, got = fp32.sample_actions(batch, noise=noise), bf16.sample_actions(batch, noise=noise)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.1 * want.abs().max()
