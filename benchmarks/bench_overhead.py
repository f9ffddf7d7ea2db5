"""Benchmark 1, framework overhead: `opentau train` steps/s vs a minimal hand-written Accelerate loop.

Same model (pi05_small), batch and data, one process, the same thread count. The two sides run alternately, `--pairs`
pairs, the side that goes first swapping every pair (so a load that rises or falls during the benchmark favours
neither); each pair gives one ratio per run length, and the figure is the median of those ratios, with their spread.
Every run lasts `warmup` + the longest of `--steps` (15, 20 and 50 measured steps by default) and is timed over the
first N measured steps for each N, side by side: opentau's steps/s from outside, between its progress lines at step
`warmup` and `warmup + N` (it logs every `warmup` steps); the anchor, benchmarks/handwritten_loop.py, from its own
clock at the same steps. Then `opentau profile` and the hand-written loop with --phases (timed the same way: a device
sync at both ends of each phase) give each phase's median time on both sides, which shows where a gap comes from.
Target: median ratio >= 0.97 at every run length.

Each round also runs opentau train with EMA on (`--ema.decay=0.99`) and with TensorBoard on (a tracker that runs here
without a network), so what each costs shows as its own ratio to the same round's hand-written run, side by side
(`--variants` picks them; the order of the runs rotates every round).

    python benchmarks/bench_overhead.py            # pi05_small, 5 rounds of 5 warm-up + 50 measured steps (15/20/50)
    python benchmarks/bench_overhead.py --smoke    # tiny preset, one pair of a few steps (CI)
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, SMALL_CONFIG, TINY_CONFIG, append_result, base_parser, env, opentau_bin, print_rows, run, verdict  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = 0.97
# opentau train's variants beside the plain run (the overrides each adds), the target applying to the plain one.
VARIANTS = {"ema": ("EMA on (ema.decay 0.99)", ["--ema.decay=0.99"]),
            "tensorboard": ("TensorBoard on", ["--logging.tensorboard=true"])}
# The phases both sides report, in step order (opentau_cli.profiling.stats.REPORT_PHASES), and their labels.
PHASES = {"data": "data", "forward": "forward", "backward": "backward", "optimizer": "optimizer (clip + step)",
          "zero_grad_sched": "zero-grad + scheduler", "sync": "sync (metrics / loss read)", "other": "other",
          "total": "total step"}


def train_args(config: Path, warmup: int) -> list[str]:
    """Overrides both opentau commands get: log every `warmup` steps, no validation, no tensorboard, no LR warm-up."""
    return [f"--config_path={config}", f"--log_freq={warmup}", "--validation.val_freq=0", "--logging.tensorboard=false",
            "--logging.progress_bar=plain", "--scheduler.warmup_steps=0"]


def opentau_steps_per_s(config: Path, warmup: int, lengths: list[int], workdir: Path, extra: list[str] = ()) -> dict[int, float]:
    """Steps/s of a real `opentau train` run over its first N measured steps for each N of `lengths`, timed from
    outside: the arrival times of its progress lines at step `warmup` and `warmup + N` (so the loop's own logging,
    collectives and progress are all counted). `extra`: overrides after the benchmark's own (a variant's)."""
    cmd = [opentau_bin(), "train", *train_args(config, warmup), f"--output_dir={workdir / 'run'}", "--overwrite=true",
           f"--steps={warmup + max(lengths)}", f"--save_freq={10**9}", *extra]
    seen: dict[int, float] = {}
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"step (\d+)/\d+", line)
        if m:
            seen[int(m.group(1))] = time.perf_counter()
    if proc.wait() != 0 or any(warmup + n not in seen for n in [0, *lengths]):
        raise SystemExit(f"opentau train failed or logged no progress ({proc.returncode}):\n{''.join(lines[-30:])}")
    return {n: n / (seen[warmup + n] - seen[warmup]) for n in lengths}


def handwritten(config: Path, warmup: int, lengths: list[int], *, phases: bool = False) -> dict:
    """The hand-written loop's JSON line: steps_per_s over the longest length, `windows` (steps/s over the first N
    measured steps for each N) and with phases=True the per-phase statistics."""
    proc, _ = run([sys.executable, str(HERE / "handwritten_loop.py"), "--config", str(config), "--steps", str(max(lengths)),
                   "--warmup", str(warmup), "--windows", ",".join(map(str, lengths)), "--validation.val_freq=0",
                   *(["--phases"] if phases else [])])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def opentau_phases(config: Path, warmup: int, steps: int, workdir: Path) -> dict:
    """Per-phase statistics of `opentau profile` (the same training step as `train`, checkpoints off)."""
    out = workdir / "profile.json"
    run([opentau_bin(), "profile", *train_args(config, warmup), "--steps", str(steps), "--warmup", str(warmup),
         "--json", str(out)])
    return json.loads(out.read_text())["phases"]


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def listed(values: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in values)


def ratio_row(ratios: list[float], target: float | None) -> str:
    median = statistics.median(ratios)
    q1, q3 = quartiles(ratios)
    goal = f"; target >= {target}: {verdict(median, target)}" if target is not None else ""
    return (f"{median:.3f} median of {len(ratios)} pair{'s' * (len(ratios) > 1)} (min {min(ratios):.3f}, IQR "
            f"{q1:.3f}-{q3:.3f}, max {max(ratios):.3f}{goal})")


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", default="15,20,50", help="Measured steps, comma-separated run lengths, each a "
                                                            "multiple of --warmup: every run lasts the longest and is "
                                                            "timed over the first N measured steps for each.")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=5, help="Rounds of runs (hand-written, opentau and each variant), "
                                                             "the order rotating every round: each run and its round's "
                                                             "hand-written run are a pair.")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"opentau train variants run each round beside the plain run, comma-separated from "
                             f"{', '.join(VARIANTS)} ('none': the plain run only).")
    parser.add_argument("--no-phases", action="store_true", help="Skip the per-phase profile of both sides.")
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    if args.smoke:
        args.steps, args.warmup, args.pairs = "2,4", 2, 1
    try:
        lengths = sorted({int(n) for n in str(args.steps).split(",") if n.strip()})
    except ValueError:
        parser.error("--steps: comma-separated whole numbers, e.g. 15,20,50")
    if not lengths or any(n <= 0 or n % args.warmup for n in lengths):
        parser.error("--steps: every run length must be a positive multiple of --warmup (opentau logs every --warmup steps)")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    variants = [] if args.variants == "none" else [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)}, or none)")
    # opentau's launcher gives one process all the cores; the hand-written loop must get the same thread count.
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

    sides = ["opentau", "hand-written", *variants]
    speeds: dict[str, list[dict[int, float]]] = {side: [] for side in sides}
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        for i in range(args.pairs):
            # Rotate the order every round, so a load that rises or falls during the benchmark favours no side.
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                if side == "hand-written":
                    windows = handwritten(config, args.warmup, lengths)["windows"]
                    speeds[side].append({int(n): v for n, v in windows.items()})
                else:
                    extra = VARIANTS[side][1] if side in VARIANTS else []
                    speeds[side].append(opentau_steps_per_s(config, args.warmup, lengths, Path(tmp), extra))
            anchor = speeds["hand-written"][-1]
            shown = "; ".join(f"{side} " + ", ".join(f"{speeds[side][-1][n] / anchor[n]:.3f}" for n in lengths)
                              for side in sides if side != "hand-written")
            print(f"pair {i + 1}/{args.pairs} (ratios at {'/'.join(map(str, lengths))} steps): {shown}", flush=True)
        if not args.no_phases:
            ours_phases = opentau_phases(config, args.warmup, max(lengths), Path(tmp))
            anchor_phases = handwritten(config, args.warmup, lengths, phases=True)["phases"]
    load_after = os.getloadavg()

    def series(side: str, n: int) -> list[float]:
        return [run_speeds[n] for run_speeds in speeds[side]]

    def ratios(side: str, n: int, base: str = "hand-written") -> list[float]:
        return [a / b for a, b in zip(series(side, n), series(base, n))]

    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), {args.warmup} warm-up + "
                       f"{max(lengths)} measured steps per run, timed over the first {', '.join(map(str, lengths))}; "
                       f"1 process, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"),
            ("load average (1 min) before / after", f"{load_before[0]:.2f} / {load_after[0]:.2f}")]
    for n in lengths:
        rows += [(f"{n} steps: hand-written Accelerate loop steps/s per pair", listed(series("hand-written", n))),
                 (f"{n} steps: opentau train steps/s per pair", listed(series("opentau", n))),
                 (f"{n} steps: ratio opentau / hand-written", ratio_row(ratios("opentau", n), TARGET)),
                 (f"{n} steps: ratios per pair", listed(ratios("opentau", n)))]
    for side in variants:
        label = VARIANTS[side][0]
        for n in lengths:
            rows += [(f"{n} steps: ratio opentau, {label} / hand-written", ratio_row(ratios(side, n), None)),
                     (f"{n} steps: ratio opentau, {label} / opentau plain", ratio_row(ratios(side, n, "opentau"), None))]
    if not args.no_phases:
        for name, label in PHASES.items():
            ours_phase, anchor_phase = ours_phases[name], anchor_phases[name]
            a, b = ours_phase["median_s"] * 1e3, anchor_phase["median_s"] * 1e3
            rows.append((f"phase {label} (median ms, share of step)",
                         f"opentau {a:.1f} ({ours_phase['share']:.1%}), hand-written {b:.1f} ({anchor_phase['share']:.1%}), "
                         f"difference {a - b:+.1f}"))
    print_rows("Benchmark 1: framework overhead", rows)
    if not args.no_append:
        notes = [f"the runs of a round rotate which goes first; each ratio is a run's steps/s over the same round's "
                 f"hand-written run at the same run length; whole benchmark took {time.perf_counter() - started:.0f} s"]
        if not args.no_phases:
            notes += ["phase rows: one `opentau profile` run and one `handwritten_loop.py --phases` run, each phase's "
                      "median over the measured steps (a device sync at both ends of every phase on both sides); the share "
                      "(of the mean step) holds still when a load slows a whole run",
                      "forward, backward and the optimizer run the same code on both sides, so their difference is the "
                      "load; opentau's own per-step work shows in data, zero-grad + scheduler, sync and other"]
        if args.smoke:
            notes.append("smoke run: numbers only show the script works")
        append_result("Framework overhead: opentau train vs hand-written Accelerate loop", rows, notes, path=args.results)


if __name__ == "__main__":
    main()
