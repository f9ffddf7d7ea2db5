"""FLOPs are counted on one real step's forward and backward, and only that step."""

from __future__ import annotations

import torch

from opentau_cli.profiling.flops import FlopCountingTimer


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
    timer = FlopCountingTimer(enabled=True, count_step=1)
    _train_step(timer, model, x)
    assert timer.flops is None  # step 0 is not counted
    _train_step(timer, model, x)
    # forward 2*4*10*20; backward computes grad of input and of weight, each as large as the forward
    assert timer.flops == 3 * 2 * 4 * 10 * 20
    _train_step(timer, model, x)
    assert timer.flops == 3 * 2 * 4 * 10 * 20
    assert len(timer.steps) == 3 and timer.steps[1]["forward"] > 0


def test_disabled_counting_timer_counts_nothing():
    model = torch.nn.Linear(10, 20)
    timer = FlopCountingTimer(enabled=False)
    _train_step(timer, model, torch.randn(2, 10))
    assert timer.flops is None and timer.steps == []


def test_profile_timer_closes_steps_in_the_loop_so_per_step_collectives_count_in_their_own_step():
    from opentau_cli.profiling.worker import ProfileTimer

    model = torch.nn.Linear(4, 4)
    timer = ProfileTimer(enabled=True, count_step=0)
    for _ in range(2):
        _train_step(timer, model, torch.randn(2, 4))  # calls end_step, as TRAIN's train_step does
        with timer.phase("sync"):
            pass
        timer.move("backward", "optimizer", 0.0)
        timer.close_step()
    assert len(timer.steps) == 2
    assert all(s["sync"] > 0 and s["forward"] > 0 for s in timer.steps)
    # step 0 only: forward + weight gradient (the input needs no gradient here), each 2*2*4*4
    assert timer.flops == 2 * (2 * 2 * 4 * 4)
