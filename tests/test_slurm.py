"""The SLURM examples, submitted as written to a real SLURM cluster (tests/slurm_cluster.py: slurmctld and two slurmd
on this host): docs/clusters.md's weekend job, configs/examples/slurm_2nodes_8gpus.sbatch,
slurm_elastic_2nodes_8gpus.sbatch and slurm_spot_remote.sbatch (against the local S3 server), driven with sbatch,
squeue/scontrol, `scancel --signal` and `scontrol requeue` as a user would.

What the tests change is what the examples document: CONFIG (the tiny preset), ACCELERATE_CONFIG (a CPU config), the
run's length through OPENTAU_* variables, and `--gpus-per-node=0` on sbatch's command line (the cluster has no GPUs).
Every run is compared with one uninterrupted 2-process run: the same losses (`==`), every step logged once.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from conftest import EXAMPLES, REPO, refused, run_cli
from test_readme_commands import BLOCKS

# 20 steps, saving every 4 (was 40 and 5; the runs' steps were much of this module's time): a signal or kill sent
# after the first step or checkpoint still meets a run with 16 or more steps to go, seconds on a quiet machine.
STEPS, SAVE = 20, 4
RUN_ENV = {  # the run's length and pace, as OPENTAU_* variables (config keys), and one thread per process
    "OPENTAU_STEPS": str(STEPS), "OPENTAU_SAVE_FREQ": str(SAVE), "OPENTAU_LOG_FREQ": "1",
    "OPENTAU_SCHEDULER__WARMUP_STEPS": "2", "OPENTAU_VALIDATION__VAL_FREQ": "0", "OMP_NUM_THREADS": "1",
}
TINY = "configs/examples/pi05_tiny_config.json"
CPU_DDP = "configs/examples/accelerate_cpu_ddp_config.yaml"
CPU_2NODES = "configs/examples/accelerate_cpu_2nodes_config.yaml"
NO_GPUS = "--gpus-per-node=0"

pytestmark = [pytest.mark.full, pytest.mark.slow]  # minutes: starts first (tests/conftest.py)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from slurm_cluster import SlurmCluster, SlurmMissing

    try:
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    except SlurmMissing as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def submit_2_nodes(cluster, clone, script: str, run: Path, *options: str) -> str:
    """An example for 2 nodes, on the CPU config for 2 machines; machine 0's port picked free."""
    root, env = clone
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return cluster.sbatch(f"configs/examples/{script}", NO_GPUS, *options, cwd=root,
                          env={**env, "OUTPUT_DIR": str(run), "ACCELERATE_CONFIG": CPU_2NODES, "MASTER_PORT": str(port)})


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A working directory like a fresh clone's (the examples' relative paths) and the environment a job gets."""
    root = tmp_path_factory.mktemp("clone")
    shutil.copytree(REPO / "configs", root / "configs")
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HOME": str(root / "hf_home"), "HF_HUB_OFFLINE": "1", "CONFIG": TINY, **RUN_ENV}
    return root, env


@pytest.fixture(scope="module")
def reference(clone):
    """The uninterrupted run: the same config on 2 CPU processes, launched directly."""
    root, env = clone
    out = root / "reference"
    result = run_cli(["train", f"--config_path={TINY}", f"--accelerate-config={CPU_DDP}", f"--output_dir={out}"],
                     cwd=root, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return train_losses(out)


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]


def wait_for(condition, what: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def training(run_dir: Path) -> bool:
    """The run has logged a step (a notice now saves a checkpoint instead of stopping before training)."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and '"kind": "train"' in metrics.read_text()


def published(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def output(root: Path, job: str) -> str:
    return (root / f"slurm-{job}.out").read_text(errors="replace")


def requeue_and_finish(cluster, job: str, restarts: int) -> dict:
    cluster.run("scontrol", "requeue", job)
    # Requeued once the old instance is gone (COMPLETING while its processes end), then pending until its begin time
    # (cred_expire + 1 s: slurmd refuses to launch a job id it killed more recently than that).
    wait_for(lambda: cluster.job(job).get("Restarts") == str(restarts), "the requeue", timeout=120)
    info = cluster.wait(job, "COMPLETED")
    assert info["Restarts"] == str(restarts), info
    return info


def test_the_cluster_has_two_idle_nodes_as_sinfo_shows_them(cluster):
    assert cluster.node_states() == {"n1": "idle", "n2": "idle"}


def readme_weekend_job() -> str:
    blocks = [b for b in BLOCKS if b.slurm is not None and "#SBATCH" in b.code]
    assert len(blocks) == 1, "docs/clusters.md's weekend job: one sbatch block marked `readme-test: slurm:`"
    return blocks[0].code


def test_the_readme_weekend_job_saves_on_its_signal_and_continues_exactly_when_requeued(cluster, clone, reference):
    """`--signal=B:USR1@300` signals the batch shell only (`scancel --signal=USR1 --batch` sends the same): its trap
    passes it on, the ranks save and the job completes; `scontrol requeue` runs the same script, which continues."""
    root, env = clone
    script = root / "weekend.sbatch"
    script.write_text(readme_weekend_job())
    run = root / "weekend"
    job = cluster.sbatch(script, NO_GPUS, "--open-mode=append", cwd=root,
                         env={**env, "OUTPUT_DIR": str(run), "ACCELERATE_CONFIG": CPU_DDP})
    wait_for(lambda: training(run), "the first step")
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    info = cluster.wait(job, "COMPLETED")
    assert info["ExitCode"] == "0:0"
    saved = published(run)
    assert saved and saved[-1] < STEPS, (saved, output(root, job)[-3000:])
    assert f"SLURM job {job}, 1 node (n1)" in output(root, job)  # what the plan read from SLURM's environment
    requeue_and_finish(cluster, job, 1)
    assert f"--resume=auto: continuing from {run / 'checkpoints' / f'{saved[-1]:06d}'}" in output(root, job)
    assert train_losses(run) == reference


def test_the_2_node_job_killed_outright_continues_from_its_last_published_checkpoint_when_requeued(cluster, clone, reference):
    root = clone[0]
    run = root / "two_nodes"
    job = submit_2_nodes(cluster, clone, "slurm_2nodes_8gpus.sbatch", run)
    wait_for(lambda: published(run), "the first checkpoint")
    cluster.run("scancel", "--full", "--signal=KILL", job)
    cluster.wait(job, "FAILED", "CANCELLED", "COMPLETED")
    kept = published(run)
    assert kept and kept[-1] < STEPS
    text = output(root, job)
    assert f"SLURM job {job}, 2 nodes (n[1-2]), this is node 0 (SLURM_NODEID), machine 0's address 127.0.0.1" in text
    requeue_and_finish(cluster, job, 1)
    assert train_losses(run) == reference


def test_the_elastic_2_node_job_requeued_while_it_runs_continues_exactly(cluster, clone, reference):
    """`scontrol requeue` of a running job: SIGTERM to every process of the job, SIGKILL after KillWait (5 s here);
    the same script runs again and continues from whatever checkpoint was published last."""
    root = clone[0]
    run = root / "elastic"
    job = submit_2_nodes(cluster, clone, "slurm_elastic_2nodes_8gpus.sbatch", run)
    wait_for(lambda: published(run), "the first checkpoint")
    requeue_and_finish(cluster, job, 1)
    assert train_losses(run) == reference


def test_a_save_longer_than_the_jobs_signal_time_is_a_warning_naming_both_numbers(cluster, clone):
    """SLURM gives a job's --signal time neither in its environment nor in `scontrol show job`: the plan reads it from
    the batch script and warns when the checkpoint may take longer to save (plan/save_time.py)."""
    from test_save_grace import BIG, WRITE, big_checkpoint_bytes

    root, env = clone
    script = root / "validate.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --signal=B:USR1@5\n#SBATCH --output=slurm-%j.out\n"
                      f"opentau config validate {TINY} {shlex.join(BIG[1:])} --output_dir=validate-run\n")
    job = cluster.sbatch(script, NO_GPUS, cwd=root, env=env)
    cluster.wait(job, "COMPLETED")
    nbytes = big_checkpoint_bytes()
    needed = nbytes / WRITE
    warnings = [line for line in output(root, job).splitlines() if line.startswith("Warning: A checkpoint of")]
    assert warnings == [f"Warning: A checkpoint of {nbytes / 1e9:.1f} GB may take ~{needed:.0f} s to save (at 170 MB/s "
                        "to disk), more than the 5 s SLURM's --signal=B:USR1@5 gives before the job is killed: raise it "
                        f"(--signal=B:USR1@{int(needed * 1.5) + 30})."]
    assert not (root / "validate-run").exists()


def test_a_yaml_for_2_machines_in_a_1_node_job_is_refused_in_one_sentence(cluster, clone):
    root = clone[0]
    run = root / "mismatch"
    job = submit_2_nodes(cluster, clone, "slurm_2nodes_8gpus.sbatch", run, "--nodes=1")
    info = cluster.wait(job, "FAILED")
    assert info["ExitCode"] == "2:0"
    errors = [line for line in output(root, job).splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: Accelerate config '{CPU_2NODES}' says num_machines 2 and this SLURM job has 1 node "
                      "(SLURM_JOB_NUM_NODES): submit it with --nodes=2, or use a config whose num_machines is 1."]
    assert not run.exists()


def test_the_spot_job_preempted_continues_from_the_store_on_an_empty_disk(cluster, clone, reference, s3_server):
    root, env = clone
    run = root / "spot"
    remote = s3_server.url("runs/spot")
    job = cluster.sbatch("configs/examples/slurm_spot_remote.sbatch", NO_GPUS, cwd=root,
                         env={**env, **s3_server.env, "REMOTE": remote, "RUN_DIR": str(run),
                              "ACCELERATE_CONFIG": CPU_DDP})
    wait_for(lambda: training(run), "the first step")
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    cluster.wait(job, "COMPLETED")
    assert published(run) and published(run)[-1] < STEPS
    shutil.rmtree(run)  # the node went with its disk
    requeue_and_finish(cluster, job, 1)
    assert "Downloading checkpoint" in output(root, job)
    assert train_losses(run) == reference
    # The same command for another run (another seed) is refused before anything is downloaded or written.
    other = root / "other"
    result = run_cli(["train", f"--config_path={TINY}", f"--output_dir={other}", f"--checkpoint.remote={remote}",
                      "--seed=7", "--resume=auto"], cwd=root, env={**env, **s3_server.env})
    refused(result, f"checkpoint.remote {remote} holds another run (seed 1000 there, 7 here)",
            f"`opentau resume {remote}`")
    assert not other.exists()


SUBMITTED = ("slurm_2nodes_8gpus.sbatch", "slurm_elastic_2nodes_8gpus.sbatch", "slurm_spot_remote.sbatch")


def _arguments(code: str) -> list[str]:
    return shlex.split(code.replace("\\\n", " "), comments=True)


def test_every_readme_block_marked_slurm_is_what_these_tests_submit():
    """A `readme-test: slurm:` block is the weekend job (submitted above as it is), an `sbatch` of an example these
    tests submit, or the command of one (the spot job's requeue snippet: its arguments all in the script's)."""
    for block in (b for b in BLOCKS if b.slurm is not None):
        if "#SBATCH" in block.code:
            assert block.code == readme_weekend_job()
            continue
        words = _arguments(block.code)
        if words[0] == "sbatch":
            assert Path(words[1]).name in SUBMITTED and (REPO / words[1]).is_file(), block
            continue
        script = _arguments((EXAMPLES / "slurm_spot_remote.sbatch").read_text())
        assert words[:2] == ["opentau", "train"] and set(words) <= set(script), block
