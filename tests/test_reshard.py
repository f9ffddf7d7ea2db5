"""Elastic resume, model and optimizer side: a checkpoint saved under one topology, put into a launch of another
through opentau_cli.train.reshard, holds exactly the saved state there, parameter by parameter.

Each transition compares the state the saving launch held (DeepSpeed's safe_get_* / the torch optimizer, dumped
before the save: not read back from the files) with the state the new launch holds after the load. Three launches
(tests/reshard_driver.py) chain them: DDP -> ZeRO-2 -> ZeRO-3 -> DDP and ZeRO-3 -> ZeRO-1 on 2 processes, ZeRO-2 on
2 -> one process, one process -> ZeRO-3 and ZeRO-2 under bf16 (the fp32 master weights compared) on 2, that one ->
DDP.
"""

from __future__ import annotations

import pytest
import torch

import reshard_driver

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow]

TRANSITIONS = [("ddpr2", "zero2r2"), ("zero2r2", "zero3r2"), ("zero3r2", "ddpr2"), ("zero3r2", "zero1r2"),
               ("zero2r2", "ddpr1"), ("ddpr1", "zero3r2"), ("ddpr1", "zero2bf16r2"), ("zero2bf16r2", "ddpr2")]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    reshard_driver.launch(out, "ddp:save,zero2:load+save,zero3:load+save,ddp:load,zero1:load", num_processes=2)
    reshard_driver.launch(out, "ddp:load+save", num_processes=1, load_from=f"zero2r2={out / 'zero2r2'}")
    reshard_driver.launch(out, "zero3:load,zero2bf16:load+save,ddp:load", num_processes=2, load_from=f"ddpr1={out / 'ddpr1'}")
    return out


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("saved,loaded", TRANSITIONS, ids=[f"{a}->{b}" for a, b in TRANSITIONS])
def test_resharded_state_equals_the_saved_state_parameter_by_parameter(dumps, saved, loaded):
    ref, got = _load(dumps / f"{saved}_ref.pt"), _load(dumps / f"{saved}_to_{loaded}.pt")
    names = sorted(ref["weight"])
    assert names == ["body.0.bias", "body.0.weight", "body.2.bias", "body.2.weight", "embed.weight"]  # tied head: one
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        assert sorted(got[kind]) == names, kind
        for name in names:
            assert torch.equal(got[kind][name], ref[kind][name]), (kind, name)
    assert ref["exp_avg_sq"]["embed.weight"].abs().sum() > 0  # a state that was trained, not zeros on both sides
    assert got["step"] == ref["step"] and min(ref["step"].values()) >= 2
    assert got["scheduler"] == ref["scheduler"]  # step count, last lr and the optimizer's current lr
    # Buffers and frozen parameters have no fp32 master: under bf16 DeepSpeed they are held in bf16, so they compare in
    # the dtype the new launch holds them in (bf16 -> fp32 is exact; fp32 -> bf16 is the launch's own rounding).
    for group in ("buffers", "frozen"):
        assert sorted(got[group]) == sorted(ref[group])
        for name in ref[group]:
            assert torch.equal(got[group][name], ref[group][name].to(got[group][name].dtype)), (group, name)


def test_the_new_launch_did_not_start_from_the_saved_weights_by_itself(dumps):
    # Every phase builds its model from another seed: equality above comes from the load, not from the init.
    a, b = _load(dumps / "ddpr2_ref.pt"), _load(dumps / "zero2r2_ref.pt")
    torch.manual_seed(101)  # the seed the ZeRO-2 phase built its model with
    fresh = reshard_driver.TinyTied(reshard_driver.VOCAB, reshard_driver.WIDTH)
    assert not torch.equal(fresh.frozen.weight, a["frozen"]["frozen.weight"])
    assert not torch.equal(a["weight"]["embed.weight"], b["weight"]["embed.weight"])  # trained on between saves


def test_a_parameter_that_never_received_a_gradient_reshards_from_ddp_into_zero_and_back(tmp_path):
    """No AdamW state under DDP (AdamW makes it at a parameter's first gradient): ZeRO-2 takes it with zero moments
    (what ZeRO, stepping every parameter of its flat group, keeps for one without gradients), and DDP takes ZeRO's
    state back as it is; every transition checks its state on arrival (check_applied) and compares here."""
    reshard_driver.launch(tmp_path, "ddp:save,zero2:load+save,ddp:load", num_processes=2, idle=True)
    ddp, into_zero2 = _load(tmp_path / "ddpr2_ref.pt"), _load(tmp_path / "ddpr2_to_zero2r2.pt")
    assert ddp["exp_avg"]["idle.weight"] is None and ddp["step"]["idle.weight"] is None  # the premise
    assert torch.equal(into_zero2["weight"]["idle.weight"], ddp["weight"]["idle.weight"])
    assert not into_zero2["exp_avg"]["idle.weight"].any() and not into_zero2["exp_avg_sq"]["idle.weight"].any()
    assert torch.equal(into_zero2["exp_avg_sq"]["embed.weight"], ddp["exp_avg_sq"]["embed.weight"])
    zero2, back = _load(tmp_path / "zero2r2_ref.pt"), _load(tmp_path / "zero2r2_to_ddpr2.pt")
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        assert torch.equal(back[kind]["idle.weight"], zero2[kind]["idle.weight"]), kind
