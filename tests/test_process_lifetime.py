"""The ranks of a run die with their launcher (docs/ARCHITECTURE.md, "Per-rank runtime"): torch's elastic agent starts
each rank in a session of its own, so a SIGKILL of `opentau train`'s process group (a scheduler, the OOM killer, a
user's `kill -9 -- -PGID`) used to leave both ranks training as orphans, publishing checkpoints into a run whose lock
had died with the launcher. Here real 2-process launches (DDP saving synchronously, ZeRO-2 asynchronously) are killed
so once their first checkpoint exists (the process group, or the CLI process alone): within 5 s
no process of the run is left (found from outside, by their command lines), every published checkpoint verifies and
`opentau resume` continues from `last`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from conftest import EXAMPLES, command_line, opentau_bin, run_cli
from opentau_cli.store.layout import CHECKPOINTS, METRICS, read_last

pytestmark = [pytest.mark.quick, pytest.mark.e2e, pytest.mark.timeout(600)]


def _processes_of(run) -> list[psutil.Process]:
    """Every live process whose command line names the run directory (the CLI, the launcher, the ranks)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and str(run) in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.parametrize("yaml, extra, whom", [
    ("accelerate_cpu_ddp_config.yaml", [], "group"),  # kill -9 -- -PGID: the CLI and Accelerate's launcher at once
    # The CLI alone (an OOM kill). The whole suite only: a minute of two DeepSpeed launches, the quick tier's longest.
    pytest.param("accelerate_cpu_deepspeed_config.yaml", ["--checkpoint.async_save=true"], "cli", marks=pytest.mark.full),
], ids=["ddp-sync-process-group", "zero2-async-the-cli-alone"])
def test_a_sigkill_of_the_launch_leaves_no_rank_and_the_run_resumes_from_last(tmp_path, yaml, extra, whom):
    run = tmp_path / "run"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home")}
    env.pop("OPENTAU_DEBUG", None)
    args = [opentau_bin(), "train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={run}",
            f"--accelerate-config={EXAMPLES / yaml}", "--steps=100000", "--save_freq=2", "--log_freq=1",
            "--batch_size=4", "--validation.val_freq=0", "--checkpoint.keep_last=2", *extra]
    launch = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / CHECKPOINTS / "000002").is_dir():
            assert launch.poll() is None and time.monotonic() < deadline, "the run ended or never saved"
            time.sleep(0.2)
        ranks = [p for p in _processes_of(run) if "opentau_cli.train.worker" in " ".join(p.info["cmdline"])
                 and "accelerate_launcher" not in " ".join(p.info["cmdline"])]  # the launcher names the worker module too
        assert len(ranks) == 2
        # Everything the launch started (launcher, ranks, their data workers, an async writer), found from outside.
        descendants = psutil.Process(launch.pid).children(recursive=True)
        assert set(ranks) <= set(descendants)
        if whom == "group":
            os.killpg(launch.pid, signal.SIGKILL)
        else:
            launch.kill()
        launch.wait(timeout=30)
        gone, alive = psutil.wait_procs(descendants, timeout=5)
        left = [(p.pid, " ".join(line)[:120]) for p in alive if (line := command_line(p)) is not None]
        assert left == [], f"processes of the run outlived their launcher: {left}"
    finally:
        for proc in _processes_of(run):  # whatever the assertion saw, nothing of this run keeps training
            proc.kill()
    assert _processes_of(run) == []

    verified = run_cli(["checkpoint", "verify", str(run)], env={"HF_HOME": str(tmp_path / "hf_home")})
    assert verified.returncode == 0, verified.stdout + verified.stderr
    last = int(read_last(run / CHECKPOINTS))
    resumed = run_cli(["resume", str(run), f"--steps={last + 2}"], env={"HF_HOME": str(tmp_path / "hf_home")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / METRICS).read_text().splitlines() if '"train"' in line]
    assert steps[-2:] == [last + 1, last + 2]
