"""LoRA in-process: which weights train, the merge (against its formula and the adapted policy's outputs), the size of
what a LoRA checkpoint holds for pi05, the rules and the resume checks on the base weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import EXAMPLES
from opentau_cli.cli.summary import ADAMW_BYTES_PER_PARAMETER
from opentau_cli.config import Machine, load_config, setup_from_dict, validate
from opentau_cli.config.model import LoraConfig, PolicyConfig
from opentau_cli.errors import UserError
from opentau_cli.plan.run_plan import check_policy
from opentau_cli.policies import build_policy
from opentau_cli.policies.lora import (
    BASE_KEY, apply_lora, base_reference, check_resume, checkpoint_keys, is_adapter, merge_adapter,
)

pytestmark = pytest.mark.quick


def tiny(**lora) -> PolicyConfig:
    return PolicyConfig(preset="pi05_tiny", chunk_size=10, n_action_steps=10, max_state_dim=8, max_action_dim=8,
                        image_resolution=(32, 32), tokenizer_max_length=48, lora=lora)


def batch(size: int = 2) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"images": torch.rand(size, 1, 3, 32, 32, generator=g), "image_masks": torch.ones(size, 1, dtype=torch.bool),
            "state": torch.randn(size, 8, generator=g), "actions": torch.randn(size, 10, 8, generator=g),
            "action_is_pad": torch.zeros(size, 10, dtype=torch.bool), "task": ["pick the bottle"] * size}


def adapted(rank: int = 4, alpha: float = 8.0):
    """A tiny policy with adapters whose B is not zero (as after training), so that merging changes the weights."""
    cfg = tiny(rank=rank, alpha=alpha)
    torch.manual_seed(0)
    policy = apply_lora(build_policy(cfg), cfg.lora)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return cfg, policy


def test_lora_trains_the_adapters_of_the_default_targets_and_the_action_time_projections_only():
    cfg, policy = adapted()
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if is_adapter(n)}
    assert trainable - adapters == {n for n, _ in policy.named_parameters() if n.startswith(("embed_suffix.", "action_out_proj."))}
    adapted_modules = {n.split(".lora_")[0] for n in adapters}
    # Every attention and MLP projection of both transformers, except those of the last VLM layer that nothing reads
    # without the CE loss (only its k/v are used).
    for stack, layers in (("vlm.language_model.layers", 4), ("expert.layers", 4)):
        for i in range(layers):
            for proj in ("self_attn.k_proj", "self_attn.v_proj"):
                assert f"{stack}.{i}.{proj}" in adapted_modules
            for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                assert (f"{stack}.{i}.{proj}" in adapted_modules) == (stack.startswith("expert") or i < 3)
    assert not any(n.startswith("vlm.vision_tower.") for n in adapted_modules)
    # Names stay the policy's own: the frozen weight under base_layer, peft's adapter name in the adapter keys.
    names = set(policy.state_dict())
    assert {"expert.layers.0.mlp.down_proj.base_layer.weight", "expert.layers.0.mlp.down_proj.lora_A.default.weight",
            "expert.layers.0.mlp.down_proj.lora_B.default.weight", "action_out_proj.weight"} <= names


def test_a_backward_pass_reaches_every_trainable_parameter_and_no_frozen_one():
    _, policy = adapted()
    policy(batch())["loss"].backward()
    for name, p in policy.named_parameters():
        assert (p.grad is not None) == p.requires_grad, name


def test_merged_weights_equal_base_plus_alpha_over_rank_times_b_a():
    cfg, policy = adapted(rank=4, alpha=8.0)
    state = policy.state_dict()
    merged = merge_adapter(state, cfg.lora)
    module = "vlm.language_model.layers.1.self_attn.q_proj"
    a, b = state[f"{module}.lora_A.default.weight"], state[f"{module}.lora_B.default.weight"]
    expected = state[f"{module}.base_layer.weight"] + (8.0 / 4) * b @ a
    assert torch.equal(merged[f"{module}.weight"], expected)
    assert not torch.equal(expected, state[f"{module}.base_layer.weight"])
    assert torch.equal(merged["action_out_proj.weight"], state["action_out_proj.weight"])
    plain = build_policy(tiny()).state_dict()
    assert set(merged) == set(plain)  # exactly a plain policy's names: nothing left over, nothing missing


def test_merge_takes_a_plain_base_state_dict_updated_with_a_checkpoint_s_tensors():
    cfg, policy = adapted()
    state = policy.state_dict()
    keys = checkpoint_keys(policy)
    base = {k.replace(".base_layer.", "."): v for k, v in state.items() if k not in keys}
    from_checkpoint = {k: state[k] for k in keys}
    merged, expected = merge_adapter({**base, **from_checkpoint}, cfg.lora), merge_adapter(state, cfg.lora)
    assert set(merged) == set(expected) and all(torch.equal(merged[k], expected[k]) for k in expected)


def test_the_merged_plain_policy_gives_the_adapted_policy_s_loss_and_actions():
    cfg, policy = adapted()
    plain = build_policy(tiny())
    plain.load_state_dict(merge_adapter(policy.state_dict(), cfg.lora), strict=True)
    policy.eval(), plain.eval()
    noise, time = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(1)), torch.full((2,), 0.3)
    with torch.no_grad():
        assert torch.allclose(policy(batch(), noise=noise, time=time)["loss"], plain(batch(), noise=noise, time=time)["loss"], atol=1e-5)
        assert torch.allclose(policy.sample_actions(batch(), noise=noise), plain.sample_actions(batch(), noise=noise), atol=1e-5)


def test_merge_refuses_an_adapter_without_its_pair():
    cfg, policy = adapted()
    state = {k: v for k, v in policy.state_dict().items() if not k.endswith("expert.layers.0.mlp.up_proj.lora_B.default.weight")}
    with pytest.raises(ValueError, match="expert.layers.0.mlp.up_proj"):
        merge_adapter(state, cfg.lora)


def test_a_pi05_rank_16_lora_checkpoint_is_under_10_percent_of_a_full_one():
    """Bytes a checkpoint holds (fp32 tensors plus AdamW's two fp32 moments per trained parameter), from meta builds."""
    def checkpoint_bytes(policy) -> int:
        params = dict(policy.named_parameters())
        trained = sum(p.numel() for p in params.values() if p.requires_grad)
        keys = checkpoint_keys(policy)
        saved = sum(t.numel() for k, t in policy.state_dict().items() if k in keys)
        return 4 * saved + ADAMW_BYTES_PER_PARAMETER * trained

    with torch.device("meta"):
        full = build_policy(PolicyConfig(preset="pi05"))
        full_bytes = 4 * sum(t.numel() for t in full.state_dict().values()) + \
            ADAMW_BYTES_PER_PARAMETER * sum(p.numel() for p in full.parameters() if p.requires_grad)
        cfg = PolicyConfig(preset="pi05", lora={"rank": 16})
        lora_bytes = checkpoint_bytes(apply_lora(build_policy(cfg), cfg.lora))
    assert full_bytes > 30e9  # 3.3B parameters: weights and AdamW state
    assert lora_bytes < 0.01 * full_bytes, (lora_bytes, full_bytes)


def test_checkpoint_keys_are_the_trained_parameters_and_the_buffers():
    _, policy = adapted()
    keys = checkpoint_keys(policy)
    assert "state_q01" in keys and "expert.layers.0.self_attn.q_proj.lora_A.default.weight" in keys
    assert "embed_suffix.action_in_proj.weight" in keys
    assert not any(".base_layer." in k or k.startswith("vlm.vision_tower.") for k in keys)


def _validate(*args: str):
    cfg = load_config(EXAMPLES / "pi05_tiny_config.json", dict(a.split("=", 1) for a in args))
    return validate(cfg, setup_from_dict({"backend": "single"}), Machine(cuda=False, gpus=0), [check_policy])


def test_lora_with_train_expert_only_and_a_target_that_matches_nothing_are_both_refused_before_launch(tmp_path):
    with pytest.raises(UserError) as e:
        _validate(f"output_dir={tmp_path / 'run'}", "policy.lora.rank=8", "policy.train_expert_only=true",
                  "policy.lora.target_modules=nothing_here")
    assert "policy.train_expert_only=true conflicts with policy.lora.rank > 0" in str(e.value)
    assert "policy.lora.target_modules='nothing_here' matches no trainable Linear layer" in str(e.value)
    with pytest.raises(UserError, match="full_modules names 'no_such_module'"):
        _validate(f"output_dir={tmp_path / 'run'}", "policy.lora.rank=8", 'policy.lora.full_modules=["no_such_module"]')
    with pytest.raises(UserError, match="a GemmaMLP: LoRA adapts Linear layers only"):
        _validate(f"output_dir={tmp_path / 'run'}", "policy.lora.rank=8", r"policy.lora.target_modules=expert\.layers\.0\.mlp")


def test_a_list_of_targets_adapts_the_modules_whose_names_end_with_them():
    cfg = tiny(rank=2, target_modules=["down_proj"], full_modules=[])
    policy = apply_lora(build_policy(cfg), cfg.lora)
    adapted_modules = {n.split(".lora_")[0] for n, p in policy.named_parameters() if p.requires_grad}
    # The last VLM layer's MLP is never read without the CE loss: it gets no adapter.
    assert adapted_modules == {f"expert.layers.{i}.mlp.down_proj" for i in range(4)} | \
        {f"vlm.language_model.layers.{i}.mlp.down_proj" for i in range(3)}


def _base(tmp_path, seed: int):
    torch.manual_seed(seed)
    folder = tmp_path / f"base{seed}"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in build_policy(tiny()).state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def test_a_resume_is_refused_when_the_base_weights_changed_and_accepted_when_they_only_moved(tmp_path):
    base = _base(tmp_path, 1)
    cfg = load_config(EXAMPLES / "pi05_tiny_config.json", {"policy.lora.rank": "4", "policy.pretrained_path": str(base)})
    saved_policy = cfg.policy.model_dump(mode="json")
    state = {BASE_KEY: base_reference(cfg.policy, cfg.seed)}
    assert state[BASE_KEY]["source"] == str(base) and list(state[BASE_KEY]["files"]) == ["model.safetensors"]

    moved = tmp_path / "moved"
    base.rename(moved)
    cfg.policy.pretrained_path = moved
    check_resume(tmp_path, saved_policy, state, cfg)  # the same content elsewhere is the same base

    tensors = load_file(str(moved / "model.safetensors"))
    tensors["action_out_proj.bias"] += 1
    save_file(tensors, str(moved / "model.safetensors"))
    with pytest.raises(UserError, match=r"holds LoRA adapters of the base weights .*base1 and this launch's base "
                                        r"\(.*moved\) is not the same content"):
        check_resume(tmp_path, saved_policy, state, cfg)


def test_a_resume_is_refused_when_the_lora_setting_or_the_seed_of_a_seeded_base_changed(tmp_path):
    cfg = load_config(EXAMPLES / "pi05_tiny_config.json", {"policy.lora.rank": "4"})
    saved_policy = cfg.policy.model_dump(mode="json")
    state = {BASE_KEY: base_reference(cfg.policy, cfg.seed)}
    check_resume(tmp_path, saved_policy, state, cfg)
    with pytest.raises(UserError, match=r"the seeded initial policy \(seed 1000\) and this launch's base \(the seeded initial policy \(seed 5\)\)"):
        check_resume(tmp_path, saved_policy, state, cfg.model_copy(update={"seed": 5}))
    other = cfg.model_copy(deep=True)
    other.policy.lora = LoraConfig(rank=8)
    with pytest.raises(UserError, match="was trained with policy.lora=.*'rank': 4"):
        check_resume(tmp_path, saved_policy, state, other)
    # A checkpoint of full fine-tuning (written before LoRA existed: no lora key) resumes without LoRA only.
    old_policy = {k: v for k, v in saved_policy.items() if k != "lora"}
    check_resume(tmp_path, old_policy, {}, load_config(EXAMPLES / "pi05_tiny_config.json", {}))
    with pytest.raises(UserError, match="was trained with policy.lora=.*'rank': 0"):
        check_resume(tmp_path, old_policy, {}, cfg)


def test_config_validate_prints_the_trainable_count_and_the_adamw_memory_it_implies(tmp_path):
    from opentau_cli.cli.summary import summarize
    from opentau_cli.process.launch import RunPlan

    checked = _validate(f"output_dir={tmp_path / 'run'}", "policy.lora.rank=4")
    text = summarize(RunPlan(checked=checked))
    from opentau_cli.policies import count_parameters

    counts = count_parameters(checked.config.policy)
    assert f"/ {counts['trainable']:,})" in text
    assert counts["trainable"] < counts["total"] / 5
    kib = ADAMW_BYTES_PER_PARAMETER * counts["trainable"] / 2**10
    assert f"optimizer memory   {kib:.2f} KiB AdamW state" in text
    assert json.dumps(checked.config.policy.lora.model_dump(mode="json"))  # the section serializes into train_config.json
