"""Elastic machines (distributed.machines MIN:MAX): one run on two "machines" on loopback (1 process each, one shared
output directory, as the multi-machine tests do). Machine 1 leaves mid-run (its `opentau` command and agent SIGKILLed,
its rank dies with them); machine 0's group re-forms alone and continues from `last` on the smaller world; machine 1
comes back with `opentau resume` and is admitted when the group re-forms again. One launch serves every assertion."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (
    DDP_REFERENCE_ARGS, DDP_REFERENCE_SAVE, DDP_REFERENCE_STEPS, EXAMPLES, elastic_machines_args, opentau_bin, own_cache,
    run_cli_in_process,
)
from opentau_cli.store.layout import CHECKPOINTS, LOGS, METRICS, TRAINING_STATE

STEPS, SAVE = DDP_REFERENCE_STEPS, DDP_REFERENCE_SAVE  # 6, 3
LEAVES_AT = 5  # machine 1 leaves as step 5 starts: the group re-forms alone from checkpoint 3
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow]


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]


def start(args: list[str], env: dict, out: Path) -> subprocess.Popen:
    with open(out.with_suffix(".out"), "w") as stdout, open(out.with_suffix(".err"), "w") as stderr:
        return subprocess.Popen([opentau_bin(), *args], env=env, stdout=stdout, stderr=stderr, start_new_session=True)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory, ddp_reference):
    tmp = tmp_path_factory.mktemp("elastic")
    run = tmp / "run"
    # One thread per process, as the one-machine reference's two processes get on this machine (the launcher gives a
    # machine's processes its cores): another thread count sums in another order.
    env = {**os.environ, "HF_HOME": str(tmp / "hf_home"), "OPENTAU_CACHE_DIR": own_cache(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("OPENTAU_DEBUG", None)
    machines = elastic_machines_args()
    train = ["train", f"--output_dir={run}", *DDP_REFERENCE_ARGS, *machines]
    # Machine 0 holds step 5 of its second group (alone) until the agent stops it to admit machine 1.
    hook = {"PYTHONPATH": str(HOOKS), "TEST_FAULT_RANK": "any"}
    machine0 = start([*train, "--machine_rank=0"], {**env, **hook, "TEST_FAULT": f"hold@{LEAVES_AT}:1"}, tmp / "machine0")
    time.sleep(1)  # machine 0 first: it hosts the rendezvous
    machine1 = start([*train, "--machine_rank=1"], {**env, **hook, "TEST_FAULT": f"machine@{LEAVES_AT}:0"}, tmp / "machine1")
    left = machine1.wait(timeout=600)
    restarts = run / LOGS / "restarts.jsonl"
    deadline = time.monotonic() + 300
    while not restarts.is_file() and machine0.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    back = start(["resume", str(run), f"--accelerate-config={EXAMPLES / 'accelerate_cpu_ddp_config.yaml'}", *machines,
                  "--machine_rank=1"], env, tmp / "machine1_back")
    done = machine0.wait(timeout=600), back.wait(timeout=600)
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True).stdout.split()
    verify = run_cli_in_process(["checkpoint", "verify", str(run)], env=env)
    inspect = run_cli_in_process(["checkpoint", "inspect", str(run)], env=env)
    return {"run": run, "left": left, "done": done, "leftover": leftover, "verify": verify, "inspect": inspect,
            "console": (tmp / "machine0.out").read_text() + (tmp / "machine0.err").read_text(),
            "back_err": (tmp / "machine1_back.err").read_text(), "reference": dict(train_losses(ddp_reference)),
            "restarts": [json.loads(line) for line in restarts.read_text().splitlines()]}


def test_machine_0_goes_on_when_machine_1_leaves_and_every_step_is_logged_once(elastic):
    assert elastic["left"] == -9  # machine 1's command was SIGKILLed with its agent
    assert elastic["done"] == (0, 0), elastic["console"][-3000:] + elastic["back_err"][-3000:]
    assert [step for step, _ in train_losses(elastic["run"])] == list(range(1, STEPS + 1))
    assert elastic["leftover"] == []  # no rank or launcher of the run is left


def test_the_losses_before_the_failure_equal_the_uninterrupted_runs(elastic):
    # Steps 1..3 are the two-machine group's (its records past checkpoint 3 were truncated by the re-formed group); the
    # reference is the session's uninterrupted one-machine run of the same two processes.
    losses = dict(train_losses(elastic["run"]))
    assert [losses[s] for s in range(1, SAVE + 1)] == [elastic["reference"][s] for s in range(1, SAVE + 1)]


def test_the_group_re_forms_alone_then_with_the_machine_that_came_back(elastic):
    first, second = elastic["restarts"]
    assert (first["machine"], first["failed_at_step"], first["resumed_from"], first["world_before"], first["world"]) == (
        1, LEAVES_AT, f"{SAVE:06d}", 2, 1)
    assert first["cause"].endswith(f"on machine 1 was killed (its log ends without an error) at step {LEAVES_AT}")
    assert (second["regroup"], second["resumed_from"], second["world_before"], second["world"]) == (
        "machines joined: 2 processes now, 1 before", f"{LEAVES_AT:06d}", 1, 2)
    console = elastic["console"]
    assert f"Restart 1 of 1: rank {first['rank']} on machine 1 was killed" in console
    assert f"resumed from checkpoint {SAVE:06d} at step {SAVE} on 1 process (was 2)" in console
    assert (f"Group re-formed: machines joined: 2 processes now, 1 before; resumed from checkpoint {LEAVES_AT:06d} at "
            f"step {LEAVES_AT} on 2 processes (was 1).") in console
    inspect = elastic["inspect"].stdout
    assert "restart 1:" in inspect and "re-formed:" in inspect


def test_the_final_checkpoint_verifies_and_records_each_world_the_run_had(elastic):
    assert elastic["verify"].returncode == 0, elastic["verify"].stdout + elastic["verify"].stderr
    state = json.loads((elastic["run"] / CHECKPOINTS / f"{STEPS:06d}" / TRAINING_STATE).read_text())
    assert state["world_size"] == 2
    assert [(t["step"], t["world_size"], t["per_device_batch"]) for t in state["topologies"]] == [
        (0, 2, 4), (SAVE, 1, 8), (LEAVES_AT, 2, 4)]  # the global batch of 8 kept on each world


def test_config_validate_prints_the_restart_policy_and_the_elastic_machines(tmp_path):
    two = tmp_path / "two.yaml"
    two.write_text((EXAMPLES / "accelerate_cpu_ddp_config.yaml").read_text().replace("num_machines: 1", "num_machines: 2"))
    base = ["config", "validate", str(EXAMPLES / "pi05_tiny_config.json"), f"--output_dir={tmp_path / 'run'}"]
    plain = run_cli_in_process([*base, "--distributed.max_restarts=2"])
    elastic = run_cli_in_process([*base, f"--accelerate-config={two}", "--main_process_ip=10.0.0.1",
                                  "--distributed.max_restarts=3", "--distributed.machines=1:2"])
    assert plain.returncode == 0 and elastic.returncode == 0, plain.stderr + elastic.stderr
    assert "restarts           up to 2 automatic restarts from the last checkpoint when a rank dies or hangs" in plain.stdout
    assert "elastic machines" not in plain.stdout
    assert ("up to 3 automatic restarts" in elastic.stdout and "elastic machines 1:2: goes on with 1 or more, the global "
            "batch kept; re-forms after 30 s (distributed.machines)" in elastic.stdout), elastic.stdout
