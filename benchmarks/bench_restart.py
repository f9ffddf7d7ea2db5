"""Benchmark: how long an automatic restart takes, from a rank's death to the first step after it, in parts.

A real 2-process DDP launch of `opentau train --max-restarts=1` on pi05_small (the tiny preset with --smoke); rank 1
SIGKILLs itself at the start of step 6 (after checkpoint 4; tests/hooks, which notes the wall-clock time of each
moment in rank 1). The parts, each from two timestamps taken outside the product's own accounting:

- detection: the death -> torch's elastic agent logs the failure (its own timestamp in launcher.log);
- re-forming: the agent's log line -> the restarted rank's interpreter starts (the other ranks stopped, the c10d
  rendezvous re-formed, a new process spawned);
- start-up and restore: interpreter start -> the first step begins (imports, building the policy, the restart's
  checks and the checkpoint's load);
- first step: the first step after the restart, start to end.

For comparison, the same rank's start-up on the launch's first attempt (interpreter start -> first step) shows what
the restore adds to an ordinary start.

    python benchmarks/bench_restart.py            # pi05_small
    python benchmarks/bench_restart.py --smoke    # tiny preset (CI)
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXAMPLES, REPO, SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, env, opentau_bin, print_rows, report  # noqa: E402

HOOKS = REPO / "tests" / "hooks"  # the fault-injection helper: TEST_FAULT kills rank 1
KILL_STEP = 6
# The agent's log prefix (glog style, local time): "E1203 14:08:12.123000 <pid> <file>:<line>] failed (exitcode: ..."
AGENT_FAILED = re.compile(r"^E(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) .*\] failed \(exitcode", re.M)


def agent_failure_time(launcher_log: Path) -> float:
    m = AGENT_FAILED.search(launcher_log.read_text(errors="replace"))
    if m is None:
        raise SystemExit(f"no failure line from the elastic agent in {launcher_log}")
    month, day, hour, minute, second, frac = m.groups()
    now = dt.datetime.now()
    when = dt.datetime(now.year, int(month), int(day), int(hour), int(minute), int(second), int(frac[:6].ljust(6, "0")))
    return when.timestamp()


def measure(config: Path, steps: int, workdir: Path) -> dict[str, float]:
    run_dir = workdir / "run"
    times = workdir / "times.jsonl"
    e = {**env(), "PYTHONPATH": str(HOOKS), "TEST_FAULT": f"kill@{KILL_STEP}:0", "TEST_FAULT_RANK": "1",
         "TEST_FAULT_TIMES": str(times), "HF_HOME": str(workdir / "hf_home")}
    args = [opentau_bin(), "train", f"--config_path={config}", f"--output_dir={run_dir}",
            f"--accelerate-config={EXAMPLES / 'accelerate_cpu_ddp_config.yaml'}", f"--steps={steps}", "--save_freq=4",
            "--log_freq=1", "--validation.val_freq=0", "--max-restarts=1"]
    proc = subprocess.run(args, capture_output=True, text=True, env=e, cwd=REPO, timeout=3600)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"the restarted run failed ({proc.returncode})")
    events = [json.loads(line) for line in times.read_text().splitlines()]

    def at(event: str, attempt: int) -> float:
        return next(e["t"] for e in events if e["event"] == event and e["attempt"] == attempt)

    failed = agent_failure_time(next(run_dir.glob("logs/*/launcher.log")))
    died = at("kill", 0)
    return {"detection": failed - died, "re-forming": at("start", 1) - failed,
            "start-up and restore": at("first_step_start", 1) - at("start", 1),
            "first step": at("first_step_end", 1) - at("first_step_start", 1),
            "total": at("first_step_end", 1) - died,
            "first attempt's start-up": at("first_step_start", 0) - at("start", 0)}


def main() -> None:
    parser = base_parser(__doc__)
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    with tempfile.TemporaryDirectory(prefix="bench_restart_") as tmp:
        parts = measure(config, 8, Path(tmp))
    rows = [(k, f"{v:.2f} s") for k, v in parts.items()]
    title = f"Restart: a rank's death to the first step after it ({config.stem}, DDP x2, CPU)"
    print_rows(title, rows)
    report(args, title, rows, [
        f"rank 1 SIGKILLs itself at the start of step {KILL_STEP}; the group restarts from checkpoint 4",
        "detection is the elastic agent's monitor interval (1 s) plus its teardown of the other rank; start-up and "
        "restore includes verifying the checkpoint's hashes"],
           Headline(f"{parts['total']:.2f} s from a rank's death to the first step after it"))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
