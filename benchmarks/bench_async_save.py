"""Benchmark 5, asynchronous checkpoints: training time lost per save, synchronous vs `checkpoint.async_save`.

One process builds the real trainer (train/trainer.py's build_trainer) and two CheckpointManagers, one synchronous and
one with async_save, and trains in segments of `--every` steps, as the train loop does (poll after every step): a
segment without a save, one that starts with a synchronous save, one that starts with an asynchronous save and ends
once that save is published. Segments rotate round by round, so a load that rises or falls favours none. The time
lost per save is the median over rounds of (segment with that save - the same round's segment without): segments of
a round run back to back, so they share the machine's load. The asynchronous one includes the copy into host memory,
what the background writer takes from training and any wait for it. Host memory: the snapshot async_save holds, and
the process's peak RSS (sampled) with synchronous saves only, before the first asynchronous save, and then with
asynchronous saves.

Three loads, one after the other, each for all of its rounds: quiet (the machine as it is); niced (a spinning process
per core at nice +10, as `nice` runs a background job); loaded (a spinning process per core at the training process's
own priority, as data workers keep a GPU node's cores busy). Loaded is where the writer process, below training's
priority, gets the least CPU: when the loop must wait for a save (here at each async segment's end, as the next save
would), it waits for that writer. Also measured: the
CPU seconds a save spends per GB, in the training thread (sync save; async copy into host memory) and in async_save's
writer process by phase (hashing, copying into the write buffer, write and sync calls, serializing): on a machine
whose cores are all busy, that is the floor of what any save costs.
The training process runs torch on one intra-op thread (--threads): on a GPU node its CPU work is one Python thread
launching kernels, and on this 2-core machine a pool of 2 OpenMP threads beside 2 spinning processes measures the
thread pool, not the save: a thread that waits at a barrier for a descheduled sibling turned 5 s segments into 43 s
ones whether or not a save ran (the 19:18 UTC run of 2026-12-01). The writer process runs at nice +10
(async_save.WRITER_NICE), as in training.
Targets on a 2-core CPU machine (there the snapshot is a memory copy and the writer competes with training for the
cores): async loses <= 0.25x of what sync loses quiet, <= 0.75x niced and loaded, and never more than sync (1.0x) in
any round; on a GPU <= 0.05x quiet (a device-to-host copy).

    python benchmarks/bench_async_save.py                  # pi05_small, a save every 2 steps, 6 rounds per load
    python benchmarks/bench_async_save.py --modes loaded   # the loaded third only
    python benchmarks/bench_async_save.py --smoke          # tiny preset, 1 round quiet and niced (CI)
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMALL_CONFIG, TINY_CONFIG, base_parser, combined, print_rows, ratio_headline, report, verdict  # noqa: E402

TARGETS = {"quiet": 0.25, "niced": 0.75, "loaded": 0.75}
CEILING = 1.0  # in any round, under any load: never worse than not being asynchronous
MODES = ("quiet", "niced", "loaded")
SPINNER_NICE = {"niced": 10, "loaded": 0}  # the spinning processes' nice value above the benchmark's
KINDS = ("none", "sync", "async")


class PeakRSS:
    """This process's resident set size, sampled every 10 ms by a thread; `reset` starts a new peak."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.now())

    def reset(self) -> None:
        self.peak = self.now()

    def stop(self) -> None:
        self._stop.set()


class Busy:
    """A spinning process per core, `nice` above this process's priority (0: the same; they inherit its nice value),
    while in the block: a machine whose cores are all taken, as data workers and other jobs take a GPU node's."""

    def __init__(self, nice: int = 0):
        self.nice = nice

    def __enter__(self) -> "Busy":
        spin = [sys.executable, "-c", f"import os; os.nice({self.nice})\nwhile True: pass"]
        self.procs = [subprocess.Popen(spin, stdin=subprocess.DEVNULL) for _ in range(os.cpu_count() or 1)]
        return self

    def __exit__(self, *_) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def measure(config: Path, workdir: Path, *, every: int, rounds: int, warmup: int, modes: list[str],
            batch: int | None = None) -> dict:
    from opentau_cli.config import AccelerateSetup, load_config
    from opentau_cli.train.manager import CheckpointManager
    from opentau_cli.train.trainer import build_trainer

    total = warmup + (len(modes) * rounds * len(KINDS) + 2) * every
    overrides = {"output_dir": str(workdir), "steps": str(total), "log_freq": str(10**6),
                 "logging.tensorboard": "false", "validation.val_freq": "0"}
    if batch is not None:  # a smaller batch: shorter steps, the same state to save
        overrides["batch_size"] = str(batch)
    cfg = load_config(config, overrides)
    trainer = build_trainer(cfg, AccelerateSetup())
    acc, config_json = trainer.accelerator, cfg.to_json_dict()
    managers = {mode: CheckpointManager(acc, workdir / mode, total_steps=total, run_id=mode, keep_last=1,
                                        async_save=mode == "async") for mode in ("sync", "async")}
    rss = PeakRSS()
    cpu = {"sync": [], "async": []}  # (CPU seconds of the training thread in the save call, bytes saved)

    def steps(n: int) -> None:
        for _ in range(n):
            trainer.train_step()
            managers["async"].poll()  # what the train loop does after every step

    def save(mode: str) -> float:
        start, began = time.perf_counter(), time.thread_time()
        path = managers[mode].save(trainer.step, config=config_json, state=trainer.state_dict())
        took, spent = time.perf_counter() - start, time.thread_time() - began
        if mode == "sync":
            cpu[mode].append((spent, sum(p.stat().st_size for p in path.rglob("*") if p.is_file())))
        else:
            cpu[mode].append((spent, managers[mode]._staging.tensor_bytes))
        return took

    def segment(kind: str) -> tuple[float, float, int, float]:
        """(seconds, seconds the save blocked the loop, peak RSS, seconds waited for the background writer at the
        end) of `every` steps after a save of this kind."""
        rss.reset()
        start, blocked, waited = time.perf_counter(), 0.0, 0.0
        if kind != "none":
            blocked = save(kind)
        steps(every)
        if kind == "async":
            waited = time.perf_counter()
            managers["async"].wait()
            waited = time.perf_counter() - waited
        return time.perf_counter() - start, blocked, rss.peak, waited

    rss.reset()
    steps(warmup)
    first = {"sync": save("sync")}
    steps(every)
    peak = {"sync": rss.peak}  # no host copy exists yet
    first["async"] = save("async")  # also allocates its host copy and starts the writer process
    managers["async"].wait()
    steps(every)
    for mode in cpu:
        cpu[mode].clear()  # the first saves allocate; the rounds' saves are the ones counted
    managers["async"]._staging.stats.clear()
    segments: dict[str, dict[str, list[tuple[float, float, int, float]]]] = {}
    loads: dict[str, tuple[float, float]] = {}
    for mode in modes:
        seg = segments[mode] = {k: [] for k in KINDS}
        before = os.getloadavg()[0]
        with Busy(SPINNER_NICE[mode]) if mode in SPINNER_NICE else contextlib.nullcontext():
            for r in range(rounds):
                for kind in KINDS[r % 3:] + KINDS[:r % 3]:
                    seg[kind].append(segment(kind))
                    print(f"{mode} round {r + 1}: {kind:5s} {seg[kind][-1][0]:.2f} s", flush=True)
        loads[mode] = (before, os.getloadavg()[0])
    rss.stop()
    peak["async"] = max(s[2] for seg in segments.values() for s in seg["async"])
    staging = managers["async"]._staging
    snapshot = (staging.nbytes, staging.tensor_bytes, staging.nbytes - staging.BOUNCE)
    writer = list(managers["async"]._staging.stats)
    trainer.data.stream.close()
    return {"segments": segments, "first": first, "snapshot": snapshot, "peak": peak, "cpu": cpu, "writer": writer,
            "loads": loads}


def lost_per_save(seg: dict) -> tuple[dict[str, list[float]], dict[str, float], list[float]]:
    """Per round, each mode's segment minus the same round's segment without a save; their medians; and each round's
    async / sync ratio."""
    paired = {mode: [a[0] - b[0] for a, b in zip(seg[mode], seg["none"])] for mode in ("sync", "async")}
    lost = {mode: statistics.median(paired[mode]) for mode in paired}
    per_round = [a / s if s > 0 else float("nan") for a, s in zip(paired["async"], paired["sync"])]
    return paired, lost, per_round


def swung_rounds(seg: dict, sync_lost: float) -> list[int]:
    """Rounds (1-based) whose segment without a save is further from the median of those segments than a sync save
    costs: there the load moved more than a save does, and the round's ratio measures the load, not the save."""
    middle = statistics.median(s[0] for s in seg["none"])
    return [r + 1 for r, s in enumerate(seg["none"]) if abs(s[0] - middle) > abs(sync_lost)]


def cpu_per_gb(result: dict) -> list[tuple[str, str]]:
    """CPU seconds per GB saved: the synchronous save (training thread), the async copy into host memory (training
    thread) and the async writer process by phase."""
    gb = 1e9

    def rate(pairs) -> str:
        spent, size = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        return f"{spent / (size / gb):.2f} CPU-s/GB" if size else "n/a"

    rows = [("save CPU per GB, sync (training thread: serialize, write, hash for the manifest)", rate(result["cpu"]["sync"])),
            ("save CPU per GB, async copy into host memory (training thread, blocks the loop)", rate(result["cpu"]["async"]))]
    writer = result["writer"]
    size = sum(w["bytes"] for w in writer)
    if size:
        phase = {k: sum(w[k] for w in writer) / (size / gb) for k in ("cpu", "hash", "copy", "write")}
        rest = phase["cpu"] - phase["hash"] - phase["copy"] - phase["write"]
        rows.append(("save CPU per GB, async writer process", f"{phase['cpu']:.2f} CPU-s/GB: hashing {phase['hash']:.2f}, "
                     f"copying into the write buffer {phase['copy']:.2f}, write and sync calls {phase['write']:.2f}, "
                     f"serializing and the rest {rest:.2f} ({size / gb:.2f} GB in {len(writer)} files)"))
    return rows


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--every", type=int, default=2, help="Steps per segment (save_freq).")
    parser.add_argument("--rounds", type=int, default=6, help="Rounds of the three kinds of segment, per load.")
    parser.add_argument("--warmup", type=int, default=2, help="Steps before anything is timed.")
    parser.add_argument("--batch", type=int, help="Samples per step (default: the config's); the saved state is the same.")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads in the training process (default 1: see the docstring).")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="quiet: the machine as it is; niced: a spinning process per core at nice +10 as well; "
                             "loaded: a spinning process per core at the benchmark's own priority as well.")
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    rounds = 1 if args.smoke else args.rounds
    if args.smoke and args.modes == list(MODES):  # the spinners' path once, at nice +10: CI's other launches go on
        args.modes = ["quiet", "niced"]
    import torch

    torch.set_num_threads(args.threads)
    uptime_before = uptime()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        result = measure(config, Path(tmp), every=args.every, rounds=rounds, warmup=args.warmup, modes=args.modes,
                         batch=args.batch)
    took = time.perf_counter() - began
    mib = 2**20
    batch = f", batch {args.batch}" if args.batch else ""
    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}{batch}), 1 process, {args.threads} torch "
                       f"thread{'s' if args.threads > 1 else ''}, segments of {args.every} steps, {rounds} rounds per "
                       f"load ({', '.join(args.modes)})")]
    headlines = []
    for mode in args.modes:
        seg = result["segments"][mode]
        prefix = "" if mode == "quiet" else f"{mode}: "
        target = TARGETS[mode]

        def median(kind: str, i: int = 0) -> float:
            return statistics.median(s[i] for s in seg[kind])

        def runs(kind: str, i: int = 0) -> str:
            return ", ".join(f"{s[i]:.2f}" for s in seg[kind])

        paired, lost, per_round = lost_per_save(seg)
        ratio = lost["async"] / lost["sync"] if lost["sync"] > 0 else float("nan")
        worst = max(per_round)
        swung = swung_rounds(seg, lost["sync"])
        headlines.append(ratio_headline(f"{prefix}async / sync, training time lost per save", ratio, target,
                                        higher_is_better=False))
        rows += [
            *[(f"{prefix}segment, {label} (median s)", f"{median(kind):.2f} (runs: {runs(kind)})")
              for kind, label in (("none", "no save"), ("sync", "starts with a sync save"),
                                  ("async", "starts with an async save, ends when it is published"))],
            (f"{prefix}save blocks the loop (median)", f"sync {median('sync', 1):.2f} s, async {median('async', 1):.2f} s"),
            (f"{prefix}async: waited for the writer at the segment's end", f"median {median('async', 3):.2f} s "
                                                                          f"(runs: {runs('async', 3)})"),
            *[(f"{prefix}training time lost per save, {m}", f"{lost[m]:.2f} s (median of the rounds': "
                                                            f"{', '.join(f'{d:.2f}' for d in paired[m])})")
              for m in ("sync", "async")],
            (f"{prefix}async / sync", f"{ratio:.2f}x (target <= {target}x on a 2-core CPU machine: "
                                      f"{verdict(ratio, target, higher_is_better=False)})"),
            (f"{prefix}async / sync, each round", f"{', '.join(f'{r:.2f}' for r in per_round)}x (worst {worst:.2f}x; "
                                                  f"never above {CEILING}x: {verdict(worst, CEILING, higher_is_better=False)})"),
            (f"{prefix}rounds the load swung more than a sync save costs", f"{len(swung)} of {len(per_round)}"
                                                                          + (f" (rounds {', '.join(map(str, swung))}: "
                                                                             "their ratios measure the load)" if swung else "")),
            (f"{prefix}load average before / after", "%.1f / %.1f" % result["loads"][mode]),
        ]
    rows += [
        ("first async save blocks the loop", f"{result['first']['async']:.2f} s (allocates its copy, starts the writer)"),
        *cpu_per_gb(result),
        ("async snapshot in host memory", "%.0f MiB: one buffer of %d bytes of tensors rounded up to %d (whole pages), "
                                          "and the 16 MiB write buffer (allocated once, reused by every save)"
                                          % (result["snapshot"][0] / mib, *result["snapshot"][1:])),
        ("peak host memory (process RSS)", f"sync saves {result['peak']['sync'] / mib:.0f} MiB, async saves "
                                           f"{result['peak']['async'] / mib:.0f} MiB"),
        ("uptime before / after", f"{uptime_before} / {uptime()}"),
    ]
    print_rows("Benchmark 5: asynchronous checkpoints", rows)
    report(args, "Asynchronous checkpoints: training time lost per save, sync vs async_save", rows,
           [f"whole comparison took {took:.0f} s",
            "both managers keep_last=1; the sync peak is taken before the first async save, which makes the host copy "
            "that the process then keeps; the writer process's memory is not in the RSS",
            "niced / loaded: one `while True: pass` process per core, at nice +10 / at the benchmark's priority, through "
            "all of that load's rounds"], combined(*headlines))


def uptime() -> str:
    """`uptime`'s line: the clock and the load averages the numbers were taken under."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average %.2f, %.2f, %.2f" % os.getloadavg()


if __name__ == "__main__":
    main()
