"""Elastic resume's model and optimizer side in-process (one process, a real Accelerator on CPU, a checkpoint laid
out as a single-process save writes it): `check_applied` refuses a state that did not arrive bit for bit; a
parameter that never received a gradient (no AdamW state) reshards; a LoRA checkpoint's frozen base stays as the
launch built it. The DeepSpeed side of the same code runs under real launches in test_reshard.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from opentau_cli.errors import RunError, UserError
from opentau_cli.store.layout import MODEL_WEIGHTS, OPTIMIZER, SCHEDULER, TRAINING_STATE
from opentau_cli.train.reshard import apply_canonical, check_applied, read_canonical

pytestmark = pytest.mark.full


class WithIdle(nn.Module):
    """`idle` is trainable but outside the forward: it never receives a gradient, so AdamW never makes its state."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.idle = nn.Linear(4, 3)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.used(self.frozen(x)).square().mean()


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def build(seed: int):
    torch.manual_seed(seed)
    model = WithIdle()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def saved_run(tmp_path: Path, *, weights=None) -> tuple[Path, WithIdle, torch.optim.AdamW]:
    """Two trained steps, saved as a single-process checkpoint (weights: which tensors model.safetensors holds)."""
    model, optimizer, scheduler = build(0)
    for _ in range(2):
        model(torch.randn(5, 4)).backward()
        optimizer.step(), scheduler.step(), optimizer.zero_grad()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if weights is None or k in weights}
    save_file(tensors, str(ckpt / MODEL_WEIGHTS))
    torch.save(optimizer.state_dict(), ckpt / OPTIMIZER)
    torch.save(scheduler.state_dict(), ckpt / SCHEDULER)
    (ckpt / TRAINING_STATE).write_text(json.dumps({"step": 2, "world_size": 1, "backend": "single"}))
    return ckpt, model, optimizer


def trainable_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def resharded(ckpt: Path, accelerator, **kwargs):
    model, optimizer, scheduler = build(1)  # another seed: what arrives comes from the checkpoint
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    canon = read_canonical(ckpt, trainable_names(model))
    apply_canonical(canon, accelerator, model, optimizer, scheduler, **kwargs)
    return canon, model, optimizer


def test_a_parameter_that_never_received_a_gradient_reshards_without_adamw_state(tmp_path, accelerator):
    ckpt, saved, saved_optimizer = saved_run(tmp_path)
    assert saved_optimizer.state.get(saved.idle.weight) is None  # the premise: AdamW never made its state
    canon, model, optimizer = resharded(ckpt, accelerator)
    check_applied(canon, accelerator, model, optimizer)

    assert torch.equal(model.idle.weight, saved.idle.weight) and torch.equal(model.frozen.weight, saved.frozen.weight)
    assert optimizer.optimizer.state.get(model.idle.weight) is None  # no state, as in the run that saved it
    have, want = optimizer.optimizer.state[model.used.weight], saved_optimizer.state[saved.used.weight]
    assert torch.equal(have["exp_avg_sq"], want["exp_avg_sq"]) and float(have["step"]) == float(want["step"]) == 2


def test_check_applied_refuses_a_weight_a_moment_or_a_step_that_did_not_arrive_exactly(tmp_path, accelerator):
    ckpt, _, _ = saved_run(tmp_path)
    canon, model, optimizer = resharded(ckpt, accelerator)
    check_applied(canon, accelerator, model, optimizer)
    with torch.no_grad():
        weight = model.used.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1e9))  # one ulp
    with pytest.raises(RunError, match=r"the weight of 'used.weight' did not arrive exactly"):
        check_applied(canon, accelerator, model, optimizer)

    canon, model, optimizer = resharded(ckpt, accelerator)
    optimizer.optimizer.state[model.used.bias]["exp_avg"][1] += 1e-7
    with pytest.raises(RunError, match=r"the exp_avg of 'used.bias' did not arrive exactly"):
        check_applied(canon, accelerator, model, optimizer)

    canon, model, optimizer = resharded(ckpt, accelerator)
    optimizer.optimizer.state[model.used.bias]["step"] += 1
    with pytest.raises(RunError, match=r"the optimizer step of 'used.bias' did not arrive"):
        check_applied(canon, accelerator, model, optimizer)

    canon, model, optimizer = resharded(ckpt, accelerator)
    optimizer.optimizer.state[model.idle.weight] = {"step": torch.tensor(2.0), "exp_avg": torch.ones(3, 4),
                                                    "exp_avg_sq": torch.ones(3, 4)}
    with pytest.raises(RunError, match=r"'idle.weight' never received a gradient but holds AdamW state"):
        check_applied(canon, accelerator, model, optimizer)


def test_a_lora_checkpoint_s_frozen_base_stays_as_built_and_a_full_one_must_hold_it(tmp_path, accelerator):
    ckpt, saved, _ = saved_run(tmp_path, weights={"used.weight", "used.bias", "idle.weight", "idle.bias"})
    canon, model, optimizer = resharded(ckpt, accelerator, frozen_from_base=True)
    check_applied(canon, accelerator, model, optimizer)
    torch.manual_seed(1)
    assert torch.equal(model.frozen.weight, WithIdle().frozen.weight)  # as the launch built it (from its base)
    assert torch.equal(model.used.weight, saved.used.weight)
    with pytest.raises(UserError, match=r"holds no tensor for parameter 'frozen.weight'"):
        resharded(ckpt, accelerator)  # not a LoRA checkpoint: a missing frozen weight does not fit


def test_a_trainable_parameter_with_neither_weights_nor_state_does_not_fit(tmp_path, accelerator):
    ckpt, _, _ = saved_run(tmp_path, weights={"used.weight", "used.bias", "frozen.weight", "frozen.bias"})
    with pytest.raises(UserError, match=r"holds neither weights nor optimizer state for 'idle.weight' \(2 parameters\)"):
        resharded(ckpt, accelerator)
