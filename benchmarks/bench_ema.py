"""Benchmark: the cost of the EMA of the weights (`ema.decay`) under DDP and DeepSpeed ZeRO-3, 2 CPU processes.

`opentau profile --compare` runs the same training config under both backends twice, without and with
`--ema.decay=0.99` (the profile worker trains with the same Trainer, so the EMA update after each optimizer step is
in the measured step), and the report puts them side by side: step time, samples/s and peak RSS per rank, with the
EMA's ratio of step time and the extra memory per rank. Expected: the extra memory is one fp32 copy of what trains
(under DDP, on every rank: all of it; under ZeRO-3, each rank's partition: about 1 / processes of it).

    python benchmarks/bench_ema.py            # pi05_small, 3 warm-up + 10 measured steps per backend and side
    python benchmarks/bench_ema.py --smoke    # tiny preset, 1 + 2 steps, DDP only (CI: ZeRO-3's EMA is tested e2e)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXAMPLES, SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, print_rows, profile, report  # noqa: E402

BACKENDS = {"DDP": EXAMPLES / "accelerate_cpu_ddp_config.yaml", "ZeRO-3": EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"}
DECAY = 0.99  # openpi's default


def compare_rows(without: list[dict], with_ema: list[dict]) -> list[tuple[str, str]]:
    """One row per backend: both sides, the step-time ratio and the extra peak RSS per rank (MiB)."""
    rows = []
    for name, off, on in zip(BACKENDS, without, with_ema):
        ratio = on["step_time_s"] / off["step_time_s"]
        extra = (on["peak_memory_bytes"] - off["peak_memory_bytes"]) / (1 << 20)
        rows.append((name, f"without {off['step_time_s'] * 1000:.0f} ms/step, {off['samples_per_s']:.2f} samples/s, "
                           f"{off['peak_memory_bytes'] / (1 << 20):.0f} MiB/rank; with EMA {on['step_time_s'] * 1000:.0f} "
                           f"ms/step, {on['samples_per_s']:.2f} samples/s, {on['peak_memory_bytes'] / (1 << 20):.0f} "
                           f"MiB/rank; step time {ratio:.3f}x, memory {extra:+.0f} MiB/rank"))
    return rows


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    backends = BACKENDS
    if args.smoke:  # checks the script works: one backend halves its launches (compare_rows is tested on both)
        args.steps, args.warmup, backends = 2, 1, {"DDP": BACKENDS["DDP"]}
    sides, walls = {}, []
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        for side, extra in (("without", []), ("with", [f"--ema.decay={DECAY}"])):
            result, proc, wall = profile([f"--config_path={config}", "--compare", ",".join(map(str, backends.values())),
                                          "--steps", str(args.steps), "--warmup", str(args.warmup), *extra],
                                         Path(tmp) / f"{side}.json")
            print(proc.stdout)
            sides[side] = result["rows"]
            walls.append(wall)
    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), 2 CPU processes, {args.warmup} warm-up + "
                       f"{args.steps} measured steps per backend and side, ema.decay={DECAY}")]
    rows += compare_rows(sides["without"], sides["with"])
    ratios = ", ".join(f"{name} {on['step_time_s'] / off['step_time_s']:.3f}x"
                       for name, off, on in zip(backends, sides["without"], sides["with"]))
    print_rows("The cost of the EMA of the weights (2 CPU processes)", rows)
    report(args, "The cost of the EMA of the weights: DDP and ZeRO-3, without and with ema.decay", rows,
           [f"both sides took {sum(walls):.0f} s", "peak RSS is each worker process's own peak (DataLoader workers "
            "not included); the EMA is one fp32 copy of what the rank averages"],
           Headline(f"step time with / without EMA: {ratios}"))


if __name__ == "__main__":
    main()
