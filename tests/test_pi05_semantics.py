"""opentau's pi05 computes what openpi's pi05 computes: each point is checked against its formula written out here
(not against opentau's own helpers), and the joint prefix + suffix forward against a float64 reference of openpi's
per-layer joint attention built from the same weights."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from opentau_cli.config.model import PolicyConfig
from opentau_cli.data import LeRobotDataset, write_synth
from opentau_cli.data.images import resize_with_pad
from opentau_cli.data.normalization import normalize, unnormalize
from opentau_cli.policies import build_policy
from opentau_cli.policies.pi05.modeling import AdaRMS, sample_time, time_embedding

pytestmark = pytest.mark.full

STATS = {
    "state": {"mean": [0.5, -1.0, 2.0, 0.0], "std": [2.0, 0.5, 1.0, 3.0], "q01": [-1.5, -2.0, 0.0, -6.0], "q99": [2.5, 0.0, 4.0, 6.0]},
    "action": {"mean": [1.0, 0.0, -2.0], "std": [0.5, 2.0, 1.0], "q01": [0.0, -4.0, -4.0], "q99": [2.0, 4.0, 0.0]},
}
CHUNK, MAX_DIM = 10, 8


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest.one_thread says why)."""


def tiny_cfg(**overrides) -> PolicyConfig:
    base = dict(preset="pi05_tiny", chunk_size=CHUNK, n_action_steps=CHUNK, max_state_dim=MAX_DIM, max_action_dim=MAX_DIM,
                image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False)
    return PolicyConfig(**{**base, **overrides})


def perturbed_policy(policy_type="pi05", **overrides):
    """A tiny policy whose every weight is away from its init (adaRMS and norms start at zero, gates at one)."""
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg(type=policy_type, **overrides), stats=STATS)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return policy.eval()


def make_batch(batch_size=3, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {
        "images": torch.rand(batch_size, 2, 3, 32, 32, generator=g),
        "image_masks": torch.ones(batch_size, 2, dtype=torch.bool),
        "state": torch.randn(batch_size, 4, generator=g) * 2,
        "actions": torch.randn(batch_size, CHUNK, 3, generator=g),
        "action_is_pad": torch.zeros(batch_size, CHUNK, dtype=torch.bool),
        "task": ["pick up the cube", "open_the drawer", "stack\nthe blocks"][:batch_size],
    }
    batch["image_masks"][:, 1] = False
    batch["images"][:, 1] = 0
    batch["action_is_pad"][0, 7:] = True
    return batch


def capture_velocity(policy):
    """Wraps the expert run so a test can read the velocity the loss and the sampler use."""
    seen, run_expert = [], policy._run_expert

    def keep(*args):
        seen.append(run_expert(*args))
        return seen[-1]

    policy._run_expert = keep
    return seen


# ---------------------------------------------------------------------------------------------- normalization
def test_quantile_normalization_maps_q01_q99_onto_minus_one_one_and_inverts_exactly():
    stats = {k: torch.tensor(v, dtype=torch.float64) for k, v in STATS["action"].items()}
    x = torch.randn(5, 3, dtype=torch.float64) * 3
    expected = (x - stats["q01"]) / (stats["q99"] - stats["q01"] + 1e-6) * 2.0 - 1.0
    torch.testing.assert_close(normalize(x, stats, "quantile"), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(unnormalize(expected, stats, "quantile"), x, rtol=0, atol=1e-12)
    ends = normalize(torch.stack([stats["q01"], stats["q99"]]), stats, "quantile")
    torch.testing.assert_close(ends, torch.tensor([[-1.0] * 3, [1.0] * 3], dtype=torch.float64), rtol=0, atol=1e-6)
    # pi0 keeps openpi's z-score, std + 1e-6.
    torch.testing.assert_close(normalize(x, stats, "mean_std"), (x - stats["mean"]) / (stats["std"] + 1e-6), rtol=0, atol=1e-12)
    torch.testing.assert_close(unnormalize(normalize(x, stats, "mean_std"), stats, "mean_std"), x, rtol=0, atol=1e-12)


def test_pi05_normalizes_with_quantiles_and_pi0_with_mean_std():
    batch = make_batch()
    for policy_type, formula in (
        ("pi05", lambda x, s: (x - s["q01"]) / (s["q99"] - s["q01"] + 1e-6) * 2 - 1),
        ("pi0", lambda x, s: (x - s["mean"]) / (s["std"] + 1e-6)),
    ):
        policy = build_policy(tiny_cfg(type=policy_type), stats=STATS)
        inputs = policy._prepare(batch, with_actions=True)
        stats = {key: {k: torch.tensor(v) for k, v in STATS[key].items()} for key in STATS}
        torch.testing.assert_close(inputs["state"][:, :4], formula(batch["state"], stats["state"]))
        torch.testing.assert_close(inputs["actions"][..., :3], formula(batch["actions"], stats["action"]))
        assert inputs["state"][:, 4:].abs().sum() == 0 and inputs["actions"][..., 3:].abs().sum() == 0  # padded after


def test_pi05_statistics_without_quantiles_are_refused():
    from opentau_cli.errors import UserError

    moments_only = {key: {k: STATS[key][k] for k in ("mean", "std")} for key in STATS}
    with pytest.raises(UserError, match="state statistics lack q01/q99, which pi05's quantile normalization needs"):
        build_policy(tiny_cfg(), stats=moments_only)
    build_policy(tiny_cfg(type="pi0"), stats=moments_only)  # pi0 reads mean/std only


# ------------------------------------------------------------------------------------------------ prompt
def byte_level_tokenizer(path):
    """A Hugging Face tokenizer that decodes back to exactly the text it was given (one token per byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<bos>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>").save_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def openpi_bins(normalized: np.ndarray) -> np.ndarray:
    return np.digitize(normalized, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1


def test_pi05_prompt_is_openpis_with_the_quantile_state_binned_by_digitize(tmp_path):
    tok = byte_level_tokenizer(tmp_path / "tok")
    policy = build_policy(tiny_cfg(tokenizer_path=tmp_path / "tok", tokenizer_max_length=200), stats=STATS)
    batch = make_batch()
    q01, q99 = np.array(STATS["state"]["q01"], np.float32), np.array(STATS["state"]["q99"], np.float32)
    # Bin edges, values beyond [-1, 1] and a value just under an edge, besides the random states.
    edges = q01 + (np.array([-1.0, 0.5, 1.0, -1.5], np.float32) + 1) / 2 * (q99 - q01 + 1e-6)
    batch["state"][0] = torch.from_numpy(edges)
    inputs = policy._prepare(batch, with_actions=False)
    for row in range(3):
        state = batch["state"][row].numpy()
        bins = openpi_bins((state - q01) / (q99 - q01 + 1e-6) * 2.0 - 1.0)
        task = batch["task"][row].strip().replace("_", " ").replace("\n", " ")
        expected = f"Task: {task}, State: {' '.join(map(str, bins))};\nAction: "
        n = int(inputs["text_valid"][row].sum())
        ids = inputs["input_ids"][row].tolist()
        assert ids[0] == tok.bos_token_id and tok.decode(ids[1:n]) == expected
        assert ids[n:] == [tok.pad_token_id] * (200 - n)
    # At -1, 0.5 and 1 exactly, and below -1: bins 0, 192 and 255, and openpi's -1.
    assert tok.decode(inputs["input_ids"][0].tolist(), skip_special_tokens=True) == "Task: pick up the cube, State: 0 192 255 -1;\nAction: "


def test_pi0_prompt_is_the_task_and_a_newline_without_the_state(tmp_path):
    tok = byte_level_tokenizer(tmp_path / "tok")
    policy = build_policy(tiny_cfg(type="pi0", tokenizer_path=tmp_path / "tok"), stats=STATS)
    inputs = policy._prepare(make_batch(), with_actions=False)
    n = int(inputs["text_valid"][2].sum())
    assert tok.decode(inputs["input_ids"][2, 1:n].tolist()) == "stack the blocks\n"


def test_an_overlong_prompt_is_truncated_with_a_warning(tmp_path):
    byte_level_tokenizer(tmp_path / "tok")
    policy = build_policy(tiny_cfg(tokenizer_path=tmp_path / "tok", tokenizer_max_length=20), stats=STATS)
    with pytest.warns(UserWarning, match=r"truncated to policy.tokenizer_max_length=20"):
        inputs = policy._prepare(make_batch(), with_actions=False)
    assert inputs["input_ids"].shape == (3, 20) and bool(inputs["text_valid"].all())


def test_byte_tokenizer_state_ids_follow_openpis_bins_clamped_to_its_256_ids():
    policy = build_policy(tiny_cfg(), stats=STATS)
    batch = make_batch(batch_size=1)
    batch["task"] = [""]
    ids = policy._prepare(batch, with_actions=False)["input_ids"][0, 1:5].numpy()
    q01, q99 = np.array(STATS["state"]["q01"], np.float32), np.array(STATS["state"]["q99"], np.float32)
    bins = openpi_bins((batch["state"][0].numpy() - q01) / (q99 - q01 + 1e-6) * 2.0 - 1.0)
    assert (ids - 259).tolist() == np.clip(bins, 0, 255).tolist()


def carried_as_a_mixture_member(batch: dict, own: dict, policy_stats: dict) -> dict:
    """`batch` as a mixture delivers a narrower member: its rows carried into the policy's (wider) statistics and
    padded, each sample saying its own widths (data/mixture.py)."""
    from opentau_cli.data.mixture import into_policy_space

    size, steps, action_width = batch["actions"].shape
    actions = into_policy_space(batch["actions"].reshape(-1, action_width).numpy(), own["action"], policy_stats["action"], "quantile")
    return {**batch, "state": torch.from_numpy(into_policy_space(batch["state"].numpy(), own["state"], policy_stats["state"], "quantile")),
            "actions": torch.from_numpy(actions).reshape(size, steps, -1),
            "state_dim": torch.full((size,), batch["state"].shape[1]), "action_dim": torch.full((size,), action_width)}


def test_a_narrower_mixture_member_trains_on_the_prompt_and_loss_it_is_served_with_at_its_own_width(tmp_path):
    from opentau_cli.data.mixture import mixture_stats

    tok = byte_level_tokenizer(tmp_path / "tok")
    # The first member (whose statistics the policy holds, widened) has 6 state and 5 action dims; STATS' member 4 and 3.
    wide = {"state": {"mean": [0.0] * 6, "std": [2.0] * 6, "q01": [-5.0, -4.0, -3.0, -2.0, -1.0, 0.0], "q99": [5.0] * 6},
            "action": {"mean": [0.0] * 5, "std": [1.0] * 5, "q01": [-3.0] * 5, "q99": [1.0, 2.0, 3.0, 4.0, 5.0]}}
    trained = perturbed_policy(tokenizer_path=tmp_path / "tok", tokenizer_max_length=200)
    policy_stats = mixture_stats([wide, STATS])
    trained.set_stats(policy_stats)
    served = copy.deepcopy(trained)
    served.set_stats(STATS)  # as export / eval --dataset serve the member: its own statistics and widths
    batch = make_batch()
    mixed = carried_as_a_mixture_member(batch, STATS, policy_stats)
    assert mixed["state"].shape == (3, 6) and mixed["actions"].shape == (3, CHUNK, 5)

    seen, served_inputs = trained._prepare(mixed, with_actions=True), served._prepare(batch, with_actions=True)
    assert torch.equal(seen["input_ids"], served_inputs["input_ids"]) and torch.equal(seen["text_valid"], served_inputs["text_valid"])
    for row in range(3):
        state_tokens = re.search(r"State: ([-0-9 ]+);", tok.decode(seen["input_ids"][row].tolist(), skip_special_tokens=True))
        assert len(state_tokens.group(1).split()) == 4
    torch.testing.assert_close(seen["state"], served_inputs["state"], rtol=0, atol=1e-5)  # padded dims normalize to 0

    noise, time = torch.randn(3, CHUNK, MAX_DIM, generator=torch.Generator().manual_seed(3)), torch.tensor([0.2, 0.5, 0.9])
    loss = trained(mixed, noise=noise, time=time)["mse_loss"]
    torch.testing.assert_close(loss, served(batch, noise=noise, time=time)["mse_loss"], rtol=1e-5, atol=1e-6)
    # Without the widths the member's two padded action dims would be trained toward 0 as well.
    unmasked = {k: v for k, v in mixed.items() if k not in ("state_dim", "action_dim")}
    assert abs(trained(unmasked, noise=noise, time=time)["mse_loss"].item() - loss.item()) > 1e-3


# ------------------------------------------------------------------------------------------------ images
def openpi_resize_with_pad(img: Image.Image, height: int, width: int) -> np.ndarray:
    cur_w, cur_h = img.size
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    canvas = Image.new("RGB", (width, height), 0)
    canvas.paste(img.resize((new_w, new_h), resample=Image.BILINEAR), (int((width - new_w) / 2), int((height - new_h) / 2)))
    return np.asarray(canvas)


@pytest.mark.parametrize("size", [(480, 848), (100, 300), (300, 100), (480, 640), (224, 224), (50, 60)])
def test_images_are_resized_with_black_padding_exactly_as_openpi(size):
    pixels = np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)
    img = Image.fromarray(pixels)
    assert np.array_equal(resize_with_pad(img, 224, 224), openpi_resize_with_pad(img, 224, 224))


def test_pixels_reach_siglip_in_minus_one_one_and_a_missing_camera_is_black_and_masked(tmp_path):
    root = write_synth(tmp_path / "synth", episodes=2, steps_per_episode=4, cameras=1)
    sample = LeRobotDataset(root, [0], chunk_size=CHUNK, image_resolution=(32, 32), num_cameras=3)[0]
    batch = {k: (v[None] if isinstance(v, torch.Tensor) else [v]) for k, v in sample.items()}
    inputs = build_policy(tiny_cfg(), stats=STATS)._prepare(batch, with_actions=True)
    # The sample's uint8 pixels (the batch format) scaled as the host scaled them when images travelled as float32.
    assert sample["images"].dtype == torch.uint8
    unit = torch.from_numpy(sample["images"].numpy().astype(np.float32) * np.float32(1 / 255))
    assert torch.equal(inputs["images"], unit[None] * 2 - 1)
    assert inputs["images"].min() >= -1 and inputs["images"].max() <= 1
    assert inputs["image_masks"].tolist() == [[True, False, False]]
    assert bool((inputs["images"][0, 1:] == -1).all())  # openpi's zero uint8 image in [-1, 1]


# ------------------------------------------------------------------------------- flow matching and sampling
def test_time_is_drawn_from_beta_1_5_1_scaled_into_0_001_1():
    torch.manual_seed(0)
    t = sample_time(200_000, "cpu").double()
    assert t.min() >= 0.001 and t.max() <= 1.0
    u = (t - 0.001) / 0.999
    # Beta(1.5, 1): mean 0.6, CDF u^1.5.
    assert abs(u.mean().item() - 0.6) < 3e-3
    for q in (0.1, 0.5, 0.9):
        assert abs((u <= q).double().mean().item() - q**1.5) < 3e-3


def test_the_loss_regresses_noise_minus_actions_at_t_noise_plus_1_minus_t_actions():
    policy = perturbed_policy()
    batch = make_batch()
    noise, time = torch.randn(3, CHUNK, MAX_DIM), torch.tensor([0.2, 0.5, 0.9])
    suffix_inputs, embed_suffix = [], policy._embed_suffix
    policy._embed_suffix = lambda state, noisy, t: (suffix_inputs.append((noisy, t)), embed_suffix(state, noisy, t))[1]
    velocity = capture_velocity(policy)
    loss = policy(batch, noise=noise, time=time)["mse_loss"]
    q01, q99 = torch.tensor(STATS["action"]["q01"]), torch.tensor(STATS["action"]["q99"])
    actions = F.pad((batch["actions"] - q01) / (q99 - q01 + 1e-6) * 2 - 1, (0, MAX_DIM - 3))
    torch.testing.assert_close(suffix_inputs[0][0], time[:, None, None] * noise + (1 - time[:, None, None]) * actions)
    valid = (~batch["action_is_pad"])[..., None] & (torch.arange(MAX_DIM) < 3)
    expected = ((velocity[0] - (noise - actions)) ** 2)[valid.expand_as(noise)].mean()
    torch.testing.assert_close(loss, expected)


def test_sampling_takes_ten_euler_steps_from_t_1_towards_t_0_and_unnormalizes():
    policy = build_policy(tiny_cfg(n_action_steps=6), stats=STATS)
    constant = torch.randn(3, CHUNK, MAX_DIM)
    times = []
    policy._embed_suffix = lambda state, noisy, t: (times.append(t[0].item()), (None, None, None))[1]
    policy._run_expert = lambda *args: constant
    noise = torch.randn(3, CHUNK, MAX_DIM)
    actions = policy.sample_actions(make_batch(), noise=noise)
    np.testing.assert_allclose(times, [1.0 - 0.1 * k for k in range(10)], atol=1e-6)
    x0 = (noise - constant)[:, :6, :3]  # x_{t-dt} = x_t - 0.1 * v, ten times
    q01, q99 = torch.tensor(STATS["action"]["q01"]), torch.tensor(STATS["action"]["q99"])
    torch.testing.assert_close(actions, (x0 + 1) / 2 * (q99 - q01 + 1e-6) + q01, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------- adaRMS and time embedding
def test_adarms_modulates_with_scale_shift_gate_chunks_in_that_order():
    torch.manual_seed(0)
    norm = AdaRMS(16, 8)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x, cond = torch.randn(2, 5, 16, dtype=torch.float64).float(), torch.randn(2, 8)
    out, gate = norm(x, cond)
    modulation = (cond.double() @ norm.weight.double().T + norm.bias.double())[:, None, :]
    scale, shift, expected_gate = modulation[..., :16], modulation[..., 16:32], modulation[..., 32:]
    normed = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), normed * (1 + scale) + shift, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gate.double(), expected_gate, rtol=1e-5, atol=1e-5)


def test_every_expert_norm_including_the_final_one_holds_3_x_width_rows_as_published():
    with torch.device("meta"):
        policy = build_policy(PolicyConfig(preset="pi05"))
    shapes = {n: tuple(p.shape) for n, p in policy.named_parameters() if n.startswith("expert.") and "norm" in n}
    assert len(shapes) == 2 * (18 * 2 + 1)
    for name, shape in shapes.items():
        assert shape == ((3072, 1024) if name.endswith("weight") else (3072,)), name


def test_time_embedding_is_openpis_sine_cosine_in_float64():
    t = torch.tensor([0.001, 0.37, 0.999, 1.0])
    fraction = np.linspace(0.0, 1.0, 64 // 2)
    period = 4e-3 * (4.0 / 4e-3) ** fraction
    angle = 2 * np.pi / period[None, :] * t.double().numpy()[:, None]
    expected = torch.from_numpy(np.concatenate([np.sin(angle), np.cos(angle)], axis=1)).float()
    got = time_embedding(t, 64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
    # The fastest sines are far off when the angle is formed in float32: the tolerance above tells them apart.
    angle32 = (2 * np.pi / period[None, :]).astype(np.float32) * t.numpy()[:, None]
    assert np.abs(np.sin(angle32) - expected[:, :32].numpy()).max() > 1e-5


def test_the_adarms_condition_is_swish_mlp_of_the_time_embedding():
    policy = perturbed_policy()
    emb = policy.embed_suffix
    t = torch.tensor([0.3, 0.8])
    _, cond = emb(torch.randn(2, CHUNK, MAX_DIM), t)
    hidden = F.silu(time_embedding(t, emb.width) @ emb.time_mlp_in.weight.T + emb.time_mlp_in.bias)
    torch.testing.assert_close(cond, F.silu(hidden @ emb.time_mlp_out.weight.T + emb.time_mlp_out.bias))


# ----------------------------------------------------------------------------------------------- precision
def test_the_fp32_set_is_openpis_embeddings_norms_and_action_time_projections():
    for policy_type in ("pi05", "pi0"):
        policy = build_policy(tiny_cfg(type=policy_type))
        expected = {f"{name}.{p}" for name, m in policy.named_modules() if isinstance(m, (GemmaRMSNorm, AdaRMS)) for p, _ in m.named_parameters()}
        expected |= {n for n, _ in policy.named_parameters()
                     if re.match(r"vlm\.vision_tower\.embeddings\.(patch|position)_embedding\.|embed_suffix\.|action_out_proj\.", n)}
        assert set(policy.fp32_parameter_names()) == expected
        policy.cast_weights(torch.bfloat16)
        dtypes = {n: p.dtype for n, p in policy.named_parameters()}
        assert {n for n, d in dtypes.items() if d == torch.float32} == expected
        assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in expected)
        assert policy.action_q99.dtype == torch.float32  # statistics untouched


def test_the_fp32_set_computes_in_fp32_under_bf16_autocast():
    policy = perturbed_policy()
    batch = make_batch()
    pixels = batch["images"][:, 0] * 2 - 1
    x, cond = torch.randn(3, CHUNK, 64), torch.randn(3, 64)
    modules = {
        "patch embedding": (policy.vlm.vision_tower.embeddings.patch_embedding, (pixels,)),
        "adaRMS": (policy.expert.layers[0].input_layernorm, (x, cond)),
        "action in": (policy.embed_suffix.action_in_proj, (torch.randn(3, CHUNK, MAX_DIM),)),
        "action out": (policy.action_out_proj, (x,)),
    }
    for name, (module, args) in modules.items():
        plain = module(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = module(*args)
        for a, b in zip(plain if isinstance(plain, tuple) else (plain,), mixed if isinstance(mixed, tuple) else (mixed,)):
            assert b.dtype == torch.float32 and torch.equal(a, b), name
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the rest does run in bf16 there
        assert policy.expert.layers[0].mlp.up_proj(x).dtype == torch.bfloat16


def test_bf16_layout_and_bf16_autocast_compute_close_to_fp32():
    policy = perturbed_policy()
    batch, noise, time = make_batch(), torch.randn(3, CHUNK, MAX_DIM), torch.tensor([0.2, 0.5, 0.9])
    reference = policy(batch, noise=noise, time=time)["mse_loss"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = policy(batch, noise=noise, time=time)["mse_loss"]
    mixed = copy.deepcopy(policy).cast_weights(torch.bfloat16)(batch, noise=noise, time=time)["mse_loss"]
    for loss in (autocast, mixed):
        assert loss.dtype == torch.float32 and abs(loss.item() - reference.item()) < 0.03 * reference.item()


# ------------------------------------------------------------------------------------------------- stats
def test_quantiles_come_from_stats_json_for_every_episode_and_from_the_frames_of_a_subset(tmp_path):
    root = write_synth(tmp_path / "synth", episodes=4, steps_per_episode=12, cameras=1)
    stats_file = root / "meta" / "stats.json"
    stats = json.loads(stats_file.read_text())
    stats["action"]["q01"] = [-7.0, -7.0]  # marked, so the test sees where the numbers came from
    stats_file.write_text(json.dumps(stats))
    kw = dict(chunk_size=4, image_resolution=(16, 16), num_cameras=1)
    assert LeRobotDataset(root, **kw).stats["action"]["q01"] == [-7.0, -7.0]
    subset = LeRobotDataset(root, [1, 3], **kw)
    actions = np.concatenate([subset[i]["actions"][:1].numpy() for i in range(len(subset))])
    np.testing.assert_allclose(subset.stats["action"]["q01"], np.quantile(actions.astype(np.float64), 0.01, axis=0), atol=1e-6)
    np.testing.assert_allclose(subset.stats["action"]["q99"], np.quantile(actions.astype(np.float64), 0.99, axis=0), atol=1e-6)


def test_quantiles_are_computed_when_the_meta_files_have_none(tmp_path):
    root = write_synth(tmp_path / "synth", episodes=3, steps_per_episode=12, cameras=1)
    copy_root = shutil.copytree(root, tmp_path / "plain")
    stats = json.loads((copy_root / "meta" / "stats.json").read_text())
    for feature in stats.values():
        feature.pop("q01"), feature.pop("q99")
    (copy_root / "meta" / "stats.json").write_text(json.dumps(stats))
    kw = dict(chunk_size=4, image_resolution=(16, 16), num_cameras=1)
    np.testing.assert_allclose(LeRobotDataset(copy_root, **kw).stats["state"]["q99"], LeRobotDataset(root, **kw).stats["state"]["q99"], atol=1e-6)


# ------------------------------------------------------------------------------------ the joint forward
def rms(x, eps=1e-6):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps)


def linear(layer, x):
    return x @ layer.weight.T + layer.bias


def rope(x, positions, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = positions[..., None].double() * inv_freq
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_velocity(policy, batch, noisy, time):
    """openpi's pi05 / pi0 joint forward in float64: prefix and suffix concatenated in every layer, one attention over
    both with the block mask (prefix bidirectional, suffix after it), positions = cumsum(valid) - 1."""
    m = copy.deepcopy(policy).double()
    m.vlm.vision_tower.embeddings.patch_embedding.__class__ = torch.nn.Conv2d  # transformers' own module, in float64
    pi05 = policy.cfg.type == "pi05"
    vlm, expert = m.vlm.language_model, m.expert
    heads, head_dim = vlm.config.num_attention_heads, vlm.config.head_dim
    inputs = policy._prepare(batch, with_actions=False)  # token ids and pad masks (the prompt has its own tests)
    batch_size, cams = batch["images"].shape[:2]

    pixels = (batch["images"].double() * 2 - 1).flatten(0, 1)
    image = m.vlm.multi_modal_projector(m.vlm.vision_tower(pixels).last_hidden_state)  # transformers' SigLIP forward
    image = image.reshape(batch_size, -1, image.shape[-1])
    text = vlm.embed_tokens.weight[inputs["input_ids"]] * math.sqrt(vlm.config.hidden_size)
    prefix = torch.cat([image, text], 1)
    prefix_valid = torch.cat([batch["image_masks"].repeat_interleave(image.shape[1] // cams, 1), inputs["text_valid"]], 1)

    emb = m.embed_suffix
    fraction = torch.linspace(0, 1, emb.width // 2, dtype=torch.float64)
    angle = 2 * math.pi / (4e-3 * (4.0 / 4e-3) ** fraction)[None] * time.double()[:, None]
    t_emb = torch.cat([angle.sin(), angle.cos()], 1)
    actions = linear(emb.action_in_proj, noisy.double())
    if pi05:
        cond = F.silu(linear(emb.time_mlp_out, F.silu(linear(emb.time_mlp_in, t_emb))))
        suffix, suffix_ar = actions, [1] + [0] * (CHUNK - 1)
    else:
        fused = linear(emb.action_time_mlp_out, F.silu(linear(emb.action_time_mlp_in, torch.cat([actions, t_emb[:, None].expand_as(actions)], -1))))
        suffix, suffix_ar = torch.cat([linear(emb.state_proj, inputs["state"].double())[:, None], fused], 1), [1, 1] + [0] * (CHUNK - 1)

    valid = torch.cat([prefix_valid, torch.ones(batch_size, suffix.shape[1], dtype=torch.bool)], 1)
    block = torch.tensor([0] * prefix.shape[1] + suffix_ar).cumsum(0)
    allowed = (block[None, :] <= block[:, None])[None] & valid[:, None, :] & valid[:, :, None]
    positions = valid.long().cumsum(1) - 1

    def norm(module, x):
        if isinstance(module, AdaRMS):
            modulation = (cond @ module.weight.T + module.bias)[:, None]
            scale, shift, gate = modulation.chunk(3, -1)
            return rms(x) * (1 + scale) + shift, gate
        return rms(x) * (1 + module.weight), None

    def mlp(mod, x):
        return mod.down_proj(F.gelu(mod.gate_proj(x), approximate="tanh") * mod.up_proj(x))

    hidden, split = [prefix, suffix], prefix.shape[1]
    for vlm_layer, expert_layer in zip(vlm.layers, expert.layers):
        layers = (vlm_layer, expert_layer)
        normed, gates = zip(*(norm(layer.input_layernorm, h) for layer, h in zip(layers, hidden)))
        q, k, v = (torch.cat([getattr(layer.self_attn, f"{name}_proj")(x) for layer, x in zip(layers, normed)], 1)
                   .unflatten(-1, (-1, head_dim)).transpose(1, 2) for name in "qkv")
        q, k = rope(q, positions, head_dim), rope(k, positions, head_dim)
        scores = q @ k.transpose(-1, -2).expand(-1, heads, -1, -1) / math.sqrt(head_dim)
        probs = scores.masked_fill(~allowed[:, None], -1e30).softmax(-1)
        out = (probs @ v.expand(-1, heads, -1, -1)).transpose(1, 2).flatten(2)
        new = []
        for layer, h, o, gate in zip(layers, hidden, (out[:, :split], out[:, split:]), gates):
            h = h + layer.self_attn.o_proj(o) * (1 if gate is None else gate)
            x, gate = norm(layer.post_attention_layernorm, h)
            new.append(h + mlp(layer.mlp, x) * (1 if gate is None else gate))
        hidden = new
    final, _ = norm(expert.norm, hidden[1])
    return linear(m.action_out_proj, final[:, -CHUNK:])


@pytest.mark.parametrize("policy_type", ["pi05", "pi0"])
def test_the_joint_prefix_suffix_forward_matches_a_float64_reference_of_openpis(policy_type):
    policy = perturbed_policy(policy_type)
    batch, noise, time = make_batch(), torch.randn(3, CHUNK, MAX_DIM), torch.tensor([0.15, 0.5, 0.95])
    velocity = capture_velocity(policy)
    policy(batch, noise=noise, time=time)
    noisy = time[:, None, None] * noise + (1 - time[:, None, None]) * policy._prepare(batch, with_actions=True)["actions"]
    expected = reference_velocity(policy, batch, noisy, time)
    assert expected.abs().mean() > 0.1  # a real signal, not a vanishing one
    torch.testing.assert_close(velocity[0].double(), expected, rtol=1e-4, atol=2e-5)

    # Sampling reads the prefix from its KV cache: its first Euler step uses the same velocity at t = 1.
    policy.cfg.num_inference_steps = 1
    actions = policy.sample_actions(batch, noise=noise)
    expected_x0 = (noise - reference_velocity(policy, batch, noise, torch.ones(3)).float())[:, :, :3]
    torch.testing.assert_close(actions, unnormalize(expected_x0, policy._stats("action"), policy.norm_mode), rtol=1e-4, atol=1e-4)

