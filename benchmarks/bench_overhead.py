"""Benchmark 1, framework overhead: `opentau train` steps/s vs a minimal hand-written Accelerate loop.

Same model (pi05_small), batch and data, one process each, the same thread count. The two sides run at the same time
and take turns, one loop iteration each (tests/hooks): while one steps, the other waits in a blocking read,
using no CPU, so whatever else loads the machine falls on both alike, iteration by iteration (a shared machine's load
moves from minute to minute; run one after the other, the two sides met different loads and the ratio measured the
load). Each side's iteration is timed from the start of its step to the start of its next: opentau's whole loop (the
step, its metrics, logging, progress, checkpoint polling), the anchor benchmarks/handwritten_loop.py's step. Every
pair lasts `warmup` + the longest of `--steps` (15, 20 and 50 measured steps by default) and is timed over the first N
measured iterations for each N, side by side; `--pairs` pairs, the side that goes first alternating; the figure is the
median of the pairs' ratios, with their spread. Then `opentau profile` and the hand-written loop with --phases (timed
the same way: a device sync at both ends of each phase) give each phase's median time on both sides, which shows
where a gap comes from. Target: median ratio >= 0.97 at every run length.

Each round also pairs opentau train with EMA on (`--ema.decay=0.99`) and with TensorBoard on (a tracker that runs here
without a network) with a hand-written run of their own, so what each costs shows as its own ratio (`--variants`
picks them).

    python benchmarks/bench_overhead.py            # pi05_small, 5 pairs of 5 warm-up + 50 measured steps (15/20/50)
    python benchmarks/bench_overhead.py --smoke    # tiny preset, one pair of a few steps (CI)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, SMALL_CONFIG, TINY_CONFIG, base_parser, env, opentau_bin, print_rows, ratio_headline, report, run, verdict  # noqa: E402

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


def lockstep(config: Path, warmup: int, lengths: list[int], workdir: Path, extra: list[str], opentau_first: bool) -> dict:
    """One pair: `opentau train` (with `extra`) and the hand-written loop at the same time, taking turns one loop
    iteration each; each side's seconds per iteration over its first N measured iterations, for each N of `lengths`."""
    turns = workdir / "turns"
    shutil.rmtree(turns, ignore_errors=True)
    turns.mkdir(parents=True)
    for name in ("opentau", "hand"):
        os.mkfifo(turns / name)
    first = os.open(turns / ("opentau" if opentau_first else "hand"), os.O_RDWR)
    os.write(first, b"x")  # the first turn
    record, log = workdir / "opentau_turns.json", workdir / "opentau.log"
    steps = warmup + max(lengths) + 1  # one more step: the last measured iteration ends where a step starts
    with open(log, "w") as out:
        procs = {
            "opentau": subprocess.Popen(
                [opentau_bin(), "train", *train_args(config, warmup), f"--output_dir={workdir / 'run'}", "--overwrite=true",
                 f"--steps={steps}", f"--save_freq={10**9}", *extra],
                env={**env(), "PYTHONPATH": str(HERE.parent / "tests" / "hooks"), "BENCH_TURNS": f"{turns}:opentau:hand:{record}"},
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT),
            "hand-written": subprocess.Popen(
                [sys.executable, str(HERE / "handwritten_loop.py"), "--config", str(config), "--steps", str(max(lengths) + 1),
                 "--warmup", str(warmup), "--validation.val_freq=0", "--turns", f"{turns}:hand:opentau"],
                env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        }
        try:
            # A side that fails never gives the turn back: stop the other rather than wait for its timeout.
            while any(proc.poll() is None for proc in procs.values()):
                if any(proc.poll() not in (None, 0) for proc in procs.values()):
                    break
                time.sleep(0.5)
            hand_out, hand_err = procs["hand-written"].communicate(timeout=60) if procs["hand-written"].poll() is not None else ("", "")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            os.close(first)
    if procs["opentau"].returncode != 0 or procs["hand-written"].returncode != 0:
        raise SystemExit(f"a side failed (opentau {procs['opentau'].returncode}, hand-written "
                         f"{procs['hand-written'].returncode}):\n{log.read_text()[-3000:]}\n{hand_err[-3000:]}")
    spans = {"opentau": json.loads(record.read_text())["spans"],
             "hand-written": json.loads(hand_out.strip().splitlines()[-1])["spans"]}
    turns_held = sorted(span for held in spans.values() for span in held)
    if any(later[0] < earlier[1] for earlier, later in zip(turns_held, turns_held[1:])):
        raise SystemExit("the two sides' turns overlapped: the pair did not run in turns")
    return {side: {n: [end - start for start, end in held[warmup:warmup + n]] for n in lengths} for side, held in spans.items()}


def typical(seconds: list[float]) -> float:
    """Steps/s of a side's typical iteration: one over the median."""
    return 1 / statistics.median(seconds)


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
    parser.add_argument("--pairs", type=int, default=5, help="Pairs per side (opentau plain and each variant), each "
                                                             "with a hand-written partner taking turns with it.")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"opentau train variants run each round beside the plain run, comma-separated from "
                             f"{', '.join(VARIANTS)} ('none': the plain run only).")
    parser.add_argument("--no-phases", action="store_true", help="Skip the per-phase profile of both sides.")
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    if args.smoke:  # one variant: it shows the variants' path works (each costs a pair of launches); two run
        # lengths, the shortest possible, show the per-length rows
        args.steps, args.warmup, args.pairs, args.variants = "1,2", 1, 1, "ema"
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

    sides = ["opentau", *variants]
    held: dict[str, list[dict[int, list[float]]]] = {side: [] for side in sides}  # seconds per iteration, per pair
    partner: dict[str, list[dict[int, list[float]]]] = {side: [] for side in sides}  # each pair's hand-written side
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        for i in range(args.pairs):
            for side in sides:
                extra = VARIANTS[side][1] if side in VARIANTS else []
                pair = lockstep(config, args.warmup, lengths, Path(tmp), extra, opentau_first=i % 2 == 0)
                held[side].append(pair["opentau"])
                partner[side].append(pair["hand-written"])
            shown = "; ".join(f"{side} " + ", ".join(f"{typical(held[side][-1][n]) / typical(partner[side][-1][n]):.3f}"
                                                     for n in lengths) for side in sides)
            print(f"pair {i + 1}/{args.pairs} (ratios at {'/'.join(map(str, lengths))} steps): {shown}", flush=True)
        if not args.no_phases:
            ours_phases = opentau_phases(config, args.warmup, max(lengths), Path(tmp))
            anchor_phases = handwritten(config, args.warmup, lengths, phases=True)["phases"]
    load_after = os.getloadavg()

    def series(side: str, n: int, of_partner: bool = False, stat=None) -> list[float]:
        """Steps/s of each pair's side over its first n measured iterations: by its typical (median) iteration, or
        with `stat=sum` over the whole window."""
        runs = (partner if of_partner else held)[side]
        return [n / sum(run[n]) if stat is sum else typical(run[n]) for run in runs]

    def ratios(side: str, n: int, stat=None) -> list[float]:
        return [a / b for a, b in zip(series(side, n, stat=stat), series(side, n, of_partner=True, stat=stat))]

    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), {args.warmup} warm-up + "
                       f"{max(lengths)} measured steps per pair, timed over the first {', '.join(map(str, lengths))}; "
                       f"1 process per side, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"),
            ("load average (1 min) before / after", f"{load_before[0]:.2f} / {load_after[0]:.2f}")]
    for n in lengths:
        rows += [(f"{n} steps: hand-written Accelerate loop steps/s per pair", listed(series("opentau", n, of_partner=True))),
                 (f"{n} steps: opentau train steps/s per pair", listed(series("opentau", n))),
                 (f"{n} steps: ratio opentau / hand-written", ratio_row(ratios("opentau", n), TARGET)),
                 (f"{n} steps: ratios per pair", listed(ratios("opentau", n))),
                 (f"{n} steps: ratio of whole-window times (every iteration, load bursts included)",
                  ratio_row(ratios("opentau", n, stat=sum), None))]
    for side in variants:
        label = VARIANTS[side][0]
        for n in lengths:
            rows += [(f"{n} steps: ratio opentau, {label} / hand-written", ratio_row(ratios(side, n), None)),
                     (f"{n} steps: ratio opentau, {label} / opentau plain (each against its own hand-written partner)",
                      ratio_row([a / b for a, b in zip(ratios(side, n), ratios("opentau", n))], None))]
    if not args.no_phases:
        for name, label in PHASES.items():
            ours_phase, anchor_phase = ours_phases[name], anchor_phases[name]
            a, b = ours_phase["median_s"] * 1e3, anchor_phase["median_s"] * 1e3
            rows.append((f"phase {label} (median ms, share of step)",
                         f"opentau {a:.1f} ({ours_phase['share']:.1%}), hand-written {b:.1f} ({anchor_phase['share']:.1%}), "
                         f"difference {a - b:+.1f}"))
    print_rows("Benchmark 1: framework overhead", rows)
    notes = [f"each pair runs opentau train and the hand-written loop at the same time, taking turns one loop iteration "
             f"each (tests/hooks), the side that goes first alternating; steps/s per pair is one over the "
             f"side's median iteration over the first N measured (the typical step: a burst of other load lengthens "
             f"a few iterations of either side, not the median); each ratio is opentau's over its partner's at the "
             f"same run length; the whole-window row divides the sums instead; whole benchmark took "
             f"{time.perf_counter() - started:.0f} s"]
    if not args.no_phases:
        notes += ["phase rows: one `opentau profile` run and one `handwritten_loop.py --phases` run, each phase's "
                  "median over the measured steps (a device sync at both ends of every phase on both sides); the share "
                  "(of the mean step) holds still when a load slows a whole run",
                  "forward, backward and the optimizer run the same code on both sides, so their difference is the "
                  "load; opentau's own per-step work shows in data, zero-grad + scheduler, sync and other"]
    longest = ratios("opentau", max(lengths))
    report(args, "Framework overhead: opentau train vs hand-written Accelerate loop", rows, notes, ratio_headline(
        f"steps/s, opentau / hand-written, {max(lengths)} steps (median of {len(longest)} pair{'s' * (len(longest) > 1)})",
        statistics.median(longest), TARGET, digits=3))


if __name__ == "__main__":
    main()
