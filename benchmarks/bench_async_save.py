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
Target: async loses <= 0.25x of what sync loses on a 2-core CPU machine (there the snapshot is a memory copy and the
writer competes with training for the cores), <= 0.05x on a GPU (a device-to-host copy).

    python benchmarks/bench_async_save.py            # pi05_small, a save every 2 steps, 6 rounds
    python benchmarks/bench_async_save.py --smoke    # tiny preset, 1 round (CI)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMALL_CONFIG, TINY_CONFIG, append_result, base_parser, print_rows, verdict  # noqa: E402

TARGET = 0.25
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


def measure(config: Path, workdir: Path, *, every: int, rounds: int, warmup: int) -> dict:
    from opentau_cli.checkpoint.manager import CheckpointManager
    from opentau_cli.config import AccelerateSetup, load_config
    from opentau_cli.train.trainer import build_trainer

    total = warmup + (rounds * len(KINDS) + 2) * every
    cfg = load_config(config, {"output_dir": str(workdir), "steps": str(total), "log_freq": str(10**6),
                               "logging.tensorboard": "false", "validation.val_freq": "0"})
    trainer = build_trainer(cfg, AccelerateSetup())
    acc, config_json = trainer.accelerator, cfg.to_json_dict()
    managers = {mode: CheckpointManager(acc, workdir / mode, total_steps=total, run_id=mode, keep_last=1,
                                        async_save=mode == "async") for mode in ("sync", "async")}
    rss = PeakRSS()

    def steps(n: int) -> None:
        for _ in range(n):
            trainer.train_step()
            managers["async"].poll()  # what the train loop does after every step

    def save(mode: str) -> float:
        start = time.perf_counter()
        managers[mode].save(trainer.step, config=config_json, state=trainer.state_dict())
        return time.perf_counter() - start

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
    first["async"] = save("async")  # also allocates its host copy
    managers["async"].wait()
    steps(every)
    segments: dict[str, list[tuple[float, float, int, float]]] = {k: [] for k in KINDS}
    for r in range(rounds):
        for kind in KINDS[r % 3:] + KINDS[:r % 3]:
            segments[kind].append(segment(kind))
            print(f"round {r + 1}: {kind:5s} {segments[kind][-1][0]:.2f} s", flush=True)
    rss.stop()
    peak["async"] = max(s[2] for s in segments["async"])
    snapshot = managers["async"].snapshot_bytes
    trainer.data.stream.close()
    return {"segments": segments, "first": first, "snapshot": snapshot, "peak": peak}


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--every", type=int, default=2, help="Steps per segment (save_freq).")
    parser.add_argument("--rounds", type=int, default=6, help="Rounds of the three kinds of segment.")
    parser.add_argument("--warmup", type=int, default=2, help="Steps before anything is timed.")
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    rounds = 1 if args.smoke else args.rounds
    load_before = os.getloadavg()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        result = measure(config, Path(tmp), every=args.every, rounds=rounds, warmup=args.warmup)
    took = time.perf_counter() - began
    seg = result["segments"]

    def median(kind: str, i: int = 0) -> float:
        return statistics.median(s[i] for s in seg[kind])

    def runs(kind: str) -> str:
        return ", ".join(f"{s[0]:.2f}" for s in seg[kind])

    paired = {mode: [a[0] - b[0] for a, b in zip(seg[mode], seg["none"])] for mode in ("sync", "async")}
    lost = {mode: statistics.median(paired[mode]) for mode in paired}
    ratio = lost["async"] / lost["sync"] if lost["sync"] > 0 else float("nan")
    mib = 2**20
    rows = [
        ("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), 1 process, segments of {args.every} steps, "
                   f"{rounds} rounds"),
        *[(f"segment, {label} (median s)", f"{median(kind):.2f} (runs: {runs(kind)})")
          for kind, label in (("none", "no save"), ("sync", "starts with a sync save"),
                              ("async", "starts with an async save, ends when it is published"))],
        ("save blocks the loop (median)", f"sync {median('sync', 1):.2f} s, async {median('async', 1):.2f} s "
                                          f"(first async save {result['first']['async']:.2f} s: allocates its copy)"),
        ("async: waited for the writer at the segment's end", f"median {median('async', 3):.2f} s (runs: "
                                                              f"{', '.join(f'{s[3]:.2f}' for s in seg['async'])})"),
        *[(f"training time lost per save, {mode}", f"{lost[mode]:.2f} s (median of the rounds': "
                                                     f"{', '.join(f'{d:.2f}' for d in paired[mode])})")
          for mode in ("sync", "async")],
        ("async / sync", f"{ratio:.2f}x (target <= {TARGET}x on a 2-core CPU machine: "
                         f"{verdict(ratio, TARGET, higher_is_better=False)})"),
        ("async snapshot in host memory", f"{result['snapshot'] / mib:.0f} MiB (allocated once, reused by every save)"),
        ("peak host memory (process RSS)", f"sync saves {result['peak']['sync'] / mib:.0f} MiB, async saves "
                                           f"{result['peak']['async'] / mib:.0f} MiB"),
        ("load average before / after", f"{load_before[0]:.1f} / {os.getloadavg()[0]:.1f}"),
    ]
    print_rows("Benchmark 5: asynchronous checkpoints", rows)
    if not args.no_append:
        notes = [f"whole comparison took {took:.0f} s",
                 "both managers keep_last=1; the sync peak is taken before the first async save, which makes the "
                 "host copy that the process then keeps"]
        if args.smoke:
            notes.insert(0, "smoke run: numbers only show the script works")
        append_result("Asynchronous checkpoints: training time lost per save, sync vs async_save", rows, notes,
                      path=args.results)


if __name__ == "__main__":
    main()
