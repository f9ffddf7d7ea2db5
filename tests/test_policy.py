"""The pi05 / pi0 policy: sizes, losses, gradients, masks, tokenizers, weights I/O."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from opentau_cli.config.model import PolicyConfig
from opentau_cli.errors import UserError
from opentau_cli.policies import build_policy, count_parameters, load_pretrained

pytestmark = pytest.mark.quick

STATS = {
    "state": {"mean": [0.5, -1.0, 2.0, 0.0], "std": [2.0, 0.5, 1.0, 3.0], "q01": [-1.5, -2.0, 0.0, -6.0], "q99": [2.5, 0.0, 4.0, 6.0]},
    "action": {"mean": [1.0, 0.0, -2.0], "std": [0.5, 2.0, 1.0], "q01": [0.0, -4.0, -4.0], "q99": [2.0, 4.0, 0.0]},
}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest.one_thread says why)."""


def tiny_cfg(**overrides) -> PolicyConfig:
    base = dict(preset="pi05_tiny", chunk_size=10, n_action_steps=8, max_state_dim=8, max_action_dim=8,
                image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False)
    return PolicyConfig(**{**base, **overrides})


def make_batch(batch_size=4, cameras=2, resolution=32, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {
        "images": torch.rand(batch_size, cameras, 3, resolution, resolution, generator=g),
        "image_masks": torch.ones(batch_size, cameras, dtype=torch.bool),
        "state": torch.randn(batch_size, 4, generator=g),
        "actions": torch.randn(batch_size, 10, 3, generator=g),
        "action_is_pad": torch.zeros(batch_size, 10, dtype=torch.bool),
        "task": [f"pick up the cube {i}" for i in range(batch_size)],
    }
    batch["image_masks"][:, -1] = False  # the dataset lacks the last camera
    batch["images"][:, -1] = 0
    batch["action_is_pad"][0, 6:] = True
    return batch


def fixed_noise_and_time(batch_size=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 10, 8, generator=g), torch.rand(batch_size, generator=g)


def test_pi05_preset_counts_between_3_2_and_3_4_billion_parameters_on_meta():
    counts = count_parameters(PolicyConfig(preset="pi05"))
    assert 3.2e9 <= counts["total"] <= 3.4e9
    # freeze_vision_encoder (default) leaves SigLIP (~0.4B) out of the trainable count.
    assert 2.7e9 <= counts["trainable"] < counts["total"] - 3.5e8


def test_small_and_tiny_presets_have_their_documented_sizes():
    small = count_parameters(PolicyConfig(preset="pi05_small", image_resolution=(112, 112)))
    tiny = count_parameters(tiny_cfg())
    assert 50e6 <= small["total"] <= 150e6
    assert 1e6 <= tiny["total"] <= 5e6
    assert tiny["trainable"] < tiny["total"]  # the last VLM layer's unused q/o/MLP are frozen


def test_small_preset_runs_forward_and_backward():
    torch.manual_seed(0)
    policy = build_policy(PolicyConfig(preset="pi05_small", chunk_size=10, n_action_steps=10, max_state_dim=8, max_action_dim=8,
                                       image_resolution=(112, 112), tokenizer_max_length=48))
    out = policy(make_batch(batch_size=2, resolution=112))
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    assert policy.action_out_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("policy_type", ["pi05", "pi0"])
def test_tiny_forward_returns_losses_and_sample_actions_returns_real_dims(policy_type):
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg(type=policy_type, discrete_action_loss=True, loss_weighting={"mse": 1.0, "ce": 0.5}), stats=STATS)
    out = policy(make_batch())
    assert set(out) == {"loss", "mse_loss", "ce_loss"}
    assert torch.allclose(out["loss"], out["mse_loss"] + 0.5 * out["ce_loss"])
    actions = policy.sample_actions(make_batch())
    assert actions.shape == (4, 8, 3)  # n_action_steps, the dataset's 3 action dims
    assert torch.isfinite(actions).all()


MODES = list(itertools.product(["pi05", "pi0"], [False, True], [True, False], [False, True], [False, True]))


@pytest.mark.parametrize("policy_type,ce,freeze_vision,expert_only,insulated", MODES)
def test_every_trainable_parameter_gets_a_gradient_from_one_backward(policy_type, ce, freeze_vision, expert_only, insulated):
    policy = build_policy(tiny_cfg(type=policy_type, discrete_action_loss=ce, freeze_vision_encoder=freeze_vision,
                                   train_expert_only=expert_only, knowledge_insulation=insulated))
    policy(make_batch())["loss"].backward()
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    without_grad = sorted(n for n, p in policy.named_parameters() if p.requires_grad and p.grad is None)
    assert without_grad == []
    assert any(n.startswith("expert.layers.") for n in trainable)
    # Knowledge insulation without the CE loss: no gradient reaches the VLM, so it is frozen.
    vlm_trains = not expert_only and (ce or not insulated)
    assert any(n.startswith("vlm.vision_tower.") for n in trainable) == (vlm_trains and not freeze_vision)
    assert any(n.startswith("vlm.language_model.") for n in trainable) == vlm_trains
    # The last VLM layer's q/o/MLP and final norm are trained only when the CE loss reads the prefix outputs.
    assert ("vlm.language_model.norm.weight" in trainable) == (ce and vlm_trains)


def test_knowledge_insulation_keeps_the_flow_loss_out_of_the_vlm():
    def vlm_grad_norm(ki: bool) -> float:
        torch.manual_seed(0)
        policy = build_policy(tiny_cfg(knowledge_insulation=ki, discrete_action_loss=True, loss_weighting={"mse": 1.0, "ce": 0.0}))
        noise, time = fixed_noise_and_time()
        policy(make_batch(), noise=noise, time=time)["loss"].backward()
        return sum(p.grad.abs().sum().item() for n, p in policy.named_parameters() if n.startswith("vlm.") and p.grad is not None)

    assert vlm_grad_norm(ki=False) > 0
    assert vlm_grad_norm(ki=True) == 0


def test_knowledge_insulation_without_ce_loss_freezes_the_vlm():
    policy = build_policy(tiny_cfg(knowledge_insulation=True))
    assert not any(p.requires_grad for n, p in policy.named_parameters() if n.startswith("vlm."))


@pytest.mark.parametrize("policy_type", ["pi05", "pi0"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(policy_type):
    def run(checkpointing: bool):
        torch.manual_seed(0)
        policy = build_policy(tiny_cfg(type=policy_type, gradient_checkpointing=checkpointing, discrete_action_loss=True))
        noise, time = fixed_noise_and_time()
        out = policy(make_batch(), noise=noise, time=time)
        out["loss"].backward()
        return out["loss"].detach(), {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}

    loss_plain, grads_plain = run(False)
    loss_ckpt, grads_ckpt = run(True)
    assert torch.equal(loss_plain, loss_ckpt)
    assert grads_plain.keys() == grads_ckpt.keys()
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_recomputes_layers_in_backward():
    policy = build_policy(tiny_cfg(gradient_checkpointing=True))
    calls = []
    layer = policy.expert.layers[0].mlp
    layer.register_forward_hook(lambda *a: calls.append(1))
    policy(make_batch())["loss"].backward()
    assert len(calls) == 2  # once in forward, once more during backward


def test_a_missing_camera_and_padded_prompt_tokens_do_not_change_the_loss():
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg())
    noise, time = fixed_noise_and_time()
    batch = make_batch()
    reference = policy(batch, noise=noise, time=time)["loss"]
    batch["images"][:, -1] = torch.rand_like(batch["images"][:, -1])  # the masked camera's pixels
    assert torch.equal(policy(batch, noise=noise, time=time)["loss"], reference)
    batch["images"][:, 0] = torch.rand_like(batch["images"][:, 0])  # a real camera's pixels
    assert not torch.equal(policy(batch, noise=noise, time=time)["loss"], reference)


def test_padded_action_steps_and_padded_dims_get_no_loss_gradient():
    policy = build_policy(tiny_cfg())
    captured = {}

    run_expert = policy._run_expert

    def keep(*args):
        velocity = run_expert(*args)
        velocity.retain_grad()
        captured["velocity"] = velocity
        return velocity

    policy._run_expert = keep
    policy(make_batch())["loss"].backward()
    grad = captured["velocity"].grad  # (batch, chunk, max_action_dim)
    assert grad[0, 6:].abs().sum() == 0  # past episode 0's end
    assert grad[:, :, 3:].abs().sum() == 0  # zero-padded action dims
    assert (grad[0, :6, :3] != 0).all() and (grad[1:, :, :3] != 0).all()


def test_dims_past_a_samples_own_action_dim_get_no_loss_gradient():
    """A mixture's narrower member arrives padded to the widest member; its samples' `action_dim` keeps the padding
    out of the loss as a single dataset's zero padding is."""
    policy = build_policy(tiny_cfg())
    seen, run_expert = {}, policy._run_expert

    def keep(*args):
        seen["velocity"] = run_expert(*args)
        seen["velocity"].retain_grad()
        return seen["velocity"]

    policy._run_expert = keep
    batch = {**make_batch(), "action_dim": torch.tensor([3, 2, 1, 3])}
    policy(batch)["loss"].backward()
    grad = seen["velocity"].grad
    for row, width in enumerate((3, 2, 1, 3)):
        assert grad[row, :, width:].abs().sum() == 0, row
        steps = 6 if row == 0 else 10  # sample 0's episode ends after 6 steps
        assert (grad[row, :steps, :width] != 0).all(), row


def test_state_dict_round_trips_through_safetensors_bit_exactly_with_its_stats(tmp_path):
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg(discrete_action_loss=True), stats=STATS)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the init values
    path = tmp_path / "model.safetensors"
    save_file(policy.state_dict(), str(path))
    assert {"state_mean", "state_std", "state_q01", "state_q99", "action_mean", "action_std", "action_q01", "action_q99",
            "action_dim"} <= set(load_file(str(path)))

    torch.manual_seed(123)
    fresh = build_policy(tiny_cfg(discrete_action_loss=True))  # no stats: the checkpoint alone must carry them
    report = load_pretrained(fresh, path)
    assert report.clean
    for name, tensor in policy.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    noise = torch.randn(4, 10, 8)
    assert torch.equal(fresh.sample_actions(make_batch(), noise=noise), policy.sample_actions(make_batch(), noise=noise))
    # Un-normalized output: the action mean/std were applied.
    assert fresh.sample_actions(make_batch(), noise=noise).shape[-1] == 3


def test_load_pretrained_strict_lists_missing_and_unexpected_keys(tmp_path):
    policy = build_policy(tiny_cfg())
    tensors = dict(policy.state_dict())
    tensors.pop("action_out_proj.bias")
    tensors["old_head.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"1 missing keys: action_out_proj.bias; 1 unexpected keys: old_head.weight"):
        load_pretrained(build_policy(tiny_cfg()), tmp_path)  # a directory holding model.safetensors
    report = load_pretrained(build_policy(tiny_cfg()), tmp_path / "model.safetensors", strict=False)
    assert report.missing == ["action_out_proj.bias"] and report.unexpected == ["old_head.weight"]


def test_load_pretrained_reads_hugging_face_shards_with_an_index(tmp_path):
    policy = build_policy(tiny_cfg(), stats=STATS)
    tensors = policy.state_dict()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(tmp_path / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fresh = build_policy(tiny_cfg())
    assert load_pretrained(fresh, tmp_path).clean
    assert torch.equal(fresh.action_std, policy.action_std) and torch.equal(fresh.action_q99, policy.action_q99)


def test_load_pretrained_refuses_a_missing_path_and_a_corrupt_file(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_pretrained(build_policy(tiny_cfg()), tmp_path / "nope.safetensors")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_pretrained(build_policy(tiny_cfg()), tmp_path)


def test_pretrained_shape_mismatch_is_reported(tmp_path):
    save_file(build_policy(tiny_cfg(max_action_dim=6)).state_dict(), str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="shape-mismatched keys: action_mean"):
        load_pretrained(build_policy(tiny_cfg()), tmp_path)


def test_byte_tokenizer_prompt_holds_task_bytes_then_one_token_per_state_bin():
    policy = build_policy(tiny_cfg(), stats=STATS)
    batch = make_batch(batch_size=1)
    batch["task"] = ["ab"]
    # Quantile-normalized: 0.004 (bin 128), 0.504 (bin 192), 1.5 (top bin), far below -1 (openpi's -1: the lowest id here).
    batch["state"] = torch.tensor([[0.508, -0.496, 5.0, -100.0]])
    inputs = policy._prepare(batch, with_actions=False)
    ids = inputs["input_ids"][0].tolist()
    assert ids[:3] == [1, 3 + ord("a"), 3 + ord("b")]
    assert ids[3:7] == [259 + 128, 259 + 192, 259 + 255, 259 + 0]
    assert ids[7:] == [0] * (48 - 7) and inputs["text_valid"][0].sum() == 7


def test_too_short_tokenizer_max_length_is_a_user_error():
    policy = build_policy(tiny_cfg(tokenizer_max_length=8, max_state_dim=8))
    batch = make_batch()
    batch["state"] = torch.randn(4, 8)
    with pytest.raises(UserError, match="tokenizer_max_length=8 leaves no room for the 8 state tokens"):
        policy(batch)


def make_local_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[BOS]", "[UNK]", "Task", "State", "Action", ":", ";", ",", "pick", "up", "the", "cube"] + [str(i) for i in range(256)]
    vocab = {w: i for i, w in enumerate(words)}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", bos_token="[BOS]", unk_token="[UNK]")
    fast.save_pretrained(str(path))
    return vocab


def test_a_local_hugging_face_tokenizer_directory_is_used_with_the_state_as_numbers(tmp_path):
    vocab = make_local_tokenizer(tmp_path / "tok")
    policy = build_policy(tiny_cfg(tokenizer_path=tmp_path / "tok", tokenizer_max_length=48), stats=STATS)
    batch = make_batch(batch_size=1)
    batch["task"] = ["pick up the cube"]
    batch["state"] = torch.tensor([[0.508, -0.996, 2.008, 0.024]])  # each 0.004 above its q01..q99 midpoint: bin 128
    ids = policy._prepare(batch, with_actions=False)["input_ids"][0].tolist()
    expected = ["[BOS]", "Task", ":", "pick", "up", "the", "cube", ",", "State", ":", "128", "128", "128", "128", ";", "Action", ":"]
    assert ids[: len(expected)] == [vocab[w] for w in expected]
    out = policy(make_batch())
    out["loss"].backward()
    assert torch.isfinite(out["loss"])


def test_a_bad_tokenizer_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        build_policy(tiny_cfg(tokenizer_path=tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a loadable Hugging Face tokenizer"):
        build_policy(tiny_cfg(tokenizer_path=tmp_path / "empty"))


def test_stats_wider_than_max_dims_are_a_user_error():
    wide = {"state": {"q01": [0.0] * 9, "q99": [1.0] * 9}, "action": {"q01": [0.0], "q99": [1.0]}}
    with pytest.raises(UserError, match="state has 9 dims but policy.max_state_dim=8"):
        build_policy(tiny_cfg(), stats=wide)


def test_non_square_or_unpatchable_images_are_a_user_error():
    with pytest.raises(UserError, match="square"):
        count_parameters(tiny_cfg(image_resolution=(32, 48)))
    with pytest.raises(UserError, match="multiple of the pi05_tiny patch size 8"):
        count_parameters(tiny_cfg(image_resolution=(36, 36)))


def test_bf16_weights_accept_fp32_inputs():
    policy = build_policy(tiny_cfg(discrete_action_loss=True)).to(torch.bfloat16)
    out = policy(make_batch())
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and policy.action_out_proj.weight.grad.dtype == torch.bfloat16
    assert policy.sample_actions(make_batch()).dtype == torch.float32


def test_too_many_discrete_action_bins_for_the_vocabulary_is_a_user_error():
    with pytest.raises(UserError, match="discrete_action_bins=600 does not fit the 1024-token vocabulary"):
        build_policy(tiny_cfg(discrete_action_loss=True, discrete_action_bins=600))
    build_policy(tiny_cfg(discrete_action_loss=False, discrete_action_bins=600))  # unused bins: no complaint
