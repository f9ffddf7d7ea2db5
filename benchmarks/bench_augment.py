"""Benchmark: the cost of openpi's image augmentation on the device (`dataset.augment: openpi`), one process.

`opentau profile` runs the same training config without and with `--dataset.augment=openpi`, alternating sides
`--rounds` times; the augmentation runs inside the step's data phase (Trainer.next_batch, after the batch reaches the
device), so the report puts the median step time and the median data phase of both sides next to each other, with
the ratio of step times and the augmentation's own milliseconds per step (the difference of the data phases).

    python benchmarks/bench_augment.py            # pi05_small, 3 cameras at 112 px, 3 warm-up + 10 steps, 2 rounds
    python benchmarks/bench_augment.py --smoke    # tiny preset, 1 + 2 steps, 1 round (CI)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, print_rows, profile, report  # noqa: E402

SIDES = {"without": [], "with": ["--dataset.augment=openpi"]}


def compare_rows(reports: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """Medians over rounds of each side's step time and data phase; the step-time ratio and the augmentation's cost."""
    step = {side: statistics.median(r["step_time_s"] for r in rs) for side, rs in reports.items()}
    data = {side: statistics.median(r["phases"]["data"]["median_s"] for r in rs) for side, rs in reports.items()}
    return [
        ("without augmentation", f"{step['without'] * 1000:.0f} ms/step (data phase {data['without'] * 1000:.1f} ms)"),
        ("with dataset.augment=openpi", f"{step['with'] * 1000:.0f} ms/step (data phase {data['with'] * 1000:.1f} ms)"),
        ("step time with / without", f"{step['with'] / step['without']:.3f}x"),
        ("augmentation per step", f"{(data['with'] - data['without']) * 1000:.1f} ms "
                                  f"({(data['with'] - data['without']) / step['without'] * 100:.1f}% of a step)"),
    ]


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cameras", type=int, default=3)
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    if args.smoke:
        args.steps, args.warmup, args.rounds, args.cameras = 2, 1, 1, 1
    reports: dict[str, list[dict]] = {side: [] for side in SIDES}
    wall = 0.0
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        for round_ in range(args.rounds):
            for side, extra in SIDES.items():
                # The demo dataset has one camera: every slot past it is padding, augmented like a real one.
                result, _, seconds = profile([f"--config_path={config}", "--steps", str(args.steps), "--warmup",
                                              str(args.warmup), f"--dataset.num_cameras={args.cameras}", *extra],
                                             Path(tmp) / f"{side}-{round_}.json")
                wall += seconds
                reports[side].append(result)
    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), 1 process, {args.cameras} camera slot(s), "
                       f"{args.warmup} warm-up + {args.steps} measured steps, {args.rounds} alternating round(s)")]
    rows += compare_rows(reports)
    step_ratio = dict(rows)["step time with / without"]
    print_rows("The cost of openpi's image augmentation on the device (1 process)", rows)
    report(args, "The cost of openpi's image augmentation: without and with dataset.augment=openpi", rows,
           [f"both sides took {wall:.0f} s", "the augmentation runs in the data phase, after the batch reaches the "
            "device; on CPU the device is the CPU"], Headline(f"{step_ratio} step time with / without dataset.augment=openpi"))


if __name__ == "__main__":
    main()
