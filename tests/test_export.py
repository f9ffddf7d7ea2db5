"""`opentau checkpoint export`: a published layout -> `opentau train` one step at a negligible learning rate under
DeepSpeed ZeRO-3 (so its weights are gathered from the shards) -> export to every layout gives back the original
tensors and statistics of that layout (one launch; loading each layout is tested in-process by
tests/test_pretrained_layouts.py); user mistakes exit 2 in one line, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import EXAMPLES, run_cli
from opentau_cli.cli.main import app
from opentau_cli.config.load import load_config
from opentau_cli.data import build_data
from opentau_cli.policies import build_policy
from opentau_cli.policies.layouts import LEROBOT, LEROBOT_NORMALIZER, OPENPI, OPENTAU
from opentau_cli.store.layout import CHECKPOINTS, LAST, MODEL_WEIGHTS, TRAIN_CONFIG
from published import write_published

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
ZERO3 = str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml")
LAYOUTS = (OPENPI, LEROBOT, OPENTAU)
runner = CliRunner()


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny pi05 with the demo data's statistics, written in each published layout. Every weight is moved off
    zero: one step at lr=1e-30 leaves a non-zero fp32 value exactly as it is, but would turn a 0 into 1e-30."""
    root = tmp_path_factory.mktemp("published")
    cfg = load_config(TINY, [f"--output_dir={root / 'unused'}"])
    torch.manual_seed(5)
    policy = build_policy(cfg.policy, build_data(cfg).stats)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param).abs().add_(0.01) * 0.01)
    return {layout: write_published(policy, root / layout, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def round_trips(published, tmp_path_factory):
    """layout -> (the run trained from the LeRobot layout under ZeRO-3, the export of its last checkpoint in layout)."""
    root = tmp_path_factory.mktemp("round_trip")
    run = root / "run"
    made = {}

    def get(layout: str):
        if not run.exists():
            args = ["train", f"--config_path={TINY}", f"--output_dir={run}", f"--policy.pretrained_path={published[LEROBOT]}",
                    "--steps=1", "--save_freq=1", "--optimizer.lr=1e-30", "--validation.val_freq=0",
                    f"--accelerate-config={ZERO3}", "--batch_size=4"]
            trained = run_cli(args, env={"HF_HOME": str(root / "hf_home")})
            assert trained.returncode == 0, trained.stderr[-3000:]
        if layout not in made:
            out = root / f"export_{layout}"
            exported = run_cli(["checkpoint", "export", str(run), "--output", str(out), "--layout", layout])
            assert exported.returncode == 0, exported.stderr[-3000:]
            made[layout] = run, out
        return made[layout]

    return get


def _stats_files(directory: Path, layout: str) -> dict:
    """The statistics as each layout stores them, by their own names."""
    if layout == OPENPI:
        (file,) = directory.glob("assets/*/norm_stats.json")
        return json.loads(file.read_text())["norm_stats"]
    if layout == LEROBOT:
        flat = load_file(str(directory / LEROBOT_NORMALIZER))
        return {k: v for k, v in flat.items() if k.startswith(("observation.state.", "action."))}
    weights = load_file(str(directory / MODEL_WEIGHTS))
    return {k: v for k, v in weights.items() if "normalize" in k}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_published_model_trained_one_step_at_lr_1e_30_exports_to_each_layout_as_its_original_tensors(published, round_trips, layout):
    run, out = round_trips(layout)
    original = load_file(str(published[layout] / MODEL_WEIGHTS))
    exported = load_file(str(out / MODEL_WEIGHTS))
    # OpenTau's discrete-action head is its own (opentau never loads it), so an export cannot give it back.
    original = {k: v for k, v in original.items() if "discrete_action_embedding" not in k}
    if layout in (OPENPI, LEROBOT):  # their strict loaders require the expert's output head, never read: zeros
        prefix = "model." if layout == LEROBOT else ""
        head = exported.pop(f"{prefix}paligemma_with_expert.gemma_expert.lm_head.weight")
        vocab = original[f"{prefix}paligemma_with_expert.paligemma.lm_head.weight"].shape[0]
        width = original[f"{prefix}paligemma_with_expert.gemma_expert.model.layers.0.mlp.down_proj.weight"].shape[0]
        assert head.shape == (vocab, width) and head.dtype == torch.float32 and not head.any()
    assert sorted(exported) == sorted(original)
    different = [k for k in original if exported[k].dtype != original[k].dtype or not torch.equal(exported[k], original[k])]
    assert different == []
    theirs, ours = _stats_files(published[layout], layout), _stats_files(out, layout)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        if isinstance(theirs[key], dict):  # openpi: {"mean": [...], ...} per key
            assert ours[key] == theirs[key], key
        else:
            assert torch.equal(ours[key], theirs[key]), key
    config = json.loads((out / "config.json").read_text())
    assert (config.get("type") or ("pi05" if config["pi05"] else "pi0")) == "pi05"
    assert config.get("chunk_size", config.get("action_horizon")) == 10
    # Which weights of which step: in the weights' metadata, and in config.json where the layout's loader ignores
    # unknown keys (LeRobot's config parser refuses them). The run keeps no EMA: its live weights.
    with safe_open(str(out / MODEL_WEIGHTS), framework="pt") as f:
        assert (f.metadata()["weights"], f.metadata()["step"]) == ("live", "1")
    assert config.get("opentau") == (None if layout == LEROBOT else {"weights": "live", "step": 1})


def test_the_openpi_export_lists_the_cameras_and_state_it_was_trained_on_for_serve(round_trips):
    _, out = round_trips(OPENPI)
    assert json.loads((out / "config.json").read_text())["input_features"] == {
        "observation.images.top": {"type": "VISUAL", "shape": [3, 32, 32]}, "observation.state": {"type": "STATE", "shape": [4]}}


def test_the_lerobot_export_declares_every_camera_and_lerobots_pi05_prompt_steps(round_trips):
    """What LeRobot 0.4.4's pi05 reads: its image inputs come from config.input_features' VISUAL entries, and its
    preprocessor bins the normalized state into the prompt (after padding it to max_state_dim, so max_state_dim is
    the real width: openpi bins the real dims only) and tokenizes it with PaliGemma's tokenizer."""
    _, out = round_trips(LEROBOT)
    config = json.loads((out / "config.json").read_text())
    assert config["input_features"] == {"observation.images.top": {"type": "VISUAL", "shape": [3, 32, 32]},
                                        "observation.state": {"type": "STATE", "shape": [4]}}
    assert config["output_features"] == {"action": {"type": "ACTION", "shape": [2]}} and config["max_state_dim"] == 4
    steps = json.loads((out / "policy_preprocessor.json").read_text())["steps"]
    assert [s["registry_name"] for s in steps] == ["rename_observations_processor", "to_batch_processor", "normalizer_processor",
                                                   "pi05_prepare_state_tokenizer_processor_step", "tokenizer_processor",
                                                   "device_processor"]
    assert steps[3]["config"] == {"max_state_dim": 4, "task_key": "task"}
    assert steps[4]["config"] == {"max_length": 48, "task_key": "task", "padding_side": "right", "padding": "max_length",
                                  "truncation": True, "tokenizer_name": "google/paligemma-3b-pt-224"}
    assert steps[2]["config"]["features"]["observation.images.top"]["type"] == "VISUAL"


def test_lerobots_own_loaders_read_the_lerobot_export_as_opentau_acts(round_trips, tmp_path):
    """LeRobot 0.4.4's own code (its venv: scripts/peer_envs.sh) reads the export's config.json (every camera an image
    feature) and its processor files: its preprocessor normalizes the state and bins it into the prompt as opentau
    does, and its postprocessor un-normalizes an action chunk as opentau does (LeRobot's quantile normalization has no
    1e-6 epsilon: equal up to what that epsilon makes). Its pi05 model runs in tests/test_peer_models.py: it needs
    openpi's transformers_replace files, which no package registry holds."""
    import subprocess

    import numpy as np

    from opentau_cli.data.build import make_dataset
    from opentau_cli.data.mixture import select_member
    from opentau_cli.data.normalization import QUANTILE, normalize, unnormalize
    from opentau_cli.data.synth import resolve_dataset_root
    from opentau_cli.policies.pi05.tokenization import clean_task, state_bins
    from opentau_cli.tools.export import open_saved_policy, statistics
    from peer_envs import peer_python

    python = peer_python("lerobot", "0.4.4")
    run, out = round_trips(LEROBOT)
    saved = open_saved_policy(run)
    member = select_member(saved.config, None)
    sample = make_dataset(saved.config, member, resolve_dataset_root(member.root), [0])[3]
    stats = {feature: {k: torch.tensor(v) for k, v in values.items()} for feature, values in statistics(saved).items()}
    normalized_actions = torch.linspace(-1.2, 1.2, 20).reshape(1, 10, 2)
    given = tmp_path / "in.npz"
    np.savez(given, image=sample["images"][0].numpy(), state=sample["state"].numpy(), task=np.array(sample["task"]),
             normalized_actions=normalized_actions.numpy())
    result = tmp_path / "out.json"
    proc = subprocess.run([python, str(Path(__file__).parent / "lerobot_processor_driver.py"), str(out), str(given), str(result)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(result.read_text())

    assert got["image_features"] == ["observation.images.top"]
    assert got["input_features"] == {"observation.images.top": ["VISUAL", [3, 32, 32]], "observation.state": ["STATE", [4]]}
    assert got["output_features"] == {"action": ["ACTION", [2]]} and got["max_state_dim"] == 4
    assert {"observation.language.tokens", "observation.language.attention_mask"} <= set(got["processed_keys"])

    ours = normalize(sample["state"][None], stats["state"], QUANTILE)
    # LeRobot divides by q99 - q01, openpi and opentau by q99 - q01 + 1e-6: apart by up to 2e-6 / (q99 - q01).
    spread = (stats["state"]["q99"] - stats["state"]["q01"]).min()
    assert torch.allclose(torch.tensor(got["normalized_state"]), ours, atol=1e-5 + 2e-6 / spread.item(), rtol=0)
    (prompt,) = got["prompt"]
    task, state = prompt.removeprefix("Task: ").removesuffix(";\nAction: ").split(", State: ")
    assert task == clean_task(sample["task"])
    assert tuple(int(b) for b in state.split()) == state_bins(ours)[0]
    expected = unnormalize(normalized_actions, stats["action"], QUANTILE)
    assert torch.allclose(torch.tensor(got["actions"]), expected, atol=1e-5, rtol=0)


def test_serve_reads_the_zero3_shards_and_acts_as_the_export_does(round_trips):
    """`opentau serve`'s loader on the DeepSpeed checkpoint (shards through the streaming reader) and on its LeRobot
    export: the same chunk for the same observation and seed."""
    import numpy as np

    from opentau_cli.tools.serve import load_served

    run, out = round_trips(LEROBOT)
    obs = {"observation.images.top": np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8),
           "observation.state": np.array([0.5, 0.4, 0.0, 0.01], np.float32), "prompt": "Move the blue dot to the red target."}
    from_shards, from_export = load_served(run), load_served(out)
    assert from_shards.metadata()["observation_keys"] == from_export.metadata()["observation_keys"]
    assert np.array_equal(from_shards.infer(obs)["actions"], from_export.infer(obs)["actions"])


def test_a_zero3_run_exports_from_its_deepspeed_shards(round_trips):
    run, _ = round_trips(LEROBOT)
    last = run / CHECKPOINTS / LAST
    assert not (last / MODEL_WEIGHTS).exists() and list(last.rglob("*_optim_states.pt"))


def test_bf16_export_keeps_openpis_fp32_set_in_fp32_and_the_rest_in_bf16(round_trips, tmp_path):
    run, _ = round_trips(OPENPI)
    result = runner.invoke(app, ["checkpoint", "export", str(run), "--output", str(tmp_path / "bf16"), "--layout", "openpi", "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    weights = load_file(str(tmp_path / "bf16" / MODEL_WEIGHTS))
    assert weights["time_mlp_in.weight"].dtype == torch.float32
    assert weights["paligemma_with_expert.gemma_expert.model.norm.dense.weight"].dtype == torch.float32
    assert weights["paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["precision"] == "bfloat16"


def _refused(result, *needles) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_export_mistakes_exit_2_in_one_line_and_write_nothing(round_trips, published, tmp_path):
    run, _ = round_trips(OPENPI)
    out = tmp_path / "out"
    _refused(runner.invoke(app, ["checkpoint", "export", str(tmp_path / "nope"), "--output", str(out)]), "does not exist")
    _refused(runner.invoke(app, ["checkpoint", "export", str(run), "--output", str(out), "--layout", "native"]), "--layout must be one of")
    _refused(runner.invoke(app, ["checkpoint", "export", str(run), "--output", str(out), "--dtype", "fp8"]), "--dtype must be one of")
    _refused(runner.invoke(app, ["checkpoint", "export", str(published[OPENPI]), "--output", str(out)]), "No checkpoint found")
    assert not out.exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    _refused(runner.invoke(app, ["checkpoint", "export", str(run), "--output", str(used)]), "already exists and is not empty")
    assert [p.name for p in used.iterdir()] == ["keep.txt"] and (used / "keep.txt").read_text() == "mine"


def test_a_checkpoint_whose_config_names_another_preset_is_refused(round_trips, tmp_path):
    run, _ = round_trips(OPENPI)
    ckpt = tmp_path / "run" / CHECKPOINTS / "000001"
    shutil.copytree((run / CHECKPOINTS / LAST).resolve(), ckpt)
    config = json.loads((ckpt / TRAIN_CONFIG).read_text())
    config["policy"]["preset"] = "pi05_small"
    (ckpt / TRAIN_CONFIG).write_text(json.dumps(config))
    out = tmp_path / "out"
    _refused(runner.invoke(app, ["checkpoint", "export", str(ckpt), "--output", str(out)]), "do not fit the pi05_small policy")
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
