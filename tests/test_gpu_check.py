"""The GPU self-check (benchmarks/gpu_check.py): its CPU dry run launches the real CLI, compares real losses of a
resume with the uninterrupted run and writes one table; its GPU launches use the example Accelerate configs' keys."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import EXAMPLES, REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_restore  # noqa: E402

pytestmark = [pytest.mark.full, pytest.mark.slow]  # a minute or more: starts first (tests/conftest.py)

sys.path.pop(0)


def run_check(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"}
    env.pop("OPENTAU_DEBUG", None)
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=900)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, object]:
    """One CPU dry run of every check the tests below read (the full pi05's skip, DDP, FSDP2, inference, attention):
    one gpu_check process and one table instead of one per test. Its runs are kept; a test that alters a checkpoint
    alters a copy."""
    home = tmp_path_factory.mktemp("gpu_check")
    out = home / "check"
    r = run_check("--cpu-dry-run", "--only", "pi05,ddp,fsdp2,inference,attention", "--out", str(out), "--keep-runs",
                  tmp_path=home)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, out


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "train"}


@pytest.mark.e2e
def test_cpu_dry_run_of_ddp_resumes_with_the_uninterrupted_losses_and_writes_one_table(dry_run, tmp_path):
    r, out = dry_run
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["cpu_dry_run"] is True
    # One table: every check's rows in the order of gpu_check.CHECKS.
    assert [row["check"] for row in report["rows"]] == [
        "one step", "memory plan vs peak", *["train + checkpoint", "exact resume", "restored state"] * 2,
        "inference, eager", "inference, torch.compile", "attention kernel"]
    assert [(row["check"], row["backend"], row["result"]) for row in report["rows"] if row["backend"] == "ddp"] == [
        ("train + checkpoint", "ddp", "PASS"), ("exact resume", "ddp", "PASS"), ("restored state", "ddp", "PASS"),
    ]
    for backend in ("ddp",):  # one backend: the others run the same code with another YAML
        full = losses(out / "runs" / backend / "full" / "metrics.jsonl")
        resumed = losses(out / "runs" / backend / "resumed" / "metrics.jsonl")
        assert sorted(full) == [1, 2, 3, 4]
        assert sorted(resumed) == [3, 4]  # the resumed run directory holds only what the resume logged
        row = next(row for row in report["rows"] if row["check"] == "exact resume" and row["backend"] == backend)
        assert row["detail"]["steps"] == [3, 4]
        assert row["detail"]["uninterrupted"] == [full[3], full[4]]
        assert row["detail"]["resumed"] == [resumed[3], resumed[4]] == [full[3], full[4]]
    assert yaml.safe_load((out / "setup" / "accelerate_ddp.yaml").read_text())["num_processes"] == 2
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("## GPU self-check (CPU dry run) (")
    assert "| check | backend | result | key number | seconds |" in md
    assert md.count("| PASS |") == 9 and md.count("| SKIP |") == 2  # ddp 3, fsdp2 3, inference 2, attention 1
    assert "| exact resume | ddp | PASS | steps 3-4: losses equal |" in md
    assert re.search(r"^exact resume +ddp +PASS +steps 3-4: losses equal", r.stdout, re.M)  # the printed table
    # The restored state: the step-2 checkpoint restored on both ranks and saved again before any step, every tensor
    # compared (weights, AdamW moments, schedule, both ranks' random states).
    saved, again = out / "runs" / "ddp" / "full" / "checkpoints" / "000002", out / "runs" / "ddp" / "restored" / "checkpoints" / "000002"
    assert gpu_check_restore.differences(saved, again)[0] == []
    tensors = gpu_check_restore.differences(saved, again)[1]
    assert f"| restored state | ddp | PASS | {tensors} tensors equal to the bit after the resume |" in md and tensors > 10
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"} <= set(
        gpu_check_restore.tensor_files(saved))
    # A checkpoint one value off is told apart (the comparison can fail): a copy of it, the shared run's kept as is.
    from safetensors.torch import load_file, save_file

    again = shutil.copytree(again, tmp_path / "altered")

    weights = load_file(str(again / "model.safetensors"))
    name = next(k for k, t in weights.items() if t.is_floating_point())
    weights[name].view(-1)[0] = torch.nextafter(weights[name].view(-1)[0], torch.tensor(float("inf")))
    save_file(weights, str(again / "model.safetensors"), metadata={"format": "pt"})
    assert gpu_check_restore.differences(saved, again)[0] == [f"model.safetensors/{name}: tensors differ"]
    # Every process of the check ran PyTorch's deterministic settings (the sitecustomize the runs imported).
    assert "use_deterministic_algorithms(True" in (out / "setup" / "deterministic" / "sitecustomize.py").read_text()


@pytest.mark.e2e
def test_cpu_dry_run_of_fsdp2_resumes_exactly_and_restores_every_dcp_shard_to_the_bit(dry_run, tmp_path):
    """The FSDP2 rows on the CPU variant of the example YAML: train + checkpoint, exact resume, and the restored
    state read back from the DCP shards tensor by tensor (model, AdamW moments) next to the scheduler and RNG files."""
    _, out = dry_run
    rows = [row for row in json.loads((out / "gpu_check.json").read_text())["rows"] if row["backend"] == "fsdp2"]
    assert [(row["check"], row["backend"], row["result"]) for row in rows] == [
        ("train + checkpoint", "fsdp2", "PASS"), ("exact resume", "fsdp2", "PASS"), ("restored state", "fsdp2", "PASS")]
    full = losses(out / "runs" / "fsdp2" / "full" / "metrics.jsonl")
    resumed = losses(out / "runs" / "fsdp2" / "resumed" / "metrics.jsonl")
    assert sorted(resumed) == [3, 4] and [resumed[3], resumed[4]] == [full[3], full[4]]
    used = yaml.safe_load((out / "setup" / "accelerate_fsdp2.yaml").read_text())
    assert used == {**yaml.safe_load((EXAMPLES / "accelerate_cpu_fsdp2_config.yaml").read_text()), "mixed_precision": "no"}
    saved = out / "runs" / "fsdp2" / "full" / "checkpoints" / "000002"
    again = out / "runs" / "fsdp2" / "restored" / "checkpoints" / "000002"
    found, tensors = gpu_check_restore.differences(saved, again)
    assert found == [] and f"{tensors} tensors equal to the bit after the resume" == rows[2]["key"]
    from opentau_cli.store.dcp import saved_entries

    shards = saved_entries(saved, "")
    assert any(name.startswith("model.") for name in shards) and any(name.startswith("optimizer.state.") for name in shards)
    assert tensors > len(shards)  # the DCP tensors and the scheduler / RNG files' tensors
    # A shard one value off is told apart (the comparison can fail): rank 1's file rewritten with one value moved.
    import torch.distributed.checkpoint as dcp

    state = {name: entry.produce() for name, entry in saved_entries(again, "").items()}
    name = next(k for k, v in state.items() if k.startswith("model.") and v.is_floating_point())
    state[name].view(-1)[-1] = torch.nextafter(state[name].view(-1)[-1], torch.tensor(float("inf")))
    moved = tmp_path / "moved"
    shutil.copytree(again, moved)
    shutil.rmtree(moved / "fsdp_state")
    dcp.save(state, checkpoint_id=moved / "fsdp_state", no_dist=True)
    assert [f for f in gpu_check_restore.differences(saved, moved)[0] if "tensors differ" in f] == [
        f"fsdp_state/{name}: tensors differ"]


def test_a_resume_passes_on_an_exact_first_step_and_later_steps_within_the_stated_tolerance():
    full = {3: 1.5, 4: 1.25, 5: 1.0}
    assert gpu_check.resume_row("ddp", full, dict(full), range(3, 6), 1.0, REPO).key == "steps 3-5: losses equal"
    elastic = gpu_check.resume_row("zero2 -> ddp", full, {3: 1.5 * 1.1, 4: 1.25, 5: 1.0}, range(3, 6), 1.0, REPO,
                                   elastic=True)
    assert (elastic.check, elastic.result) == ("elastic resume", "PASS")
    assert elastic.key == "steps 3-5 logged, losses within 1.0e-01 of the uninterrupted run's (other random streams)"
    lost = gpu_check.resume_row("zero2 -> ddp", full, {3: 1.5, 4: float("nan"), 5: 1.0}, range(3, 6), 1.0, REPO, elastic=True)
    assert lost.result == "FAIL"
    drift = gpu_check.resume_row("ddp", full, {3: 1.5, 4: 1.25 * (1 + 1e-6), 5: 1.0}, range(3, 6), 1.0, REPO)
    assert drift.result == "PASS" and drift.key == "step 3 equal, steps 4-5 within 1.0e-06 (tolerance 1e-03)"
    first = gpu_check.resume_row("ddp", full, {3: 1.5 * (1 + 1e-9), 4: 1.25, 5: 1.0}, range(3, 6), 1.0, REPO)
    assert first.result == "FAIL" and "the first resumed loss" in first.key
    far = gpu_check.resume_row("ddp", full, {3: 1.5, 4: 1.25, 5: 1.01}, range(3, 6), 1.0, REPO)
    assert far.result == "FAIL" and "step 3 equal, losses differ by up to 1.00e-02 relative" in far.key
    missing = gpu_check.resume_row("ddp", full, {3: 1.5}, range(3, 6), 1.0, REPO)
    assert missing.result == "FAIL" and "logged steps [3]" in missing.key


def test_the_memory_plan_row_passes_only_within_10_percent_of_max_memory_allocated_either_way():
    gib = 2**30
    assert gpu_check.memory_row("pi05", 60 * gib, 55 * gib).result == "PASS"
    assert gpu_check.memory_row("pi05", 60 * gib, 65 * gib).result == "PASS"
    under = gpu_check.memory_row("pi05", 60 * gib, 70 * gib)
    assert under.result == "FAIL" and under.key == ("planned 60.0 GiB, measured 70.0 GiB (max_memory_allocated / plan = "
                                                    "1.17; must be within 0.90-1.10)")
    assert gpu_check.memory_row("pi05", 60 * gib, 50 * gib).result == "FAIL"  # a plan 20% high refuses runs that fit


@pytest.mark.e2e
def test_cpu_dry_run_times_inference_eager_and_compiled_names_the_attention_kernel_and_skips_the_full_pi05(dry_run):
    _, out = dry_run
    rows = [row for row in json.loads((out / "gpu_check.json").read_text())["rows"] if row["backend"] not in ("ddp", "fsdp2")]
    assert [(row["check"], row["result"]) for row in rows] == [
        ("one step", "SKIP"), ("memory plan vs peak", "SKIP"), ("inference, eager", "PASS"),
        ("inference, torch.compile", "PASS"), ("attention kernel", "PASS")]
    eager, compiled = rows[2], rows[3]
    assert eager["backend"] == compiled["backend"] == "pi05_tiny, fp32 CPU, 3 cameras"
    for row in (eager, compiled):  # 3 timed requests after a warm-up, next to the upstream tool's published figure
        assert len(row["detail"]["ms"]) == 3 and row["detail"]["anchor_ms"] == 152.9
        assert "x the upstream 152.9 ms (RTX 5090)" in row["key"]
    assert compiled["detail"]["relative_difference"] <= gpu_check.COMPILE_TOLERANCE
    assert rows[4]["key"].startswith("flash (CPU) x") and rows[4]["backend"] == "pi05_tiny, cpu"


@pytest.mark.parametrize("backend, example", [
    ("ddp", "accelerate_ddp_config.yaml"),
    ("zero2", "accelerate_deepspeed_config.yaml"),
    ("zero3", "accelerate_deepspeed_zero3_config.yaml"),
    ("fsdp2", "accelerate_fsdp2_config.yaml"),
])
def test_gpu_launches_use_the_example_accelerate_configs_on_every_visible_gpu(backend, example):
    plan = gpu_check.Plan.for_machine(cpu_dry_run=False, gpus=8)
    assert plan.precision == "bf16" and plan.config.name == "pi05_small_bench.json"
    assert gpu_check.accelerate_yaml(backend, plan) == yaml.safe_load((EXAMPLES / example).read_text())
    assert gpu_check.accelerate_yaml(backend, gpu_check.Plan.for_machine(False, 2))["num_processes"] == 2
    single = gpu_check.accelerate_yaml("single", plan)
    assert single["distributed_type"] == "NO" and single["num_processes"] == 1 and single["mixed_precision"] == "bf16"


def check_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """gpu_check's main in this process (its refusals launch nothing): exit code, stdout, stderr."""
    try:
        code = gpu_check.main(list(args))
    except SystemExit as exit_:  # argparse's own exit
        code = exit_.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_or_the_dry_run_flag_it_exits_2_in_one_line_and_writes_nothing(tmp_path, capsys):
    r = check_in_process(capsys, "--out", str(tmp_path / "check"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "No CUDA GPU is visible; run on a GPU machine, or pass --cpu-dry-run to check the script on CPU."]
    assert not (tmp_path / "check").exists()


def test_an_unknown_check_exits_2_naming_it_and_writes_nothing(tmp_path, capsys):
    r = check_in_process(capsys, "--cpu-dry-run", "--only", "single,fsdp", "--out", str(tmp_path / "check"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "--only takes checks of single, pi05, ddp, zero2, zero3, fsdp2, gc, lora, async, elastic, eval, inference, "
        "attention, profile; got 'fsdp'."]
    assert not (tmp_path / "check").exists()
