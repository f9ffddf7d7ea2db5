"""The EMA of the weights (`ema.decay`) in real 2-process launches: the session's shared DDP and ZeRO-3 reference runs
(conftest.ddp_reference, conftest.zero3_reference: pi05_tiny, 6 steps, a save and a validation every 3).

A test hook (tests/hooks) records the live trainable weights before the first step and after each step
(DeepSpeed's own gather of its fp32 master weights under ZeRO-3); the test computes openpi's EMA from them and
compares it, exactly, with the EMA the checkpoints hold: DDP's ema.safetensors, and ZeRO-3's per-rank partitions
consolidated by `opentau checkpoint consolidate --weights ema`. A resume's losses and EMA tensors equal the
uninterrupted run's bit for bit under every backend: tests/test_train_e2e.py (whose runs all keep an EMA). Each run
validates at its middle step with the live and the EMA weights, and trains on from the live weights given back (which
the step-by-step comparison would catch if they were not).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    EXAMPLES, HOOKS, REFERENCE_EMA_DECAY, REFERENCE_SAVE, REFERENCE_STEPS, own_cache, recorded_weights, run_cli,
    run_cli_in_process,
)
from opentau_cli.store.layout import (
    CHECKPOINTS, EMA_WEIGHTS, METRICS, MODEL_WEIGHTS, TRAIN_CONFIG, TRAINING_STATE, ema_rank_file,
)

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

YAML = {"ddp": str(EXAMPLES / "accelerate_cpu_ddp_config.yaml"),
        "zero3": str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml")}
DECAY = REFERENCE_EMA_DECAY  # 0.9: far from 1, so that every step's weights weigh in visibly
STEPS, SAVE = REFERENCE_STEPS, REFERENCE_SAVE


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"


def reference_ema(recorded: Path, upto: int) -> dict[str, torch.Tensor]:
    """openpi's EMA, computed here from the recorded weights: start from the weights before step 1, then
    ema = decay * ema + (1 - decay) * w after each step."""
    ema = load_file(str(recorded / "step_0.safetensors"))
    for step in range(1, upto + 1):
        weights = load_file(str(recorded / f"step_{step}.safetensors"))
        ema = {name: DECAY * ema[name] + (1 - DECAY) * weights[name] for name in ema}
    return ema


class EmaRun:
    """One of the session's shared reference runs (read only), with the weights it recorded: DDP, and ZeRO-3 saving
    asynchronously."""

    def __init__(self, reference: Path, tmp: Path):
        self.dir, self.recorded = reference, recorded_weights(reference)
        self.env = {"HF_HOME": str(tmp / "hf_home"), "OPENTAU_CACHE_DIR": own_cache(tmp / "cache"), "PYTHONPATH": str(HOOKS)}

    def ckpt(self, step: int) -> Path:
        return self.dir / CHECKPOINTS / f"{step:06d}"


@pytest.fixture(scope="module")
def ema_runs(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("ema")
    made: dict[str, EmaRun] = {}

    def get(backend: str) -> EmaRun:
        if backend not in made:
            made[backend] = EmaRun(request.getfixturevalue(f"{backend}_reference"), tmp)
        return made[backend]

    return get


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], want[name]), name


def test_ddp_ema_equals_the_ema_of_the_recorded_weights_step_by_step(ema_runs):
    run = ema_runs("ddp")
    for step in (SAVE, STEPS):
        assert_same(load_file(str(run.ckpt(step) / EMA_WEIGHTS)), reference_ema(run.recorded, step))
        state = json.loads((run.ckpt(step) / TRAINING_STATE).read_text())
        assert state["ema"] == {"decay": DECAY}
    # The EMA is not the live weights (each step moved them), and the live weights are the recorded ones.
    live = load_file(str(run.ckpt(STEPS) / MODEL_WEIGHTS))
    ema = load_file(str(run.ckpt(STEPS) / EMA_WEIGHTS))
    assert any(not torch.equal(ema[n], live[n]) for n in ema)
    assert_same({n: live[n] for n in ema}, load_file(str(run.recorded / f"step_{STEPS}.safetensors")))


def test_zero3_ema_partitions_consolidate_to_the_ema_of_the_recorded_weights(ema_runs, tmp_path):
    run = ema_runs("zero3")
    ckpt = run.ckpt(STEPS)
    for rank in (0, 1):
        assert (ckpt / ema_rank_file(rank)).is_file()
    assert not (ckpt / EMA_WEIGHTS).exists()
    # No rank holds a full copy: each rank's file holds about half the trainable values.
    trainable = sum(t.numel() for t in reference_ema(run.recorded, 0).values())
    for rank in (0, 1):
        held = sum(t.numel() for t in load_file(str(ckpt / ema_rank_file(rank))).values())
        assert held < 0.6 * trainable
    for weights, want in (("ema", reference_ema(run.recorded, STEPS)),
                          ("live", load_file(str(run.recorded / f"step_{STEPS}.safetensors")))):
        out = tmp_path / f"{weights}.safetensors"
        ok(run_cli_in_process(["checkpoint", "consolidate", str(ckpt), "--weights", weights, "--output", str(out)]))
        got = load_file(str(out))
        assert_same({n: got[n] for n in want}, want)


def test_zero3_consolidate_defaults_to_the_ema_and_refuses_to_mix_them_up(ema_runs, tmp_path):
    run = ema_runs("zero3")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run.ckpt(STEPS), ckpt)
    ok(run_cli_in_process(["checkpoint", "consolidate", str(ckpt)]))
    got = load_file(str(ckpt / MODEL_WEIGHTS))
    want = reference_ema(run.recorded, STEPS)
    assert_same({n: got[n] for n in want}, want)
    refused = run_cli_in_process(["checkpoint", "consolidate", str(ckpt), "--weights", "live"])
    assert refused.returncode == 2 and "holds the ema weights" in refused.stderr
    ok(run_cli_in_process(["checkpoint", "verify", str(ckpt)]))


def test_verify_and_resume_refuse_a_checkpoint_missing_its_ema(ema_runs, tmp_path):
    run = ema_runs("zero3")
    broken = tmp_path / "run"
    (broken / CHECKPOINTS).mkdir(parents=True)
    ckpt = shutil.copytree(run.ckpt(SAVE), broken / CHECKPOINTS / run.ckpt(SAVE).name)
    (ckpt / ema_rank_file(1)).unlink()
    verified = run_cli_in_process(["checkpoint", "verify", str(ckpt)])
    assert verified.returncode != 0 and ema_rank_file(1) in verified.stdout + verified.stderr
    refused = run_cli_in_process(["resume", str(ckpt), f"--accelerate-config={YAML['zero3']}"],
                                 env={"OPENTAU_CACHE_DIR": os.environ.get("OPENTAU_CACHE_DIR", "")})
    assert refused.returncode == 2 and ema_rank_file(1) in refused.stderr


@pytest.mark.parametrize("source, target", [("ddp", "zero3"), ("zero3", "ddp")])
def test_an_elastic_resume_carries_the_ema_over_exactly(ema_runs, tmp_path, source, target):
    """--reshard=true into another backend: the EMA the new launch starts from is the checkpoint's, value for value
    (read in the new launch by the hook, from the EMA swapped into the weights)."""
    run = ema_runs(source)
    copy = tmp_path / "run"
    shutil.copytree(run.dir, copy, symlinks=True)
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    env = {**run.env, "TEST_RECORD_WEIGHTS": str(recorded)}
    ok(run_cli(["resume", str(copy / CHECKPOINTS / f"{SAVE:06d}"), "--rollback=true", "--reshard=true",
                f"--accelerate-config={YAML[target]}"], env=env))
    started = load_file(str(recorded / f"step_{SAVE}_ema.safetensors"))
    assert_same(started, reference_ema(run.recorded, SAVE))


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_export_eval_and_serve_read_the_ema_by_default_and_the_live_weights_when_asked(ema_runs, backend):
    from opentau_cli.tools.export import open_saved_policy

    run = ema_runs(backend)
    want = {"ema": reference_ema(run.recorded, STEPS), "live": load_file(str(run.recorded / f"step_{STEPS}.safetensors"))}
    for weights in (None, "ema", "live"):
        saved = open_saved_policy(run.ckpt(STEPS), weights)
        assert_same({n: saved.entries[n].produce() for n in want["live"]}, want[weights or "ema"])
    frozen = [n for n in saved.entries if n not in want["live"]]
    assert frozen  # buffers (and frozen weights) come from the checkpoint as saved, whichever weights are asked


def test_eval_takes_weights(ema_runs, tmp_path):
    run = ema_runs("ddp")
    for weights in ("ema", "live"):
        out = tmp_path / weights
        ok(run_cli_in_process(["eval", str(run.ckpt(STEPS)), "--weights", weights, "--output", str(out),
                               "--stride", "8", "--plot-episodes", "0", "--device", "cpu"], env=run.env))
    mse = {w: json.loads((tmp_path / w / "eval.json").read_text())["policy"]["mse"] for w in ("ema", "live")}
    assert mse["ema"] != mse["live"]


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_validation_reports_the_live_and_the_ema_loss(ema_runs, backend):
    run = ema_runs(backend)
    records = [json.loads(line) for line in (run.dir / METRICS).read_text().splitlines()]
    val = [r for r in records if r.get("kind") == "val"]
    assert [r["step"] for r in val] == [SAVE, STEPS]
    for r in val:
        assert r["val_loss"] > 0 and r["ema_val_loss"] > 0 and r["ema_val_loss"] != r["val_loss"]


def test_the_ema_benchmark_smoke_run_reports_ddp_with_and_without(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    results = tmp_path / "B.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_ema.py"), "--smoke", "--results", str(results)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = results.read_text()
    assert "The cost of the EMA of the weights" in text and "--smoke" in text
    assert "| DDP |" in text and "| ZeRO-3 |" not in text  # the smoke runs one backend; both: tests/test_ema.py
    assert text.count("with EMA") == 1 and "MiB/rank" in text


def independent_validation(ckpt: Path, weights: dict[str, torch.Tensor], world_size: int) -> float:
    """The validation loss of `weights` (loaded over the checkpoint's policy) computed here, not by the trainer: each
    rank's validation batches rebuilt from the checkpoint's config, the noise seeded per rank as validation documents
    (seed + 7 x rank + 1), the batch losses summed per rank, then averaged over ranks and batches."""
    from opentau_cli.config import load_config
    from opentau_cli.data import build_data
    from opentau_cli.policies import build_policy

    cfg = load_config(ckpt / TRAIN_CONFIG, {})
    policy = build_policy(cfg.policy)
    policy.load_state_dict(load_file(str(ckpt / MODEL_WEIGHTS)))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name in weights:
                p.copy_(weights[name])
    policy.eval()
    loaders = [build_data(cfg, rank=r, world_size=world_size) for r in range(world_size)]
    try:
        n = min(min(len(d.val_loader), cfg.validation.max_batches) for d in loaders)
        sums = []
        for rank, data in enumerate(loaders):
            torch.manual_seed(cfg.seed + 7 * rank + 1)
            batches = iter(data.val_loader)
            total = 0.0
            with torch.no_grad():
                for _ in range(n):
                    total = total + policy(next(batches))["loss"].float()
            sums.append(total)
    finally:
        for data in loaders:
            data.stream.close()
    return float(sum(sums) / world_size / n)


def test_ddp_ema_val_loss_equals_an_independent_evaluation_of_the_ema_weights(ema_runs, tmp_path, monkeypatch):
    """ema_val_loss is the validation loss of the EMA computed here from the recorded weights (not the EMA the trainer
    keeps), on the same batches and noise; val_loss that of the live weights. Exact (fp32 on CPU, same operations)."""
    run = ema_runs("ddp")
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path / "cache"))  # the demo data, generated again (deterministic)
    val = {r["step"]: r for r in (json.loads(line) for line in (run.dir / METRICS).read_text().splitlines())
           if r.get("kind") == "val"}
    ckpt = run.ckpt(SAVE)
    live = load_file(str(run.recorded / f"step_{SAVE}.safetensors"))
    assert independent_validation(ckpt, live, 2) == val[SAVE]["val_loss"]
    assert independent_validation(ckpt, reference_ema(run.recorded, SAVE), 2) == val[SAVE]["ema_val_loss"]
