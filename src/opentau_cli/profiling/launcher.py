"""Run a profile through the training launcher (`opentau_cli.launch.run`): same YAML recipes, env, logs and errors.

Only the worker differs: `opentau_cli.profiling.worker`, which runs TRAIN's `Trainer.train_step` with a phase timer
and no checkpoints, then gathers every rank's timings into one result file. The request and the result travel as
JSON files in the scratch run (output) directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from opentau_cli.config import Validated
from opentau_cli.errors import RunError
from opentau_cli.process import launch
from opentau_cli.process.launch import RunPlan

# The launcher's output goes to the log: the report is what the user reads (and --json - must stay pure JSON).
PROFILE_WORKER = launch.Worker("opentau_cli.profiling.worker", "Profiling", console=False)
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
    write_request(run_dir, opts)
    try:
        code = launch.run(RunPlan(checked), worker=PROFILE_WORKER, echo=lambda _message: None)
    except RunError:
        ooms = sorted(run_dir.glob(OOM_FILE.format(rank="*")))
        if ooms:  # the rank that ran out of memory wrote why; the others only lost their peer
            detail = json.loads(ooms[0].read_text())
            raise OutOfMemory(f"Out of memory on rank {detail['rank']}: {detail['error']}") from None
        raise
    if code == 130:
        raise KeyboardInterrupt
    result_path = run_dir / RESULT_FILE
    if not result_path.is_file():
        raise RunError(f"Profiling finished but wrote no results. Full log: {run_dir / 'logs'}")
    return json.loads(result_path.read_text())
