"""LoRA end to end through the installed CLI: single process and real `accelerate launch` on 2 CPU processes (DDP,
ZeRO-2, ZeRO-3 in bf16), each with exact resume; the checkpoint's contents, a changed base refused, export's merge.

Launches are shared (module-scoped): per resumed backend one uninterrupted run and one resume of its middle checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from conftest import EXAMPLES, SINGLE_PROCESS_ENV, opentau_bin, own_cache, run_cli, run_cli_in_process
from opentau_cli.config import load_config
from opentau_cli.policies import build_policy, load_pretrained
from opentau_cli.policies.lora import apply_lora, checkpoint_keys, restore_policy
from opentau_cli.store.layout import CHECKPOINTS, METRICS, MODEL_WEIGHTS, TRAINING_STATE, step_of
from opentau_cli.store.manifest import hash_file
from opentau_cli.store.zero import read_zero_checkpoint

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

TINY = EXAMPLES / "pi05_tiny_config.json"
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
YAML = {"single": None, "ddp": EXAMPLES / "accelerate_cpu_ddp_config.yaml",
        "zero2": EXAMPLES / "accelerate_cpu_deepspeed_config.yaml", "zero3": EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"}
STEPS, SAVE, RANK, ALPHA = 4, 2, 4, 8
LORA = [f"--policy.lora.rank={RANK}", f"--policy.lora.alpha={ALPHA}"]
# Every LoRA run keeps an EMA of its adapters (decay far from 1, so each step weighs in): resumes carry it exactly.
COMMON = ["--steps", str(STEPS), "--save_freq", str(SAVE), "--log_freq", "1", "--scheduler.warmup_steps", "1",
          "--validation.val_freq=0", "--logging.tensorboard=false", "--ema.decay=0.9", *LORA]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


def env_for(home: Path) -> dict:
    # This module's own demo data (runs compared with each other read the same), no user Accelerate default.
    return {"HF_HOME": str(home / "hf_home"), "OPENTAU_CACHE_DIR": own_cache(home / "cache"), "HF_HUB_OFFLINE": "1"}


def launch_env(home: Path, backend: str) -> dict:
    return {**env_for(home), **(SINGLE_PROCESS_ENV if backend == "single" else {})}


@pytest.fixture(scope="module")
def base(home) -> Path:
    """Published-like base weights: a pi05_tiny policy of another seed, in opentau's own layout, with statistics of
    the demo robot's widths (4 state, 2 action dims)."""
    cfg = load_config(TINY, {})
    torch.manual_seed(7)
    policy = build_policy(cfg.policy, stats={"state": {"q01": [-1.0] * 4, "q99": [1.0] * 4, "mean": [0.0] * 4, "std": [1.0] * 4},
                                             "action": {"q01": [-2.0] * 2, "q99": [2.0] * 2, "mean": [0.0] * 2, "std": [1.0] * 2}})
    folder = home / "base"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in policy.state_dict().items()}, str(folder / MODEL_WEIGHTS))
    return folder


def accelerate_yaml(backend: str, out: Path) -> Path | None:
    """The example YAML of the backend; ZeRO-3's with mixed_precision bf16 (DeepSpeed's bf16 runs on CPU too: bf16
    weights, fp32 master weights and moments), written beside the run."""
    if backend != "zero3":
        return YAML[backend]
    config = yaml.safe_load(YAML["zero3"].read_text())
    path = out.parent / f"{out.name}-zero3-bf16.yaml"
    path.write_text(yaml.safe_dump({**config, "mixed_precision": "bf16"}))
    return path


def train_args(backend: str, out: Path, base: Path, *extra: str) -> list[str]:
    args = ["train", f"--config_path={TINY}", f"--output_dir={out}", *COMMON, f"--policy.pretrained_path={base}",
            "--batch_size", "8" if backend == "single" else "4", *extra]
    if YAML[backend]:
        args.append(f"--accelerate-config={accelerate_yaml(backend, out)}")
    return args


def train(home: Path, backend: str, out: Path, base: Path, *extra: str):
    return run_cli(train_args(backend, out, base, *extra), env=launch_env(home, backend))


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / METRICS).read_text().splitlines()) if r.get("kind") == "train"}


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"{step:06d}"


@pytest.fixture(scope="module")
def runs(home, base):
    made: dict[str, Path] = {}

    def get(backend: str, resumed: bool = False) -> Path:
        key = f"{backend}{'-resumed' if resumed else ''}"
        if key not in made:
            if resumed:
                full = get(backend)
                out = home / key
                (out / CHECKPOINTS).mkdir(parents=True)
                shutil.copytree(ckpt(full, SAVE), ckpt(out, SAVE))
                ok(run_cli(["resume", str(out)], env=launch_env(home, backend)))
            else:
                out = home / key
                ok(train(home, backend, out, base))
            made[key] = out
        return made[key]

    return get


def expected_keys() -> set[str]:
    """What a LoRA checkpoint of this config holds: the trained parameters and the buffers (from a meta build)."""
    cfg = load_config(TINY, {"policy.lora.rank": str(RANK)})
    with torch.device("meta"):
        return checkpoint_keys(apply_lora(build_policy(cfg.policy), cfg.policy.lora))


def ema_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's EMA: ema.safetensors (single / DDP), else each DeepSpeed rank's ema_rank<r>.safetensors."""
    files = sorted(step_dir.glob("ema*.safetensors"))
    assert files, f"{step_dir} holds no EMA"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}


def assert_same_ema(got_dir: Path, want_dir: Path) -> None:
    got, want = ema_tensors(got_dir), ema_tensors(want_dir)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# DDP's exact resume is the SIGTERM test's: its preempted run resumes to the uninterrupted DDP losses and EMA.
@pytest.mark.parametrize("backend", ["single", "zero2", "zero3"])
def test_a_resumed_lora_run_logs_the_same_losses_and_keeps_the_same_ema_as_the_uninterrupted_one(runs, backend):
    full, resumed = losses(runs(backend)), losses(runs(backend, resumed=True))
    assert sorted(full) == list(range(1, STEPS + 1)) and sorted(resumed) == list(range(SAVE + 1, STEPS + 1))
    assert all(resumed[s] == full[s] for s in resumed), (full, resumed)
    assert_same_ema(ckpt(runs(backend, resumed=True), STEPS), ckpt(runs(backend), STEPS))
    assert not torch.equal(*(next(iter(ema_tensors(ckpt(runs(backend), s)).values())) for s in (SAVE, STEPS)))


@pytest.mark.parametrize("backend", ["single", "ddp", "zero2", "zero3"])
def test_a_lora_checkpoint_holds_the_trained_tensors_and_buffers_and_the_base_s_hash_never_the_base(runs, base, backend):
    step_dir = ckpt(runs(backend), STEPS)
    if backend in ("single", "ddp"):
        names = set(load_file(str(step_dir / MODEL_WEIGHTS)))
    else:
        names = {e.name for e in read_zero_checkpoint(step_dir).entries}
    assert names == expected_keys()
    assert not any(".base_layer." in n for n in names)
    state = json.loads((step_dir / TRAINING_STATE).read_text())
    assert state["lora_base"] == {"source": str(base), "files": {MODEL_WEIGHTS: hash_file(base / MODEL_WEIGHTS)}}
    assert state["mixed_precision"] == ("bf16" if backend == "zero3" else "no")


@pytest.mark.parametrize("backend", ["single", "ddp", "zero2", "zero3"])
def test_checkpoint_verify_passes_on_every_lora_checkpoint_of_each_backend(runs, backend):
    run = runs(backend)
    r = run_cli_in_process(["checkpoint", "verify", str(run), "--json"])
    ok(r)
    report = json.loads(r.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert sorted(Path(c).name for c in report["checkpoints"]) == [f"{SAVE:06d}", f"{STEPS:06d}"]
    assert all(problems == [] for problems in report["checkpoints"].values())


def full_checkpoint_bytes() -> int:
    """What a full fine-tuning checkpoint of pi05_tiny holds at least: fp32 weights and buffers, AdamW's two moments."""
    cfg = load_config(TINY, {})
    with torch.device("meta"):
        policy = build_policy(cfg.policy)
    return 4 * sum(t.numel() for t in policy.state_dict().values()) + 8 * sum(p.numel() for p in policy.parameters() if p.requires_grad)


def saved_steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / CHECKPOINTS).iterdir() if step_of(p.name) is not None)


def test_sigterm_saves_a_resumable_lora_checkpoint_and_retention_keeps_the_resume_source_and_only_adapters(runs, base, home):
    """As for full fine-tuning: SIGTERM finishes the step, saves and exits 0; the resume (saving every step, keep_last=1)
    logs the uninterrupted run's losses, deletes each older checkpoint but the one it resumed from, and every
    checkpoint left holds only the LoRA tensors (adapter-sized)."""
    reference = losses(runs("ddp"))
    out = home / "sigterm"
    # The scheduler's SIGTERM reaches the launcher while rank 0 writes the save of step 1 (the kill hook, at a named
    # moment: a signal sent when the first loss appears can come after a tiny run has finished); a later step then
    # saves and stops, and keep_last=1 leaves only that checkpoint.
    env = {**os.environ, **env_for(home), "PYTHONPATH": str(HOOKS), "TEST_KILL_AT": "before_metadata@1",
           "TEST_KILL_SIGNAL": "SIGTERM"}
    env.pop("OPENTAU_DEBUG", None)
    args = train_args("ddp", out, base, "--save_freq", "1", "--checkpoint.keep_last", "1")
    proc = subprocess.run([opentau_bin(), *args], env=env, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "Preempted" in log
    (preempted,) = saved_steps(out)
    assert 1 < int(preempted) < STEPS

    ok(run_cli_in_process(["checkpoint", "verify", str(out)]))
    ok(run_cli(["resume", str(out), "--save_freq", "1"], env=env_for(home)))
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == reference[step], f"step {step}"  # same world size and backend: bit for bit
    assert saved_steps(out) == sorted({preempted, f"{STEPS:06d}"})
    assert_same_ema(ckpt(out, STEPS), ckpt(runs("ddp"), STEPS))  # the EMA of the adapters, carried over exactly
    for name in saved_steps(out):
        step_dir = out / CHECKPOINTS / name
        assert set(load_file(str(step_dir / MODEL_WEIGHTS))) == expected_keys()
        assert sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file()) < 0.1 * full_checkpoint_bytes()


def test_a_lora_run_reshards_like_a_full_one_and_a_backend_change_keeps_the_uninterrupted_losses(runs, home):
    """--reshard=true continues a LoRA checkpoint as it does a full one. 2 processes under DDP -> 2 under ZeRO-2 is a
    backend change alone: the adapters and their AdamW state arrive bit for bit (the launch checks it), each rank keeps
    its random streams and the frozen base is the one the checkpoint records, so the losses are the uninterrupted
    DDP run's up to the reduction order."""
    full = runs("ddp")
    out = home / "reshard-zero2"
    (out / CHECKPOINTS).mkdir(parents=True)
    shutil.copytree(ckpt(full, SAVE), ckpt(out, SAVE))
    r = run_cli(["resume", str(out), "--reshard=true", f"--accelerate-config={YAML['zero2']}"], env=env_for(home))
    ok(r)
    assert "Elastic resume: 2 processes on 1 machine under ddp -> 2 processes on 1 machine under ZeRO-2" in r.stderr
    reference, resumed = losses(full), losses(out)
    assert sorted(resumed) == list(range(SAVE + 1, STEPS + 1))  # all logged by the resumed launch (a new directory)
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=0), step
    state = json.loads((ckpt(out, STEPS) / TRAINING_STATE).read_text())
    assert state["backend"] == "deepspeed" and state["zero_stage"] == 2
    assert state["lora_base"] == json.loads((ckpt(full, SAVE) / TRAINING_STATE).read_text())["lora_base"]


def test_checkpoint_inspect_reports_a_lora_checkpoint_under_10_percent_of_a_full_one(runs):
    step_dir = ckpt(runs("ddp"), STEPS)
    r = run_cli_in_process(["checkpoint", "inspect", str(step_dir), "--json"])
    ok(r)
    info = json.loads(r.stdout)
    assert info["lora"]["rank"] == RANK and info["lora"]["base"]["files"]
    assert info["total_bytes"] < 0.1 * full_checkpoint_bytes(), info["total_bytes"]
    text = run_cli_in_process(["checkpoint", "inspect", str(step_dir)]).stdout
    assert f"rank {RANK}, alpha {ALPHA}: holds the adapters" in text and "the frozen base is not copied" in text


def test_resuming_on_a_changed_base_exits_2_in_one_line_and_writes_nothing(runs, base, home, tmp_path):
    run = tmp_path / "run"
    (run / CHECKPOINTS).mkdir(parents=True)
    shutil.copytree(ckpt(runs("ddp"), SAVE), ckpt(run, SAVE))
    changed = tmp_path / "changed"
    shutil.copytree(base, changed)
    tensors = load_file(str(changed / MODEL_WEIGHTS))
    tensors["expert.layers.0.mlp.down_proj.weight"] += 1e-3
    save_file(tensors, str(changed / MODEL_WEIGHTS))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    r = run_cli_in_process(["resume", str(run), f"--policy.pretrained_path={changed}"], env=env_for(home))
    assert r.returncode == 2, r.stderr[-3000:]
    message = r.stderr.strip()
    assert "\n" not in message and "Traceback" not in r.stderr
    assert "holds LoRA adapters of the base weights" in message and "is not the same content" in message
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_export_merges_base_plus_scaled_b_a_and_the_merged_model_loads_strictly_with_the_lora_policy_s_actions(runs, base, home, tmp_path):
    step_dir = ckpt(runs("ddp"), STEPS)
    out = tmp_path / "exported"
    ok(run_cli_in_process(["checkpoint", "export", str(step_dir), "--output", str(out)]))  # export and eval launch nothing
    # What export ships by default: the EMA of what trained (ema.safetensors) over the checkpoint's tensors.
    trained = {**load_file(str(step_dir / MODEL_WEIGHTS)), **load_file(str(step_dir / "ema.safetensors"))}
    base_weights = load_file(str(base / MODEL_WEIGHTS))

    cfg = load_config(step_dir / "train_config.json", {})
    plain = build_policy(cfg.policy.model_copy(update={"lora": {"rank": 0}}))
    load_pretrained(plain, out, strict=True)
    module = "vlm.language_model.layers.0.self_attn.v_proj"
    a, b = trained[f"{module}.lora_A.default.weight"], trained[f"{module}.lora_B.default.weight"]
    assert b.abs().sum() > 0  # trained: the merge changes the weight
    merged = plain.state_dict()[f"{module}.weight"]
    assert torch.allclose(merged, base_weights[f"{module}.weight"] + (ALPHA / RANK) * b @ a, atol=1e-6)
    assert torch.equal(plain.state_dict()["action_out_proj.weight"], trained["action_out_proj.weight"])

    adapted = restore_policy(cfg, trained)
    g = torch.Generator().manual_seed(0)
    batch = {"images": torch.rand(2, 1, 3, 32, 32, generator=g), "image_masks": torch.ones(2, 1, dtype=torch.bool),
             "state": torch.randn(2, cfg.policy.max_state_dim, generator=g), "task": ["pick"] * 2}
    noise = torch.randn(2, cfg.policy.chunk_size, cfg.policy.max_action_dim, generator=g)
    adapted.eval(), plain.eval()
    with torch.no_grad():
        assert torch.allclose(adapted.sample_actions(batch, noise=noise), plain.sample_actions(batch, noise=noise), atol=1e-4)

    # `opentau eval` of the LoRA checkpoint (adapters on their base) and of the merged export: the same actions on the
    # same episodes (the same seed draws the same noise), so the same errors within float tolerance.
    reports = []
    for source, name in ((step_dir, "eval-lora"), (out, "eval-merged")):
        ok(run_cli_in_process(["eval", str(source), "--dataset.root=@demo", "--episodes", "0,1", "--output", str(tmp_path / name),
                    "--stride", "4", "--plot-episodes", "0"], env=env_for(home)))
        reports.append(json.loads((tmp_path / name / "eval.json").read_text()))
    lora_report, merged_report = reports
    assert lora_report["episodes"] == merged_report["episodes"] == [0, 1]
    assert lora_report["policy"]["mse"] == pytest.approx(merged_report["policy"]["mse"], rel=1e-4, abs=1e-7)
    assert lora_report["policy"]["per_joint"]["mse"] == pytest.approx(merged_report["policy"]["per_joint"]["mse"], rel=1e-4, abs=1e-7)
