"""Runs restart themselves (docs/ARCHITECTURE.md, "Restarts"): with distributed.max_restarts, torch's elastic agent
restarts the ranks when one dies or hangs, and they continue from the run's `last` checkpoint with no person involved.

Real 2-process launches of the installed CLI; tests/hooks makes rank 1 fail at an exact step of an exact attempt
(SIGKILL itself, SIGSTOP itself, raise, or raise a UserError), so the restarts resume from known checkpoints. The
references are the same runs without a fault (the session's shared runs, conftest.ddp_reference, zero2_reference and
zero3_reference), compared by their metrics.jsonl and their saved weights (read with safetensors / torch.load,
not with the product).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import EXAMPLES, REFERENCE_STEPS, REFERENCE_WARMUP, run_cli
from opentau_cli.store.layout import CHECKPOINTS, METRICS

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.timeout(900)]

HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
DDP = EXAMPLES / "accelerate_cpu_ddp_config.yaml"
ZERO2 = EXAMPLES / "accelerate_cpu_deepspeed_config.yaml"
ZERO3 = EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"
STEPS = 12


def train(tmp_path: Path, name: str, yaml: Path, *extra: str, fault: str | None = None):
    run = tmp_path / name
    env = {"HF_HOME": str(tmp_path / "hf_home")}
    if fault:
        env.update(PYTHONPATH=str(HOOKS), TEST_FAULT=fault, TEST_FAULT_RANK="1")
    result = run_cli(["train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={run}",
                      f"--accelerate-config={yaml}", f"--steps={STEPS}", "--save_freq=4", "--log_freq=1",
                      "--batch_size=4", "--validation.val_freq=0", *extra], env=env)
    return run, result


def train_records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / METRICS).read_text().splitlines()) if r.get("kind") == "train"]


def restarts_of(run: Path) -> list[dict]:
    path = run / "logs" / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def attempts_in_logs(run: Path) -> int:
    return max(int(line.split(":")[1]) for log in run.glob("logs/*/rank0.log")
               for line in log.read_text().splitlines() if line.startswith("opentau-attempt:")) + 1


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, ddp_reference):
    """The session's uninterrupted DDP run (conftest.ddp_reference: 6 steps, batch 4, a warm-up of 2), and the same
    run saving every 2 steps (its EMA and validation aside, which change no training loss) in which rank 1 is
    SIGKILLed at step 4 (after checkpoint 2) and, once restarted, SIGSTOPped at step 6 (after checkpoint 4): a hang
    that the 20 s timeout turns into a restart (10 s could let a slow save on a loaded machine pass for a hang)."""
    tmp = tmp_path_factory.mktemp("restarts_ddp")
    faulted, result = train(tmp, "faulted", DDP, "--distributed.timeout_minutes=0.34", "--max-restarts=2",
                            f"--steps={REFERENCE_STEPS}", "--save_freq=2", f"--scheduler.warmup_steps={REFERENCE_WARMUP}",
                            fault="kill@4:0,stop@6:1")
    return ddp_reference, faulted, result


def test_a_killed_and_a_hung_rank_restart_the_run_which_ends_as_if_nothing_happened(ddp):
    reference, faulted, result = ddp
    assert result.returncode == 0, result.stderr[-3000:]
    assert train_records(faulted) == [{**r, "samples_per_s": a["samples_per_s"]}
                                      for r, a in zip(train_records(reference), train_records(faulted))]
    assert [r["step"] for r in train_records(faulted)] == list(range(1, REFERENCE_STEPS + 1))
    final = "%06d" % REFERENCE_STEPS
    mine = load_file(faulted / CHECKPOINTS / final / "model.safetensors")
    theirs = load_file(reference / CHECKPOINTS / final / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    verified = run_cli(["checkpoint", "verify", str(faulted)])
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_each_restart_is_recorded_with_its_cause_and_its_checkpoint(ddp):
    _, faulted, result = ddp
    records = restarts_of(faulted)
    assert [(r["restart"], r["resumed_from"], r["step"], r["failed_at_step"], r["rank"]) for r in records] == [
        (1, "000002", 2, 4, 1), (2, "000004", 4, 6, 1)]
    assert records[0]["cause"].startswith("rank 1 on machine 0 "), records[0]["cause"]
    assert "killed" in records[0]["cause"]
    assert records[1]["cause"].startswith("rank 1 on machine 0 stopped responding at step 6 (hung: rank 0 reports"), records[1]["cause"]
    shown = [line for line in result.stdout.splitlines() if line.startswith("Restart ")]
    assert [line.split(":")[0] for line in shown] == ["Restart 1 of 2", "Restart 2 of 2"], result.stdout[-3000:]
    inspected = run_cli(["checkpoint", "inspect", str(faulted)])
    assert inspected.returncode == 0, inspected.stderr
    assert "restart 1" in inspected.stdout.lower() and "000002" in inspected.stdout and "000004" in inspected.stdout


def tensors_in(obj, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a torch.load'ed DeepSpeed state, by its path in the nesting."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in tensors_in(value, f"{path}/{key}").items()}


@pytest.mark.parametrize("yaml, extra, shared", [(ZERO2, ("--checkpoint.async_save=true",), "zero2_reference"),
                                                 (ZERO3, (), "zero3_reference")], ids=["zero2-async-saves", "zero3"])
def test_a_restarted_deepspeed_run_ends_as_if_nothing_happened(tmp_path, request, yaml, extra, shared):
    # The session's shared run of the backend (conftest.zero2_reference, saving synchronously, and zero3_reference):
    # its length and warm-up, a save every 2 steps. How it saves, its EMA and its validation change no training.
    reference, steps, save = request.getfixturevalue(shared), REFERENCE_STEPS, 2
    extra = (*extra, f"--steps={steps}", f"--save_freq={save}", f"--scheduler.warmup_steps={REFERENCE_WARMUP}")
    # Two saves in, the first checkpoint is published (an async save waits for the one in flight) and the second may
    # still be being written.
    faulted, result = train(tmp_path, "faulted", yaml, *extra, "--max-restarts=1", fault=f"kill@{2 * save + 2}:0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(r["step"], r["loss"]) for r in train_records(faulted)] == [(r["step"], r["loss"]) for r in train_records(reference)]
    records = restarts_of(faulted)
    assert len(records) == 1 and records[0]["resumed_from"] in ("%06d" % save, "%06d" % (2 * save))
    assert records[0]["step"] == int(records[0]["resumed_from"])
    final = "%06d" % steps
    # Every rank's fp32 master weights and AdamW moments, as DeepSpeed saved them.
    states = [{f"{f.name}{k}": v for f in sorted((run / CHECKPOINTS / final / "pytorch_model").glob("*optim_states.pt"))
               for k, v in tensors_in(torch.load(f, map_location="cpu", weights_only=False)).items()}
              for run in (faulted, reference)]
    assert states[0] and states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_the_same_step_failing_again_stops_the_run_without_burning_its_restarts(tmp_path):
    run, result = train(tmp_path, "crash", DDP, "--max-restarts=5", fault="raise@6:*")
    assert result.returncode == 1
    error = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "step 6 failed again after restart 1" in error[0], result.stderr[-3000:]
    assert [(r["restart"], r["resumed_from"]) for r in restarts_of(run)] == [(1, "000004")]
    # Attempt 2 starts, reads that attempt 1 failed where attempt 0 did, and ends the launch before training: not 6.
    assert attempts_in_logs(run) == 3
    assert [r["step"] for r in train_records(run)] == [1, 2, 3, 4, 5]


def test_bad_input_found_late_ends_a_restartable_run_at_once_with_exit_2(tmp_path):
    run, result = train(tmp_path, "bad", DDP, "--max-restarts=3", fault="user@3:*")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == "Error: injected fault: episode 3 of the dataset is unreadable."
    assert "Traceback" not in result.stderr
    assert restarts_of(run) == [] and attempts_in_logs(run) == 1
