"""Run a profile through the training launcher (`opentau_cli.launch`): same YAML recipes, env, logs and errors.

Only the worker module differs: `opentau_cli.profiling.worker`, which calls TRAIN's per-rank setup and step loop
with a PhaseTimer and checkpoints off, then gathers every rank's timings into one result file.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from opentau_cli import launch
from opentau_cli.config import Validated
from opentau_cli.config.rules import cuda_is_available
from opentau_cli.errors import RunError, UserError
from opentau_cli.train.worker import USER_ERROR_MARK

PROFILE_WORKER = "opentau_cli.profiling.worker"
# The files a profile run exchanges with its workers, inside the scratch run (output) directory.
REQUEST_FILE = "profile_request.json"
RESULT_FILE = "profile_result.json"
OOM_FILE = "profile_oom_rank{rank}.json"


class OutOfMemory(RunError):
    """A profiled run ran out of device memory (or past --memory-limit)."""


def write_request(run_dir: Path, opts) -> None:
    request = {
        "warmup": opts.warmup,
        "steps": opts.steps,
        "count_flops": opts.count_flops,
        "memory_limit": opts.memory_limit,
    }
    (run_dir / REQUEST_FILE).write_text(json.dumps(request) + "\n")


def launch_profile(checked: Validated, opts, run_dir: Path) -> dict:
    """Launch the workers on `checked` (whose output_dir is run_dir); returns the gathered result."""
    plan = launch.RunPlan(checked)
    cuda = cuda_is_available()
    launch.prepare_output_dir(plan)
    write_request(run_dir, opts)
    log_dir = launch.new_log_dir(plan.config.output_dir)
    cfg_path, accel_path, launch_path = launch.write_launch_files(plan, log_dir, cuda)
    cmd = launch.build_command(accel_path, cfg_path, launch_path)
    cmd[cmd.index(launch.WORKER_MODULE)] = PROFILE_WORKER
    # Worker output goes to the rank logs; the launcher's own chatter to launcher.log (the report is what the user reads).
    with (log_dir / "launcher.log").open("w") as out:
        rc = subprocess.run(cmd, env=launch.worker_env(plan.setup, cuda), stdout=out, stderr=subprocess.STDOUT).returncode
    ooms = sorted(run_dir.glob(OOM_FILE.format(rank="*")))
    if ooms:
        detail = json.loads(ooms[0].read_text())
        raise OutOfMemory(f"Out of memory on rank {detail['rank']}: {detail['error']}")
    if rc != 0:
        log, last = launch.failed_log(log_dir)
        if log == log_dir:
            log = log_dir / "launcher.log"
        if last.startswith(USER_ERROR_MARK):  # a problem with the input found inside the worker (e.g. in the data)
            raise UserError(last[len(USER_ERROR_MARK):])
        reason = f": {last}" if last else f" (exit code {rc})"
        raise RunError(f"Profiling failed{reason}. Full log: {log}")
    result_path = run_dir / RESULT_FILE
    if not result_path.is_file():
        raise RunError(f"Profiling finished but wrote no results. Full log: {log_dir}")
    return json.loads(result_path.read_text())
