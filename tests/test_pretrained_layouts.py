"""Published layouts: detected from their keys, the full-size pi05 holds every published tensor with its shape, and
every layout round-trips (ours -> published -> load) to identical tensors and identical outputs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from opentau_cli.config.model import PolicyConfig
from opentau_cli.errors import UserError
from opentau_cli.policies import build_policy, check_pretrained, layouts, load_pretrained
from opentau_cli.policies.layouts import LEROBOT, NATIVE, OPENPI, OPENTAU, Layout, detect_layout, our_name, published_names
from published import GEMMA, published_keys, spec_published_names, stats_of, write_header_only, write_published

pytestmark = pytest.mark.full

# ------------------------------------------------------------------------------------ the published key lists
# published_keys (tests/published.py): every published pi05 / pi0 tensor with its shape at the real dimensions.
OPENTAU_EXTRAS = {  # inside OpenTau's weights: its normalization buffers and its discrete-action head
    "normalize_inputs.buffer_state.min": (32,), "normalize_inputs.buffer_state.max": (32,),
    "normalize_targets.buffer_actions.mean": (32,), "normalize_targets.buffer_actions.std": (32,),
    "unnormalize_outputs.buffer_actions.mean": (32,), "unnormalize_outputs.buffer_actions.std": (32,),
    "model.paligemma_with_expert.discrete_action_embedding.weight": (2048, GEMMA),
    "model.paligemma_with_expert.da_head.weight": (2048, GEMMA), "model.paligemma_with_expert.da_head.bias": (2048,),
}
FULL_SIZE = {
    ("openpi", "pi05"): published_keys("pi05", "", embed_tokens=False),
    ("lerobot", "pi05"): published_keys("pi05", "model.", embed_tokens=False),
    ("opentau", "pi05"): {**published_keys("pi05", "model.", embed_tokens=True), **OPENTAU_EXTRAS},
    ("lerobot", "pi0"): published_keys("pi0", "model.", embed_tokens=False, expert_lm_head=True),
}


@pytest.mark.parametrize("layout,policy_type", list(FULL_SIZE))
def test_full_size_policy_holds_every_published_tensor_with_its_shape(tmp_path, layout, policy_type):
    keys = FULL_SIZE[(layout, policy_type)]
    write_header_only(tmp_path / "model.safetensors", keys)  # real headers, sparse data: no weights needed
    cfg = PolicyConfig(type=policy_type, preset="pi05", pretrained_path=tmp_path)
    report = check_pretrained(cfg)  # the 3.3B policy on the meta device, matched from the headers alone

    assert report.layout == Layout(layout, policy_type)
    assert report.clean and not report.missing and not report.unexpected and not report.mismatched
    with torch.device("meta"):
        policy = build_policy(cfg)
    params = {name for name, _ in policy.named_parameters()}
    assert set(report.loaded) == params  # every parameter comes from the checkpoint
    assert set(report.not_carried) == set(policy.state_dict()) - params  # only the statistics buffers do not
    ignored = {k for keys_ in report.ignored.values() for k in keys_}
    expected_ignored = {k for k in keys if k in OPENTAU_EXTRAS or k.endswith("gemma_expert.lm_head.weight")}
    if layout == "opentau":
        expected_ignored.add("model.paligemma_with_expert.paligemma.lm_head.weight")  # tied copy of embed_tokens
    assert ignored == expected_ignored
    # And back: every parameter's published name is one of the layout's own.
    weights = set(keys) - set(OPENTAU_EXTRAS) - {k for k in keys if k.endswith("gemma_expert.lm_head.weight")}
    assert {n for name in params for n in published_names(name, Layout(layout, policy_type))} == weights
    # The test fixtures' own spelling (written from the published layouts) names the same tensors.
    assert {n for name in params for n in spec_published_names(name, layout, policy_type)} == weights


def test_layouts_are_detected_from_their_keys():
    pi05 = list(published_keys("pi05", "", embed_tokens=False))
    assert detect_layout(pi05) == Layout(OPENPI, "pi05")
    assert detect_layout("model." + k for k in pi05) == Layout(LEROBOT, "pi05")
    assert detect_layout([*("model." + k for k in pi05), "normalize_inputs.buffer_state.min"]) == Layout(OPENTAU, "pi05")
    # A LeRobot file that does keep embed_tokens is still LeRobot (its statistics are in its normalizer files).
    embed = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    assert detect_layout([*("model." + k for k in pi05), embed]) == Layout(LEROBOT, "pi05")
    pi0 = list(published_keys("pi0", "model.", embed_tokens=False))
    assert detect_layout(pi0) == Layout(LEROBOT, "pi0")
    # OpenTau's older pi05 checkpoints name the time MLP like pi0's; the adaRMS norms still say pi05.
    legacy = [k.replace("time_mlp_", "action_time_mlp_") for k in ("model." + k for k in pi05)] + ["model.paligemma_with_expert.da_head.bias"]
    assert detect_layout(legacy) == Layout(OPENTAU, "pi05", legacy_time_mlp=True)
    assert our_name("model.action_time_mlp_in.weight", detect_layout(legacy)) == "embed_suffix.time_mlp_in.weight"
    with torch.device("meta"):
        assert detect_layout(build_policy(PolicyConfig(preset="pi05_tiny", type="pi0")).state_dict()) == Layout(NATIVE, "pi0")
    with pytest.raises(UserError, match="not a pi05 or pi0 checkpoint: none of its 2 tensor names"):
        detect_layout(["encoder.weight", "decoder.weight"])
    with pytest.raises(UserError, match="cannot tell pi05 from pi0"):
        detect_layout([*pi05, "state_proj.weight"])


# ------------------------------------------------------------------------------------------ round trips
STATS = {
    "state": {"mean": [0.5, -1.0, 2.0, 0.0], "std": [2.0, 0.5, 1.0, 3.0], "q01": [-1.5, -2.0, 0.0, -6.0], "q99": [2.5, 0.0, 4.0, 6.0]},
    "action": {"mean": [1.0, 0.0, -2.0], "std": [0.5, 2.0, 1.0], "q01": [0.0, -4.0, -4.0], "q99": [2.0, 4.0, 0.0]},
}
OTHER_STATS = {f: {k: [v + 7.0 for v in vals] for k, vals in s.items()} for f, s in STATS.items()}


def tiny_cfg(**overrides) -> PolicyConfig:
    base = dict(preset="pi05_tiny", chunk_size=10, n_action_steps=8, max_state_dim=8, max_action_dim=8,
                image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False)
    return PolicyConfig(**{**base, **overrides})


def make_batch(batch_size=2, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "images": torch.rand(batch_size, 1, 3, 32, 32, generator=g),
        "image_masks": torch.ones(batch_size, 1, dtype=torch.bool),
        "state": torch.randn(batch_size, 4, generator=g),
        "actions": torch.randn(batch_size, 10, 3, generator=g),
        "action_is_pad": torch.zeros(batch_size, 10, dtype=torch.bool),
        "task": ["pick up the cube"] * batch_size,
    }


def trained_policy(policy_type: str):
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg(type=policy_type), stats=STATS)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the init values
    return policy


def outputs(policy) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    noise, time = torch.randn(2, 10, 8, generator=g), torch.rand(2, generator=g)
    with torch.no_grad():
        loss = policy(make_batch(), noise=noise, time=time)["loss"]
    return loss, policy.sample_actions(make_batch(), noise=noise)


@pytest.mark.parametrize("layout,policy_type", [(OPENPI, "pi05"), (LEROBOT, "pi05"), (OPENTAU, "pi05"), (NATIVE, "pi05"),
                                                (LEROBOT, "pi0"), (OPENPI, "pi0")])
def test_ours_to_a_published_layout_and_back_gives_identical_tensors_and_outputs(tmp_path, layout, policy_type):
    policy = trained_policy(policy_type)
    if layout == NATIVE:
        save_file(policy.state_dict(), str(tmp_path / "model.safetensors"))
    else:
        write_published(policy, tmp_path, layout)
    torch.manual_seed(123)
    fresh = build_policy(tiny_cfg(type=policy_type), stats=OTHER_STATS)  # other weights, other (dataset) statistics
    report = load_pretrained(fresh, tmp_path, dataset_stats=OTHER_STATS)

    assert report.layout == Layout(layout, policy_type) and report.clean
    assert report.stats_source.startswith("from the checkpoint") and "from the dataset" not in report.stats_source
    for name, tensor in policy.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    loss, actions = outputs(policy)
    fresh_loss, fresh_actions = outputs(fresh)
    assert torch.equal(fresh_loss, loss) and torch.equal(fresh_actions, actions)
    if layout in (OPENPI, LEROBOT):  # neither writes embed_tokens: restored from the tied lm_head
        assert "vlm.language_model.embed_tokens.weight" in report.loaded
        assert report.loaded["vlm.language_model.embed_tokens.weight"].endswith("paligemma.lm_head.weight")
    assert stats_of(fresh, "state") == stats_of(policy, "state")


def test_a_swap_of_two_same_shape_tensors_in_the_name_mapping_fails_the_round_trip(tmp_path, monkeypatch):
    """The fixtures are written from the published layouts, not through opentau's mapping, so a mapping that sends
    SigLIP layer 0's q_proj to k_proj and back (same shape, loads cleanly) is caught by the round trip."""
    from transformers.core_model_loading import WeightRenaming

    original = layouts._renamings
    q, k = r"vision_tower\.encoder\.layers\.0\.self_attn\.q_proj", r"vision_tower\.encoder\.layers\.0\.self_attn\.k_proj"
    swap = [WeightRenaming(q, "vision_tower.encoder.layers.0.self_attn.swapped"),
            WeightRenaming(k, "vision_tower.encoder.layers.0.self_attn.q_proj"),
            WeightRenaming(r"vision_tower\.encoder\.layers\.0\.self_attn\.swapped", "vision_tower.encoder.layers.0.self_attn.k_proj")]
    monkeypatch.setattr(layouts, "_renamings", lambda layout: original(layout) + swap)
    policy = trained_policy("pi05")
    write_published(policy, tmp_path, LEROBOT)
    fresh = build_policy(tiny_cfg())
    report = load_pretrained(fresh, tmp_path, dataset_stats=OTHER_STATS)

    assert report.clean  # the swap is invisible to names and shapes ...
    q_name, k_name = "vlm.vision_tower.encoder.layers.0.self_attn.q_proj.weight", "vlm.vision_tower.encoder.layers.0.self_attn.k_proj.weight"
    assert torch.equal(fresh.state_dict()[q_name], policy.state_dict()[k_name])  # ... but not to the round trip
    mismatched = [n for n, t in policy.state_dict().items() if not torch.equal(fresh.state_dict()[n], t)]
    assert sorted(mismatched) == sorted(n.replace("weight", kind) for n in (q_name, k_name) for kind in ("weight", "bias"))
