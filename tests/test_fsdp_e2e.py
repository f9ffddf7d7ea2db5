"""FSDP2 end to end through the installed CLI on 2 CPU processes over gloo (docs/ARCHITECTURE.md, "FSDP2"): an
Accelerate FSDP YAML (fsdp_version: 2) trains pi05_tiny with fully_shard per transformer layer and at the root, bf16
compute with fp32 master parameters and gradient checkpointing; checkpoints are DCP shards per rank inside the usual
atomic publish; a resume continues with == losses; the consolidated model equals torch's own dcp_to_torch_save; in
fp32 it trains as DDP does.

Launches are shared (module-scoped): the bf16 run, the same run preempted by SIGTERM and resumed, and one fp32 run
of FSDP2 compared with the session's DDP run (conftest.ddp_reference). The bf16 run carries the rest of the recipe: an
EMA kept sharded like the parameters, asynchronous saves, a mixture of two datasets and TensorBoard; the resume's ==
losses and == EMA cover their exact resume.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    DDP_REFERENCE_SAVE, DDP_REFERENCE_STEPS, EXAMPLES, REFERENCE_WARMUP, REPO, opentau_bin, own_cache, refused,
    run_cli, run_cli_in_process, tree,
)
from opentau_cli.store.layout import CHECKPOINTS, METRICS, TRAINING_STATE

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow]

TINY = EXAMPLES / "pi05_tiny_config.json"
FSDP2 = REPO / "configs" / "examples" / "accelerate_cpu_fsdp2_config.yaml"
DDP = EXAMPLES / "accelerate_cpu_ddp_config.yaml"
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
STEPS, SAVE = 6, 3
COMMON = ["--config_path", str(TINY), "--steps", str(STEPS), "--save_freq", str(SAVE), "--log_freq", "1",
          "--batch_size", "4", "--scheduler.warmup_steps", "1"]
DECAY = 0.75  # the EMA's decay: far from 1, so that a few steps move it


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


def env_for(home: Path) -> dict:
    # This module's own demo data (runs compared with each other read the same), no user Accelerate default.
    return {"HF_HOME": str(home / "hf_home"), "OPENTAU_CACHE_DIR": own_cache(home / "cache"), "HF_HUB_OFFLINE": "1"}


BF16 = [f"--accelerate-config={FSDP2}", "--policy.gradient_checkpointing=true", "--validation.val_freq=3",
        "--validation.max_batches=1", f"--ema.decay={DECAY}", "--checkpoint.async_save=true", "--logging.tensorboard=true",
        "--dataset.num_cameras=2", "--validation.val_split=0.25"]


@pytest.fixture(scope="module")
def bf16_args(home) -> list[str]:
    """BF16 over a mixture of two datasets (3:1) of this module's own."""
    from opentau_cli.data.synth import write_synth

    first = write_synth(home / "data" / "first", episodes=5, steps_per_episode=6, cameras=1, seed=1)
    second = write_synth(home / "data" / "second", episodes=4, steps_per_episode=6, cameras=2, seed=2)
    members = [{"root": str(first), "weight": 3}, {"root": str(second), "weight": 1, "name": "second"}]
    return [*BF16, f"--dataset.mixture={json.dumps(members)}"]


CONSOLE: dict[str, str] = {}  # what each launch of `train` printed (stdout + stderr), by run name


def train(home: Path, name: str, *args: str) -> Path:
    run = home / name
    result = run_cli(["train", *COMMON, *args, f"--output_dir={run}"], env=env_for(home))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    CONSOLE[name] = result.stdout + result.stderr
    return run


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


@pytest.fixture(scope="module")
def bf16_run(home, bf16_args) -> Path:
    """bf16 FSDP2 with gradient checkpointing, validation, EMA, asynchronous saves, a mixture and TensorBoard:
    checkpoints at steps 3 and 6."""
    return train(home, "bf16", *bf16_args)


def dcp_reference(ckpt: Path, tmp_path: Path) -> dict:
    """The checkpoint's DCP state as torch's own dcp_to_torch_save writes it ({"model": ..., "ema": ...})."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from opentau_cli.store.layout import DCP_DIR

    out = tmp_path / f"reference_{ckpt.parent.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt / DCP_DIR), str(out))
    return torch.load(out, weights_only=False)  # torch's own file, made here


def trainable_names() -> list[str]:
    from opentau_cli.config import load_config
    from opentau_cli.policies import build_policy

    return [name for name, p in build_policy(load_config(TINY, {}).policy).named_parameters() if p.requires_grad]


class Preempted(NamedTuple):
    run: Path
    console: str  # what the preempted launch printed
    returncode: int  # the preempted launch's
    saved: list[str]  # the checkpoints it left
    verified: int  # `checkpoint verify`'s exit code on what it left
    continued: dict[int, float]  # the losses the resume logged (and only those)


@pytest.fixture(scope="module")
def preempted(home, bf16_args) -> Preempted:
    """The bf16 run saving every step, preempted by SIGTERM (a scheduler's preemption) while rank 0 writes the
    (asynchronous) save of step 1, then resumed in place to the end. One resume serves both the preemption test and the
    exact-resume test: a resume from any step must continue with the uninterrupted run's losses and EMA."""
    run = home / "sigterm"
    env = {**os.environ, **env_for(home), "TEST_KILL_AT": "before_metadata@1", "TEST_KILL_SIGNAL": "SIGTERM",
           "PYTHONPATH": os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH")) if p)}
    env.pop("OPENTAU_DEBUG", None)
    proc = subprocess.run([opentau_bin(), "train", *COMMON, *bf16_args, "--save_freq=1", f"--output_dir={run}"], env=env,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    saved = sorted(p.name for p in (run / CHECKPOINTS).iterdir() if p.name.isdigit()) if (run / CHECKPOINTS).is_dir() else []
    verified = run_cli_in_process(["checkpoint", "verify", str(run)]).returncode
    logged = len((run / METRICS).read_text().splitlines()) if (run / METRICS).is_file() else 0
    result = run_cli(["resume", str(run)], env=env_for(home))
    assert result.returncode == 0, (f"the preempted launch exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}\n"
                                    f"the resume exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    records = [json.loads(line) for line in (run / METRICS).read_text().splitlines()[logged:]]
    return Preempted(run, proc.stdout + proc.stderr, proc.returncode, saved, verified,
                     {r["step"]: r["loss"] for r in records if r.get("kind") == "train"})


def test_fsdp2_yaml_trains_with_a_unit_per_transformer_layer_and_the_root(bf16_run):
    from opentau_cli.config import load_config
    from opentau_cli.policies import build_policy

    policy = build_policy(load_config(TINY, {}).policy)
    counts = [len(policy.vlm.vision_tower.encoder.layers), len(policy.language_model.layers), len(policy.expert.layers)]
    log = next(bf16_run.glob("logs/*/rank0.log")).read_text()
    found = re.search(r"FSDP2 units: (\d+) SigLIP encoder layers, (\d+) Gemma decoder layers, (\d+) action expert "
                      r"layers, (\d+) fp32 modules, the root \(2 processes\)\.", log)
    assert found, log[-3000:]
    assert [int(n) for n in found.groups()[:3]] == counts and int(found.group(4)) > 0
    state = json.loads((bf16_run / CHECKPOINTS / "000006" / TRAINING_STATE).read_text())
    assert (state["backend"], state["world_size"], state["mixed_precision"]) == ("fsdp", 2, "bf16")
    train = losses(bf16_run)
    assert sorted(train) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in train.values())
    records = [json.loads(line) for line in (bf16_run / METRICS).read_text().splitlines()]
    val = [r for r in records if r.get("kind") == "val"]
    assert [r["step"] for r in val] == [3, 6] and all(math.isfinite(r["ema_val_loss"]) for r in val)
    # Asynchronous saves and the mixture's two members.
    assert "Asynchronous saves: rank 0 copies the state" in CONSOLE["bf16"], CONSOLE["bf16"][-3000:]
    assert set(state["samples_per_dataset"]) == {"first", "second"} and all(state["samples_per_dataset"].values())
    # TensorBoard logged every training step.
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from opentau_cli.store.layout import TENSORBOARD

    events = [e for f in (bf16_run / TENSORBOARD).rglob("events.out.tfevents.*") for e in EventFileLoader(str(f)).Load()]
    logged = {e.step for e in events for v in e.summary.value if v.tag.endswith("loss")}
    assert set(range(1, STEPS + 1)) <= logged, sorted(logged)


def test_fsdp2_checkpoint_holds_each_ranks_dcp_shard_of_fp32_master_weights_and_moments(bf16_run):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from opentau_cli.config import load_config
    from opentau_cli.policies import build_policy
    from opentau_cli.store.dcp import read_metadata
    from opentau_cli.store.layout import DCP_DIR

    ckpt = bf16_run / CHECKPOINTS / "000003"
    files = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert {f"{DCP_DIR}/.metadata", f"{DCP_DIR}/__0_0.distcp", f"{DCP_DIR}/__1_0.distcp", "random_states_0.pkl",
            "random_states_1.pkl", "manifest.json"} <= files
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == files - {"manifest.json"}
    assert run_cli_in_process(["checkpoint", "verify", str(ckpt)]).returncode == 0
    metadata = read_metadata(ckpt / DCP_DIR)
    chunks: dict[str, int] = {}
    for index in metadata.storage_data:
        chunks[index.fqn] = chunks.get(index.fqn, 0) + 1
    tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    params = ["model." + name for name, _ in build_policy(load_config(TINY, {}).policy).named_parameters()]
    moments = [k for k in tensors if k.startswith("optimizer.state.") and k.endswith(".exp_avg")]
    assert params and moments
    # Master weights and AdamW moments are fp32 under bf16 compute, and each is split between the two ranks.
    assert {tensors[k].properties.dtype for k in params + moments} == {torch.float32}
    split = [k for k in params + moments if tensors[k].size[0] >= 2]
    assert split and all(chunks[k] == 2 for k in split)
    # The EMA is kept sharded like the parameters: an fp32 DTensor per trainable parameter, split as it is, saved
    # with the model's shards (no file of its own).
    ema = ["ema." + name for name in trainable_names()]
    assert {tensors[k].properties.dtype for k in ema} == {torch.float32}
    assert all(tensors[k].size == tensors["model." + k[4:]].size and chunks[k] == chunks["model." + k[4:]] for k in ema)
    assert not any(name.startswith("ema") for name in files)
    assert sorted(k for k in tensors if k.startswith("ema.")) == sorted(ema)


def test_fsdp2_resume_continues_with_the_same_losses_ema_and_mixture_position(bf16_run, preempted, tmp_path):
    resumed, start = preempted.run, int(preempted.saved[-1])
    uninterrupted, continued = losses(bf16_run), preempted.continued
    assert sorted(continued) == list(range(start + 1, STEPS + 1))
    assert {s: uninterrupted[s] for s in continued} == continued
    # The EMA continued from the checkpoint's shards: the same at the end, bit for bit, and its validation loss.
    end = f"{STEPS:06d}"
    mine = dcp_reference(resumed / CHECKPOINTS / end, tmp_path)["ema"]
    reference = dcp_reference(bf16_run / CHECKPOINTS / end, tmp_path)["ema"]
    assert sorted(mine) == sorted(reference) == sorted(trainable_names())
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    val = {run: [r["ema_val_loss"] for r in map(json.loads, (run / METRICS).read_text().splitlines())
                 if r.get("kind") == "val" and r["step"] == STEPS] for run in (bf16_run, resumed)}
    assert val[resumed] == val[bf16_run] and len(val[bf16_run]) == 1
    states = [json.loads((run / CHECKPOINTS / end / TRAINING_STATE).read_text()) for run in (bf16_run, resumed)]
    assert states[0]["samples_per_dataset"] == states[1]["samples_per_dataset"]
    # Lineage: the resumed launch's first save descends from the checkpoint it resumed.
    import xxhash

    parent = resumed / CHECKPOINTS / f"{start:06d}"
    lineage = json.loads((resumed / CHECKPOINTS / f"{start + 1:06d}" / TRAINING_STATE).read_text())["lineage"]
    assert lineage["parent"] == {"step": start, "name": parent.name,
                                 "manifest_xxh3": xxhash.xxh3_128((parent / "manifest.json").read_bytes()).hexdigest()}
    assert lineage["launch"] != json.loads((parent / TRAINING_STATE).read_text())["lineage"]["launch"]


def test_sigterm_saves_an_fsdp2_checkpoint_that_resumes_to_the_uninterrupted_losses(bf16_run, preempted, tmp_path):
    """SIGTERM reaches the launcher while rank 0 writes the (asynchronous) save of step 1; the run finishes its step,
    saves and exits 0; the resume logs the uninterrupted run's losses bit for bit. Every step is saved: each
    checkpoint's EMA is decay * the previous one's + (1 - decay) * its weights, in fp32."""
    run = preempted.run
    assert preempted.returncode == 0 and "Preempted" in preempted.console, preempted.console[-3000:]
    assert preempted.saved and int(preempted.saved[-1]) < STEPS
    assert preempted.verified == 0
    assert losses(run) == losses(bf16_run)
    saved = [dcp_reference(run / CHECKPOINTS / f"{s:06d}", tmp_path) for s in range(1, STEPS + 1)]
    for before, now in zip(saved, saved[1:]):
        assert now["ema"].keys() == before["ema"].keys()
        assert all(torch.equal(now["ema"][k], before["ema"][k] * DECAY + now["model"][k] * (1.0 - DECAY))
                   for k in now["ema"])


def test_fsdp2_checkpoint_consolidates_to_what_dcp_to_torch_save_gives(bf16_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from opentau_cli.store.dcp import consolidate_model
    from opentau_cli.store.layout import DCP_DIR

    ckpt = bf16_run / CHECKPOINTS / "000006"
    before = tree(ckpt)
    mine = load_file(consolidate_model(ckpt, tmp_path / "model.safetensors"))
    dcp_to_torch_save(str(ckpt / DCP_DIR), str(tmp_path / "reference.pt"))
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)["model"]  # torch's own file, made here
    assert sorted(mine) == sorted(reference)
    for name, tensor in reference.items():
        assert mine[name].dtype == tensor.dtype and mine[name].shape == tensor.shape and torch.equal(mine[name], tensor), name
    assert tree(ckpt) == before


def test_an_fsdp2_checkpoint_resumed_under_ddp_is_refused_in_one_line(bf16_run, home):
    refused(run_cli_in_process(["resume", str(bf16_run), f"--accelerate-config={DDP}"], env=env_for(home)),
            "FSDP2", "same backend")


FP32_STEPS = ["--validation.val_freq=0", "--logging.tensorboard=false"]


# The DDP side is the session's shared DDP run (conftest.ddp_reference: this preset, steps, saves and batch; its EMA
# and validation change no training loss), launched once for every module that compares with it. The FSDP2 side
# takes its warm-up.
@pytest.fixture(scope="module")
def fsdp_fp32(home) -> Path:
    fp32 = home / "fsdp2_fp32.yaml"
    fp32.write_text(FSDP2.read_text().replace("mixed_precision: bf16", 'mixed_precision: "no"'))
    return train(home, "fsdp_fp32", f"--accelerate-config={fp32}", *FP32_STEPS, f"--ema.decay={DECAY}",
                 f"--scheduler.warmup_steps={REFERENCE_WARMUP}")


@pytest.fixture(scope="module")
def ddp_fp32(ddp_reference) -> Path:
    """The shared DDP run (read only: the tests below copy its checkpoint before resuming it)."""
    assert (DDP_REFERENCE_STEPS, DDP_REFERENCE_SAVE) == (STEPS, SAVE)
    return ddp_reference


def test_fsdp2_in_fp32_trains_as_ddp_does(fsdp_fp32, ddp_fp32):
    fsdp, ddp = losses(fsdp_fp32), losses(ddp_fp32)
    assert sorted(fsdp) == sorted(ddp) == list(range(1, STEPS + 1))
    assert fsdp[1] == ddp[1]  # the same weights and batches before any update
    # After updates only the order of the gradient sums differs (reduce-scatter vs all-reduce).
    assert all(abs(fsdp[s] - ddp[s]) <= 1e-4 * abs(ddp[s]) for s in range(2, STEPS + 1)), (fsdp, ddp)


def test_consolidated_fsdp2_weights_have_the_names_shapes_and_dtypes_of_a_ddp_checkpoint(fsdp_fp32, ddp_fp32, tmp_path):
    from opentau_cli.store.dcp import consolidate_model

    mine = load_file(consolidate_model(fsdp_fp32 / CHECKPOINTS / "000003", tmp_path / "model.safetensors"))
    ddp = load_file(ddp_fp32 / CHECKPOINTS / "000003" / "model.safetensors")
    assert {k: (tuple(v.shape), v.dtype) for k, v in mine.items()} == {k: (tuple(v.shape), v.dtype) for k, v in ddp.items()}
    # The same training in fp32: the weights agree to within the reduction order's rounding.
    assert all(torch.allclose(mine[k], ddp[k], rtol=1e-4, atol=1e-6) for k in ddp)


# The consumers of a checkpoint take FSDP2 ones (their dispatch to store/dcp.py).

def test_checkpoint_consolidate_writes_fsdp2_weights_equal_to_dcp_to_torch_save_into_the_checkpoint(bf16_run, home, tmp_path):
    """By default the EMA (the run kept one): the trained parameters' EMA, the buffers as saved; --weights live
    gives the model itself."""
    run = tmp_path / "run"
    shutil.copytree(bf16_run, run, symlinks=True)
    ckpt = run / CHECKPOINTS / "000003"
    saved = dcp_reference(ckpt, tmp_path)
    for weights, reference in (("ema", {**saved["model"], **saved["ema"]}), ("live", saved["model"])):
        args = ["checkpoint", "consolidate", str(ckpt)] + (["--weights=live", "--force"] if weights == "live" else [])
        result = run_cli_in_process(args, env=env_for(home))
        assert result.returncode == 0, result.stderr
        mine = load_file(ckpt / "model.safetensors")
        assert sorted(mine) == sorted(reference)
        assert all(mine[k].dtype == v.dtype and torch.equal(mine[k], v) for k, v in reference.items()), weights
        # The manifest vouches for the new file: the checkpoint still verifies.
        assert run_cli_in_process(["checkpoint", "verify", str(ckpt)]).returncode == 0
    assert not all(torch.equal(saved["ema"][k], saved["model"][k]) for k in saved["ema"])


def test_fsdp2_checkpoints_are_inspected_exported_and_evaluated(bf16_run, home, tmp_path):
    ckpt = bf16_run / CHECKPOINTS / "000006"
    before = tree(bf16_run)
    inspect = run_cli_in_process(["checkpoint", "inspect", str(ckpt)], env=env_for(home))
    assert inspect.returncode == 0 and "backend:         fsdp" in inspect.stdout, inspect.stdout + inspect.stderr
    assert "DCP shards" in inspect.stdout and "consolidated:    no" in inspect.stdout, inspect.stdout
    export = run_cli_in_process(["checkpoint", "export", str(bf16_run), "--output", str(tmp_path / "export")], env=env_for(home))
    assert export.returncode == 0, export.stderr
    saved = dcp_reference(ckpt, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        assert (f.metadata()["weights"], f.metadata()["step"]) == ("ema", str(STEPS))  # the EMA by default
    exported = load_file(tmp_path / "export" / "model.safetensors")
    # A few tensors by their names in the OpenTau layout: the EMA's values, not the live ones.
    for ours, theirs in (("action_out_proj.weight", "model.action_out_proj.weight"),
                         ("embed_suffix.action_in_proj.weight", "model.action_in_proj.weight")):
        assert torch.equal(exported[theirs].float(), saved["ema"][ours])
        assert not torch.equal(exported[theirs].float(), saved["model"][ours])
    evaluated = run_cli_in_process(["eval", str(bf16_run), "--output", str(tmp_path / "eval")], env=env_for(home))
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["step"] == STEPS
    from opentau_cli.tools.serve import load_served

    served = load_served(bf16_run, device="cpu")  # what `opentau serve` answers clients with
    assert (served.metadata()["weights"], served.metadata()["step"]) == ("ema", STEPS)
    chunk = served.infer(served.blank_observation())["actions"]
    assert chunk.shape[0] > 0 and bool(torch.isfinite(torch.as_tensor(chunk)).all())
    assert tree(bf16_run) == before


def reshard(home: Path, source: Path, name: str, accelerate_config: Path) -> Path:
    """`source`'s step-3 checkpoint copied into a run of its own and resumed under `accelerate_config` with
    --reshard=true."""
    run = home / name
    (run / CHECKPOINTS).mkdir(parents=True)
    shutil.copytree(source / CHECKPOINTS / "000003", run / CHECKPOINTS / "000003", symlinks=True)
    result = run_cli(["resume", str(run), "--reshard=true", f"--accelerate-config={accelerate_config}"], env=env_for(home))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return run


BACKEND = {"ddp": "ddp", "fsdp2": "fsdp", "zero2": "deepspeed"}


@pytest.mark.parametrize("source, target", [("ddp", "fsdp2"), ("fsdp2", "ddp"), ("fsdp2", "zero2")])
def test_an_elastic_resume_between_ddp_or_zero2_and_fsdp2_continues_with_the_uninterrupted_losses(
        source, target, fsdp_fp32, ddp_fp32, home, tmp_path):
    """2 processes under DDP <-> 2 under FSDP2, and FSDP2 -> ZeRO-2 -> FSDP2 (fp32): the weights and AdamW state arrive bit for
    bit (the launch checks it, else it fails), each rank continues its own random streams on the same samples, so the
    losses are the uninterrupted run's up to the reduction order. The FSDP2 run keeps an EMA: it continues from its
    shards, cut into the new launch's layout, to the uninterrupted run's EMA up to the same rounding."""
    runs = {"ddp": ddp_fp32, "fsdp2": fsdp_fp32}
    yaml = {"ddp": DDP, "fsdp2": fsdp_fp32.parent / "fsdp2_fp32.yaml", "zero2": EXAMPLES / "accelerate_cpu_deepspeed_config.yaml"}
    run = reshard(home, runs[source], f"{source}_to_{target}", yaml[target])
    got, ref = losses(run), losses(runs[source])
    assert sorted(got) == list(range(SAVE + 1, STEPS + 1))
    assert all(got[s] == pytest.approx(ref[s], rel=1e-5, abs=0) for s in got), (got, ref)
    end = run / CHECKPOINTS / f"{STEPS:06d}"
    state = json.loads((end / TRAINING_STATE).read_text())
    assert state["backend"] == BACKEND[target]
    assert [t["backend"] for t in state["topologies"]] == [BACKEND[source], state["backend"]]
    if source == "fsdp2":
        from opentau_cli.train.ema import saved_by_name

        uninterrupted = dcp_reference(fsdp_fp32 / CHECKPOINTS / f"{STEPS:06d}", tmp_path)["ema"]
        if target == "ddp":
            continued = load_file(end / "ema.safetensors")
        else:  # ZeRO-2's partitions, cut by the ZeRO reader's plan
            continued = {name: produce() for name, produce in saved_by_name(end, state).items() if name in uninterrupted}
        assert sorted(continued) == sorted(uninterrupted)
        # Attention key biases get (almost) no gradient: their tiny values are noise, hence the absolute tolerance.
        assert all(torch.allclose(continued[k], uninterrupted[k], rtol=1e-4, atol=1e-6) for k in uninterrupted)
    if target == "zero2":
        # And back: the ZeRO-2 checkpoint continues under FSDP2 for two more steps (the launch checks that weights
        # and AdamW state arrive bit for bit); the run's topologies record the round trip.
        back = run_cli(["resume", str(run), "--reshard=true", f"--accelerate-config={yaml['fsdp2']}",
                        f"--steps={STEPS + 2}"], env=env_for(home))
        assert back.returncode == 0, f"exit {back.returncode}\n{back.stderr[-5000:]}"
        after = losses(run)
        assert sorted(after) == list(range(SAVE + 1, STEPS + 3)) and all(math.isfinite(v) for v in after.values())
        state = json.loads((run / CHECKPOINTS / f"{STEPS + 2:06d}" / TRAINING_STATE).read_text())
        assert [t["backend"] for t in state["topologies"]] == ["fsdp", "deepspeed", "fsdp"]


# LoRA under FSDP2: one short run with asynchronous saves, SIGKILLed while its last save is written, and its resume.

LORA_STEPS, LORA_SAVE, LORA_RANK, LORA_ALPHA = 4, 2, 4, 16.0


@pytest.fixture(scope="module")
def lora_base(home) -> Path:
    """A pretrained base of the tiny policy (seeded initial weights), as a file of the test's own."""
    from safetensors.torch import save_file

    from opentau_cli.config import load_config
    from opentau_cli.policies import build_policy

    torch.manual_seed(7)
    folder = home / "lora_base"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in build_policy(load_config(TINY, {}).policy).state_dict().items()},
              str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def lora_killed(home, lora_base) -> tuple[Path, dict[int, float]]:
    """The run, killed (SIGKILL, every process) once rank 0 has written its part of the step-4 save; and the losses
    it logged up to then."""
    run = home / "lora"
    env = {**os.environ, **env_for(home), "TEST_KILL_AT": f"before_metadata@{LORA_STEPS}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH")) if p)}
    env.pop("OPENTAU_DEBUG", None)
    command = [opentau_bin(), "train", "--config_path", str(TINY), "--steps", str(LORA_STEPS), "--save_freq",
               str(LORA_SAVE), "--log_freq", "1", "--batch_size", "4", "--scheduler.warmup_steps", "1",
               f"--accelerate-config={FSDP2}", f"--policy.lora.rank={LORA_RANK}", f"--policy.lora.alpha={LORA_ALPHA}",
               f"--policy.pretrained_path={lora_base}", "--policy.pretrained_strict=false", "--validation.val_freq=0",
               "--logging.tensorboard=false", "--checkpoint.async_save=true", f"--output_dir={run}"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    return run, losses(run)


def test_lora_under_fsdp2_saves_only_what_trains_survives_a_kill_mid_save_resumes_exactly_and_exports_the_merge(
        lora_killed, lora_base, home, tmp_path):
    from safetensors.torch import load_file as load

    from opentau_cli.config.model import LORA_FULL_MODULES

    run, before = lora_killed
    # The kill left the previous checkpoint as it was, and published nothing of the interrupted save.
    assert sorted(p.name for p in (run / CHECKPOINTS).iterdir() if p.name.isdigit()) == [f"{LORA_SAVE:06d}"]
    assert run_cli_in_process(["checkpoint", "verify", str(run)]).returncode == 0
    assert sorted(before) == list(range(1, LORA_STEPS + 1))

    ckpt = run / CHECKPOINTS / f"{LORA_SAVE:06d}"
    saved = dcp_reference(ckpt, tmp_path)
    base = load(str(lora_base / "model.safetensors"))
    model = saved["model"]
    # Only the adapters, the fully trained modules and the buffers (not parameters of the base): never a frozen weight.
    adapters = [k for k in model if ".lora_A." in k or ".lora_B." in k]
    assert adapters and not any(".base_layer." in k for k in model)
    assert all(k in adapters or any(k.startswith(m + ".") for m in LORA_FULL_MODULES) or k in base for k in model)
    frozen = [k for k in base if k not in model and not any(k.startswith(m + ".") for m in LORA_FULL_MODULES)]
    assert sum(model[k].numel() for k in model) < sum(base[k].numel() for k in frozen)  # small beside the base
    moments = list(saved["optimizer"]["state"])
    assert moments and all(".lora_" in k or any(k.startswith(m + ".") for m in LORA_FULL_MODULES) for k in moments)

    # The resume continues from the intact checkpoint with the losses the killed launch logged.
    result = run_cli(["resume", str(run)], env=env_for(home))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    continued = losses(run)
    assert {s: continued[s] for s in range(LORA_SAVE + 1, LORA_STEPS + 1)} == \
        {s: before[s] for s in range(LORA_SAVE + 1, LORA_STEPS + 1)}

    # Export merges the adapters into the base: one full model.safetensors, base + (alpha / rank) * B @ A.
    export = run_cli_in_process(["checkpoint", "export", str(run), "--output", str(tmp_path / "export")], env=env_for(home))
    assert export.returncode == 0, export.stderr
    exported = load(str(tmp_path / "export" / "model.safetensors"))
    assert not any(".lora_" in k or "base_layer" in k for k in exported)
    final = dcp_reference(run / CHECKPOINTS / f"{LORA_STEPS:06d}", tmp_path)["model"]
    module = "expert.layers.0.mlp.down_proj"
    a, b = final[f"{module}.lora_A.default.weight"], final[f"{module}.lora_B.default.weight"]
    merged = base[f"{module}.weight"].float() + (LORA_ALPHA / LORA_RANK) * (b.float() @ a.float())
    assert torch.equal(exported["model.paligemma_with_expert.gemma_expert.model.layers.0.mlp.down_proj.weight"], merged)
    assert not torch.equal(merged, base[f"{module}.weight"])


def test_an_fsdp2_checkpoint_continues_on_another_world_size_keeping_the_global_batch(fsdp_fp32, home, tmp_path):
    """FSDP2 on 2 processes -> one process (--reshard=true): DCP's shards are assembled for the one rank (the launch
    checks that weights and AdamW state arrive bit for bit, else it fails), the global batch is kept (twice the
    per-process batch), the EMA continues from its shards as one file, and every step after the checkpoint is logged
    once with a finite loss (new random streams: not the uninterrupted losses, as for every world-size change)."""
    one = home / "one_process.yaml"
    one.write_text(DDP.read_text().replace("num_processes: 2", "num_processes: 1").replace("MULTI_CPU", "NO"))
    run = reshard(home, fsdp_fp32, "fsdp2_to_one", one)
    got = losses(run)
    assert sorted(got) == list(range(SAVE + 1, STEPS + 1)) and all(math.isfinite(v) for v in got.values())
    state = json.loads((run / CHECKPOINTS / f"{STEPS:06d}" / TRAINING_STATE).read_text())
    before, after = state["topologies"]
    assert (before["backend"], before["world_size"], after["world_size"]) == ("fsdp", 2, 1)
    assert after["per_device_batch"] * after["grad_accum"] == 2 * before["per_device_batch"] * before["grad_accum"]
    assert sorted(load_file(run / CHECKPOINTS / f"{STEPS:06d}" / "ema.safetensors")) == sorted(
        dcp_reference(fsdp_fp32 / CHECKPOINTS / f"{STEPS:06d}", tmp_path)["ema"])
