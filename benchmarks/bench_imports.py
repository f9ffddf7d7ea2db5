"""Benchmark: what a rank (and every command that builds a policy) spends importing its libraries, with the garbage
collector running as usual vs paused during the imports (`opentau_cli.runtime.import_paused`, as the ranks and
`opentau_cli.policies` do).

Each side imports the same modules in the same order in a fresh interpreter: what every rank imports before it
builds anything (`runtime.RANK_IMPORTS`: opentau's config, torch, accelerate, DeepSpeed, opentau_cli.policies with
transformers' Gemma and PaliGemma). "collector running" imports them with plain `importlib.import_module`, as before
the change; "collector paused" as a DeepSpeed launch's rank (`runtime.import_rank_libraries`, through
`import_paused`) with every module its libraries import at their own import (as before MLflow was kept out of
DeepSpeed's); "MLflow kept out" as a DeepSpeed launch's ranks now do (`runtime.UNUSED_IMPORTS`: DeepSpeed's
autotuner imports MLflow whenever it is installed); "DeepSpeed kept out" as a single, DDP or FSDP2 launch's ranks now
do (`runtime.import_rank_libraries`: no DeepSpeed, which Accelerate's unwrap_model would import later). Each child
reports the wall time and the process's CPU time (user + system) of the imports, and the full collections the
collector made meanwhile. Sides alternate, so a change in the machine's load hits both alike; the table gives each
side's median and the ratios.

    python benchmarks/bench_imports.py            # 7 rounds per side
    python benchmarks/bench_imports.py --smoke    # 1 round (checks the script works)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Headline, base_parser, env, print_rows, report, rounds_note  # noqa: E402

from opentau_cli.process.runtime import RANK_IMPORTS as MODULES  # noqa: E402

SIDES = ("collector running", "collector paused", "MLflow kept out", "DeepSpeed kept out")


def child(side: str) -> None:
    """One side in this (fresh) process: prints its measurements as one JSON line."""
    import gc
    import importlib
    import os
    import time

    start, cpu = time.perf_counter(), os.times()
    if side == SIDES[0]:
        for name in MODULES:
            importlib.import_module(name)
    else:
        from opentau_cli.process import runtime

        if side == SIDES[1]:
            runtime.UNUSED_IMPORTS = {}
        runtime.import_rank_libraries("ddp" if side == SIDES[3] else "deepspeed")  # what the ranks call
    wall, after = time.perf_counter() - start, os.times()
    print(json.dumps({"wall_s": wall, "cpu_s": after.user + after.system - cpu.user - cpu.system,
                      "full_collections": gc.get_stats()[2]["collections"]}))


def measure(side: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", side], capture_output=True, text=True, env=env(),
                          timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_rows(runs: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """Each side's median wall and CPU seconds and full collections over its rounds, then paused / running."""
    median = {side: {k: statistics.median(r[k] for r in rounds) for k in ("wall_s", "cpu_s", "full_collections")}
              for side, rounds in runs.items()}
    rows = []
    for side in median:
        m = median[side]
        rows.append((f"{side}: wall time", f"{m['wall_s']:.2f} s"))
        rows.append((f"{side}: CPU time", f"{m['cpu_s']:.2f} s"))
        rows.append((f"{side}: full collections", f"{m['full_collections']:.0f}"))
    old, new = median[SIDES[0]], median[SIDES[1]]
    rows.append(("paused / running: wall time", f"{new['wall_s'] / old['wall_s']:.2f}x"))
    rows.append(("paused / running: CPU time", f"{new['cpu_s'] / old['cpu_s']:.2f}x"))
    if SIDES[2] in median:
        out = median[SIDES[2]]
        rows.append(("MLflow kept out / paused: wall time", f"{out['wall_s'] / new['wall_s']:.2f}x"))
        rows.append(("MLflow kept out / paused: CPU time", f"{out['cpu_s'] / new['cpu_s']:.2f}x"))
    if SIDES[3] in median:
        ddp, deepspeed = median[SIDES[3]], median[SIDES[2]]
        rows.append(("DeepSpeed kept out / MLflow kept out: wall time", f"{ddp['wall_s'] / deepspeed['wall_s']:.2f}x"))
        rows.append(("DeepSpeed kept out / MLflow kept out: CPU time", f"{ddp['cpu_s'] / deepspeed['cpu_s']:.2f}x"))
    return rows


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    parser = base_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(rounds):  # alternating, so a change in machine load hits both sides alike
        for side in SIDES:
            runs[side].append(measure(side))
    rows = [("imports", f"{', '.join(MODULES)} (DeepSpeed kept out: without deepspeed); {rounds} round(s) per side in "
                        "fresh processes, median")]
    rows += compare_rows(runs)
    title = "Start-up imports: collector running vs paused, and MLflow kept out"
    print_rows(title, rows)
    report(args, title, rows, [rounds_note(runs)],
           Headline(f"{dict(rows)['DeepSpeed kept out / MLflow kept out: CPU time']} rank import CPU time, a DDP rank "
                    "(DeepSpeed kept out) / a DeepSpeed rank"))


if __name__ == "__main__":
    main()
