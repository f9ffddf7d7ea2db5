"""Benchmark: two single-process tiny trainings at once on the machine's cores, with OpenMP's default wait policy vs
OMP_WAIT_POLICY=PASSIVE, which scripts/test.sh sets for the suite (docs/development.md, "Reading the timing print").

Each round starts two `opentau train` of the tiny preset together, each one process computing on torch's threads
(one per core), and waits for both: the CPU time of all their processes (user + system, as the kernel counts
finished children) and the wall time until both ended. Sides alternate, so a change in the machine's load hits both
alike. The table gives each side's median and passive / default. Run it on an otherwise idle machine.

    python benchmarks/bench_omp_wait.py            # 3 rounds per side, 30 steps per training
    python benchmarks/bench_omp_wait.py --smoke    # 1 round of 2 steps (checks the script works)
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY_CONFIG, base_parser, env, opentau_bin, report_compared  # noqa: E402

SIDES = {"default": None, "passive": "PASSIVE"}  # OMP_WAIT_POLICY: unset (OpenMP's default) / PASSIVE


def two_trainings(work: Path, steps: int, policy: str | None) -> dict:
    """Two `opentau train` started together with OMP_WAIT_POLICY=policy (unset: None): wall and CPU seconds."""
    side_env = env()
    side_env.pop("OMP_WAIT_POLICY", None)
    if policy:
        side_env["OMP_WAIT_POLICY"] = policy
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    procs = []
    for i in range(2):
        out = work / f"run{i}"
        shutil.rmtree(out, ignore_errors=True)
        procs.append(subprocess.Popen([opentau_bin(), "train", f"--config_path={TINY_CONFIG}", f"--output_dir={out}",
                                       f"--steps={steps}", f"--save_freq={steps}"], env=side_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    said = [proc.communicate(timeout=1800)[0] for proc in procs]
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for proc, text in zip(procs, said):
        if proc.returncode != 0:
            raise SystemExit(f"opentau train failed ({proc.returncode}):\n{text[-3000:]}")
    return {"wall_s": wall, "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rounds, steps = (1, 2) if args.smoke else (args.rounds, args.steps)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        work = Path(tmp)
        if not args.smoke:
            two_trainings(work, 2, "PASSIVE")  # the demo data and the memory plan cached before any round is timed
        for _ in range(rounds):  # alternating, so a change in machine load hits both sides alike
            for side, policy in SIDES.items():
                runs[side].append(two_trainings(work, steps, policy))
    report_compared(args, "OpenMP's wait policy: two single-process trainings at once, default vs PASSIVE",
                    f"two `opentau train {TINY_CONFIG.name} --steps={steps}` at once, one process each; {rounds} round(s) "
                    f"per side, median; {os.cpu_count()} CPUs", runs,
                    "CPU time of two concurrent trainings, PASSIVE / default")

if __name__ == "__main__":
    main()
