"""FLOPs are counted on one real step's forward and backward, and only that step."""

from __future__ import annotations

import pytest

import torch

from opentau_cli.profiling.flops import FlopCountingTimer

pytestmark = pytest.mark.quick


def _train_step(timer, model, x):
    with timer.phase("forward"):
        loss = model(x).sum()
    with timer.phase("backward"):
        loss.backward()
    with timer.phase("optimizer"):
        pass
    timer.end_step()


def test_counts_forward_and_backward_flops_of_the_chosen_step_only():
    model = torch.nn.Linear(10, 20, bias=False)
    x = torch.randn(4, 10, requires_grad=True)
    timer = FlopCountingTimer(count_step=1)
    _train_step(timer, model, x)
    assert timer.flops is None  # step 0 is not counted
    _train_step(timer, model, x)
    # forward 2*4*10*20; backward computes grad of input and of weight, each as large as the forward
    assert timer.flops == 3 * 2 * 4 * 10 * 20
    _train_step(timer, model, x)
    assert timer.flops == 3 * 2 * 4 * 10 * 20
    assert len(timer.steps) == 3 and timer.steps[1]["forward"] > 0
