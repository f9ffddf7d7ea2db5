"""Benchmark 3: DDP vs DeepSpeed ZeRO-2 vs ZeRO-3 on 2 CPU processes, through `opentau profile --compare`.

Reports samples/s, step time, peak RSS per rank and the speedup vs DDP for the same training config (pi05_small).

    python benchmarks/bench_backends.py            # pi05_small, 3 warm-up + 10 measured steps per backend
    python benchmarks/bench_backends.py --smoke    # tiny preset, 1 + 1 steps (CI)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXAMPLES, SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, opentau_bin, print_rows, report, run  # noqa: E402

CONFIGS = [EXAMPLES / f"accelerate_cpu_{name}_config.yaml" for name in ("ddp", "deepspeed", "deepspeed_zero3")]


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    if args.smoke:  # one warm-up step (it counts the FLOPs) and one measured: every row and ratio is printed
        args.steps, args.warmup = 1, 1
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        out = Path(tmp) / "compare.json"
        proc, wall = run([opentau_bin(), "profile", f"--config_path={config}", "--compare", ",".join(map(str, CONFIGS)),
                          "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(out)])
        compared = json.loads(out.read_text())
    print(proc.stdout)
    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), 2 CPU processes, {args.warmup} warm-up + "
                       f"{args.steps} measured steps per backend, batch {compared['reports'][0]['global_batch_size']} global")]
    for r in compared["rows"]:
        rows.append((r["backend"], f"{r['samples_per_s']:.2f} samples/s, {r['step_time_s'] * 1000:.0f} ms/step, "
                                   f"peak RSS/rank {r['peak_memory_bytes'] / (1 << 20):.0f} MiB, {r['speedup']:.2f}x vs DDP"))
    print_rows("Benchmark 3: DDP vs ZeRO-2 vs ZeRO-3 (2 CPU processes)", rows)
    speedups = ", ".join(f"{r['backend'].removeprefix('DeepSpeed ')} {r['speedup']:.2f}x" for r in compared["rows"][1:])
    report(args, "Backends on 2 CPU processes: DDP vs ZeRO-2 vs ZeRO-3 (opentau profile --compare)", rows,
           [f"whole comparison took {wall:.0f} s", "peak RSS is each worker process's own peak (DataLoader workers not included)"],
           Headline(f"samples/s vs DDP: {speedups}"))


if __name__ == "__main__":
    main()
