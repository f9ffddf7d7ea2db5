"""Starting from pretrained weights without the random initialization (policies.build_pretrained): the same policy
as a build followed by load_pretrained, tensor for tensor, requires_grad, dtype, device and the global RNG (LoRA's
adapters draw from it next), strict and not, with and without LoRA; and the parameters get storage only from the
file."""

from __future__ import annotations

import pytest
import torch

from opentau_cli.config.model import LoraConfig
from opentau_cli.policies import build_policy, build_pretrained, load_pretrained, pretrained
from opentau_cli.policies.layouts import LEROBOT, OPENPI, OPENTAU
from opentau_cli.policies.lora import apply_lora
from test_pretrained_load import DATASET_STATS, LM_NORM, STATS, edit_weights, published, tiny_cfg

pytestmark = pytest.mark.full

LORA = LoraConfig(rank=4, alpha=8, full_modules=["action_out_proj"])


def todays_way(cfg, lora: bool):
    torch.manual_seed(7)
    policy = build_policy(cfg, DATASET_STATS)
    report = load_pretrained(policy, cfg.pretrained_path, strict=cfg.pretrained_strict, dataset_stats=DATASET_STATS)
    if lora:
        apply_lora(policy, LORA)
    return policy, report, torch.get_rng_state()


def new_way(cfg, lora: bool, rng_draws: bool = True):
    torch.manual_seed(7)
    policy, report = build_pretrained(cfg, DATASET_STATS, dataset_stats=DATASET_STATS, rng_draws=rng_draws)
    if lora:
        apply_lora(policy, LORA)
    return policy, report, torch.get_rng_state()


def assert_same(old, new, rng: bool = True):
    (a, report_a, rng_a), (b, report_b, rng_b) = old, new
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and sa[name].device == sb[name].device, name
        assert torch.equal(sa[name], sb[name]), name
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())  # non-persistent ones too (RoPE tables)
    assert list(buffers_a) == list(buffers_b)
    assert all(torch.equal(buffers_a[n], buffers_b[n]) and buffers_a[n].dtype == buffers_b[n].dtype for n in buffers_a)
    assert [(n, p.requires_grad) for n, p in a.named_parameters()] == [(n, p.requires_grad) for n, p in b.named_parameters()]
    assert torch.equal(rng_a, rng_b) or not rng
    assert report_a.full() == report_b.full()


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("layout,policy_type", [(LEROBOT, "pi05"), (OPENPI, "pi05"), (OPENTAU, "pi05"), (LEROBOT, "pi0")])
def test_a_strict_load_equals_todays_build_then_load(tmp_path, layout, policy_type, lora):
    ckpt = published(tmp_path, layout, policy_type=policy_type, seed=3, stats=STATS)
    cfg = tiny_cfg(type=policy_type, pretrained_path=ckpt, discrete_action_loss=policy_type == "pi05")
    old = todays_way(cfg, lora)
    assert_same(old, new_way(cfg, lora))
    if not lora:  # what train does without LoRA: the same tensors, the initialization's draws skipped
        without_draws = new_way(cfg, lora, rng_draws=False)
        assert_same(old, without_draws, rng=False)
        torch.manual_seed(7)
        assert torch.equal(without_draws[2], torch.get_rng_state())


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("damage", ["none", "missing_and_mis_shaped"])
def test_a_non_strict_load_equals_todays_build_then_load(tmp_path, damage, lora):
    ckpt = published(tmp_path, LEROBOT, seed=3, stats=STATS)
    if damage != "none":  # the parameters the file does not fill keep today's initial values
        edit_weights(ckpt, lambda t: (t.pop(LM_NORM), t.update({"model.action_out_proj.bias": torch.zeros(5)})))
    cfg = tiny_cfg(pretrained_path=ckpt, pretrained_strict=False)
    old, new = todays_way(cfg, lora), new_way(cfg, lora)
    assert_same(old, new)
    assert (new[1].missing == ["vlm.language_model.norm.weight"]) == (damage != "none")


def test_the_parameters_get_storage_only_from_the_file(tmp_path, monkeypatch):
    """No random initial value is ever written into the policy: its parameters reach the load without storage."""
    ckpt = published(tmp_path, LEROBOT, seed=3, stats=STATS)
    seen = {}
    copy = pretrained._copy

    def recording_copy(policy, *args, **kwargs):
        seen["meta"] = [p.is_meta for p in policy.parameters()]
        return copy(policy, *args, **kwargs)

    monkeypatch.setattr(pretrained, "_copy", recording_copy)
    policy, report = build_pretrained(tiny_cfg(pretrained_path=ckpt))
    assert seen["meta"] and all(seen["meta"])
    assert not any(p.is_meta for p in policy.parameters()) and len(report.loaded) == len(seen["meta"])


def test_an_empty_build_has_real_buffers_and_leaves_the_rng_where_an_ordinary_build_does():
    cfg = tiny_cfg(type="pi0")
    torch.manual_seed(11)
    ordinary = build_policy(cfg)
    after_ordinary = torch.get_rng_state()
    torch.manual_seed(11)
    empty = build_policy(cfg, empty=True)
    assert torch.equal(torch.get_rng_state(), after_ordinary)
    assert all(p.is_meta for p in empty.parameters())
    buffers = dict(ordinary.named_buffers())
    assert [n for n, _ in empty.named_buffers()] == list(buffers)
    assert all(torch.equal(b, buffers[n]) for n, b in empty.named_buffers())
    # The initializers that would have run are back as they were: a later ordinary build draws the same values.
    torch.manual_seed(11)
    again = build_policy(cfg)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in ordinary.state_dict().items())


def test_a_bf16_checkpoint_is_read_and_cast_as_todays_load_casts_it(tmp_path):
    ckpt = published(tmp_path, LEROBOT, seed=3, stats=STATS)
    edit_weights(ckpt, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items() if v.is_floating_point()}))
    cfg = tiny_cfg(pretrained_path=ckpt)
    old, new = todays_way(cfg, lora=False), new_way(cfg, lora=False)
    assert_same(old, new)
    assert new[0].vlm.language_model.norm.weight.dtype == torch.float32


def test_the_startup_benchmark_reports_copies_of_the_weights_and_ratios_on_canned_numbers():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_startup import MIB, compare_rows

    runs = {"build + load": [{"peak_above_base": 700 * MIB, "wall_s": 4.0, "weights_bytes": 350 * MIB},
                             {"peak_above_base": 650 * MIB, "wall_s": 5.0, "weights_bytes": 350 * MIB}],
            "no init": [{"peak_above_base": 364 * MIB, "wall_s": 2.0, "weights_bytes": 350 * MIB}],
            "no init, no draws": [{"peak_above_base": 357 * MIB, "wall_s": 1.0, "weights_bytes": 350 * MIB}]}
    rows = dict(compare_rows(runs))
    assert rows["one copy of the weights (fp32)"] == "350 MiB"
    assert rows["build + load: peak RSS above imports"] == "650 MiB (1.86 copies of the weights)"  # best of the rounds
    assert rows["no init: peak RSS above imports"] == "364 MiB (1.04 copies of the weights)"
    assert rows["no init / build + load: peak RSS"] == "0.56x" and rows["no init / build + load: wall time"] == "0.50x"
    assert rows["no init, no draws / build + load: wall time"] == "0.25x"
