"""Benchmark: what the `opentau` command spends planning a launch, with the policy's sizes built on the meta device
(transformers imported) vs read from the cache a launch of the same policy left (`plan/memory.py` `cached_sizes`;
on a machine with no GPU device file the cached side imports no torch either).

Each round runs `opentau config validate` of the tiny preset (the same planning `train` and `resume` do before
they launch) in a fresh process on each side: "built" with a cache that holds the memory plan's step measurement but
not the policy's sizes, "cached" with both. Each side's wall time and CPU time (user + system of the process, as
the kernel counts it for a finished child) are taken; sides alternate, so a change in the machine's load hits both
alike. The table gives each side's median and the ratios.

    python benchmarks/bench_plan.py            # 7 rounds per side
    python benchmarks/bench_plan.py --smoke    # 1 round (checks the script works)
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

SIDES = ("built", "cached")


def validate(cache: Path, out: Path) -> dict:
    """One `opentau config validate` with OPENTAU_CACHE_DIR=cache: its wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([opentau_bin(), "config", "validate", str(TINY_CONFIG), f"--output_dir={out}"],
                          capture_output=True, text=True, env={**env(), "OPENTAU_CACHE_DIR": str(cache)}, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"config validate failed:\n{proc.stderr[-3000:]}")
    return {"wall_s": wall, "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}


def without_sizes(warm: Path, cache: Path) -> Path:
    """A copy of the warm cache without the policy's sizes (its step measurement kept)."""
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(warm, cache)
    for entry in (cache / "memory_plan").glob("sizes_*.json"):
        entry.unlink()
    return cache


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        warm = work / "warm"
        validate(warm, work / "run")  # fills the cache: the step measurement and the sizes
        if not list((warm / "memory_plan").glob("sizes_*.json")):
            raise SystemExit("the first validate left no sizes in the cache")
        for _ in range(rounds):  # alternating, so a change in machine load hits both sides alike
            runs["built"].append(validate(without_sizes(warm, work / "built"), work / "run"))
            runs["cached"].append(validate(warm, work / "run"))
    report_compared(args, "Planning a launch: the policy's sizes built vs cached",
                    f"opentau config validate {TINY_CONFIG.name}; {rounds} round(s) per side in fresh processes, median; "
                    f"{os.cpu_count()} CPUs", runs, "CPU time of planning a launch, sizes cached / built")

if __name__ == "__main__":
    main()
