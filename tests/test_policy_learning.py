"""The tiny policies learn the synthetic demo task in-process: the flow-matching loss falls by >= 40% and
`sample_actions` on held-out episodes beats predicting the mean action."""

from __future__ import annotations

import pytest
import torch

from conftest import EXAMPLES
from opentau_cli.config.load import load_config
from opentau_cli.data import build_data
from opentau_cli.policies import build_policy

pytestmark = pytest.mark.full

STEPS = 250


@pytest.fixture
def one_thread():
    # Other jobs share the CPU: two intra-op threads on two loaded cores thrash.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train(policy_type: str, steps: int, tmp_path):
    """The demo config as shipped (chunk 10, 32 px, batch 8, lr 1e-3 after its warm-up), a constant rate after it."""
    cfg = load_config(EXAMPLES / "pi05_tiny_config.json", [f"--policy.type={policy_type}", f"--output_dir={tmp_path / 'run'}"])
    torch.manual_seed(cfg.seed)
    data = build_data(cfg, rank=0, world_size=1)
    policy = build_policy(cfg.policy, data.stats)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.optimizer.lr, weight_decay=0.0)
    warmup = cfg.scheduler.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    losses = []
    for _ in range(steps):
        loss = policy(next(data.stream))["mse_loss"]
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optimizer.grad_clip_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return policy, data, losses


def held_out_errors(policy, data) -> tuple[float, float]:
    """Squared error of the sampled action chunks (n_action_steps, non-padded steps) and of the mean action."""
    policy.eval()
    mean = torch.tensor(data.stats["action"]["mean"])
    generator = torch.Generator().manual_seed(0)
    policy_err = mean_err = 0.0
    for batch in data.val_loader:
        noise = torch.randn(len(batch["task"]), policy.cfg.chunk_size, policy.cfg.max_action_dim, generator=generator)
        sampled = policy.sample_actions(batch, noise=noise)
        steps = sampled.shape[1]
        target = batch["actions"][:, :steps]
        valid = (~batch["action_is_pad"][:, :steps]).float()[..., None]
        policy_err += (((sampled - target) ** 2) * valid).sum().item()
        mean_err += (((mean - target) ** 2) * valid).sum().item()
    return policy_err, mean_err


def learning(policy, data, losses) -> dict:
    """The mean loss of the first 20 and of the last 40 steps, and the held-out errors of the policy and the mean."""
    assert data.val_loader is not None
    policy_err, mean_err = held_out_errors(policy, data)
    return {"first": sum(losses[:20]) / 20, "last": sum(losses[-40:]) / 40, "policy_err": policy_err, "mean_err": mean_err}


# pi05: tests/test_eval.py trains the same pi05 in-process as its pretrained model and checks this there.
@pytest.mark.parametrize("policy_type", ["pi0"])
def test_tiny_policy_learns_the_demo_task_and_beats_the_mean_action_on_held_out_episodes(policy_type, one_thread, tmp_path):
    got = learning(*train(policy_type, STEPS, tmp_path))
    assert got["last"] <= 0.6 * got["first"], f"flow-matching loss {got['first']:.3f} -> {got['last']:.3f}"
    assert got["policy_err"] < got["mean_err"], f"sampled actions {got['policy_err']:.4f} vs the mean action {got['mean_err']:.4f}"
