"""A dataset read from object storage vs the same files on local disk, through the same pipeline.

Against a local SeaweedFS (tests/s3_server.py) at nice 19 (it stands for another machine), each dataset is read one epoch at a time the way a rank reads it:
the pre-launch check (data/check.py, which pins the store's versions), `build_data`, then every batch of one epoch
through the DataLoader with --workers data worker processes (fresh workers, so no decoded frame is reused between
epochs). Three sides per round, in alternating order: from local disk; from the store with an empty cache (cold:
every data and video file fetched on first use); from the store again with the cache filled by the cold epoch
(warm). The table gives each side's median samples/s over the rounds and the median of the per-round ratios to local
disk; the cache's peak size on disk (sampled every few ms by walking it) against dataset.cache_max_gb. A last
cold epoch runs with a cap of half the dataset, so files are evicted and fetched again within the epoch.

Datasets: the real g1 (AV1 480x640, 3 long episodes: decoding dominates) when it sits next to the checkout, and a
synthetic H.264 64x64 one with many short episodes (a file to fetch every few samples: the store's share is largest).

    python benchmarks/bench_data_remote.py             # 3 rounds, 2 workers
    python benchmarks/bench_data_remote.py --smoke     # the synthetic dataset, small, one round (CI)
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import REPO, base_parser, combined, print_rows, ratio_headline, report, verdict  # noqa: E402
from s3_server import S3Server  # noqa: E402
from test_data_remote import on_disk, upload  # noqa: E402 (the tests' own walk of a folder and plain upload)

G1 = REPO.parent / "shared" / "data" / "g1_pick_bottle_v21"
COLD_TARGET, WARM_TARGET = 0.8, 0.95
TITLE = "Datasets in object storage: an epoch from a local S3 server vs from local disk"


def epoch(root: str, workers: int, batch: int, resolution: int, cap_gb: float, cache: Path, wide: bool) -> dict:
    """One epoch as a rank reads it: {samples, seconds (the epoch's batches), check_s (pre-launch check + build),
    peak (the cache's bytes on disk)}."""
    from opentau_cli.config.load import load_config
    from opentau_cli.data import build_data
    from opentau_cli.data.check import check_dataset

    os.environ["OPENTAU_CACHE_DIR"] = str(cache)
    dims = 32 if wide else 8
    cfg = load_config(None, [
        "--policy.preset=pi05_tiny", "--policy.chunk_size=10", "--policy.n_action_steps=10",
        f"--policy.max_state_dim={dims}", f"--policy.max_action_dim={dims}",
        f"--policy.image_resolution=[{resolution},{resolution}]", f"--batch_size={batch}",
        f"--dataset.num_workers={workers}", "--validation.val_split=0", f"--dataset.root={root}",
        f"--dataset.cache_max_gb={cap_gb}"])
    peak, stop = multiprocessing.Value("q", 0), multiprocessing.Event()
    sampler = multiprocessing.get_context("fork").Process(target=measure, args=(cache / "datasets", peak, stop))
    sampler.start()
    try:
        started = time.perf_counter()
        problems = check_dataset(cfg)
        assert not problems, problems
        data = build_data(cfg)
        checked = time.perf_counter() - started
        try:
            stream = data.stream
            batches = stream.batches_per_epoch
            started = time.perf_counter()
            samples = sum(len(next(stream)["state"]) for _ in range(batches))
            seconds = time.perf_counter() - started
        finally:
            data.stream.close()
    finally:
        stop.set()
        sampler.join()
    return {"samples": samples, "seconds": seconds, "check_s": checked, "peak": peak.value}


def measure(folder: Path, peak, stop) -> None:
    """The folder's bytes on disk, every few ms, from a process at the lowest priority: the walk takes little from
    the epoch it measures (a thread of the reading process walking every 2 ms cost the store's side ~20%)."""
    os.nice(19)
    while not stop.is_set():
        if folder.exists():
            peak.value = max(peak.value, on_disk(folder))
        time.sleep(0.005)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="dataset.num_workers (data worker processes).")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=224, help="Camera images are resized to this square.")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.resolution = 1, 32
    from opentau_cli.data import write_synth

    rows, notes, headlines = [], [], []
    with tempfile.TemporaryDirectory(prefix="opentau-bench-data-") as tmp:
        work = Path(tmp)
        server = S3Server(work / "s3", nice=19).start()  # as in bench_remote.py: it stands for another machine
        os.environ.update(server.env)
        try:
            datasets = []
            episodes = 12 if args.smoke else 120
            synth = write_synth(work / "synth", episodes=episodes, steps_per_episode=20, video=True, seed=4)
            datasets.append(("synthetic H.264 64x64", synth, False))
            if not args.smoke and (G1 / "meta" / "info.json").is_file():
                datasets.append(("g1 (AV1 480x640)", G1, True))
            for name, folder, wide in datasets:
                url = upload(server, folder, f"bench/{folder.name}")
                size = on_disk(folder / "data") + on_disk(folder / "videos") + on_disk(folder / "meta")
                cap_gb = 1.5 * size / (1 << 30)
                sides: dict[str, list[dict]] = {"local disk": [], "store, cold cache": [], "store, warm cache": []}
                for r in range(args.rounds):
                    cache = work / f"cache-{name[:5]}-{r}"
                    order = [("local disk", str(folder)), ("store, cold cache", url), ("store, warm cache", url)]
                    if r % 2:  # the local side after the store's, every other round
                        order = order[1:] + order[:1]
                    for side, root in order:
                        sides[side].append(epoch(root, args.workers, args.batch, args.resolution, cap_gb,
                                                 cache if side != "local disk" else work / "cache-local", wide))
                shutil.rmtree(work / "cache-half", ignore_errors=True)
                half = epoch(url, args.workers, args.batch, args.resolution, size / 2 / (1 << 30), work / "cache-half", wide)
                rate = {s: [m["samples"] / m["seconds"] for m in ms] for s, ms in sides.items()}
                local = rate["local disk"]
                rows.append((f"{name}: epoch", f"{sides['local disk'][0]['samples']} samples, {size / 1e6:.1f} MB on "
                             f"disk, {args.workers} workers, batch {args.batch}, {args.resolution}px, {args.rounds} rounds"))
                for side in ("local disk", "store, cold cache", "store, warm cache"):
                    ratios = [a / b for a, b in zip(rate[side], local)]
                    ratio = statistics.median(ratios)
                    target = {"store, cold cache": COLD_TARGET, "store, warm cache": WARM_TARGET}.get(side)
                    shown = f"{statistics.median(rate[side]):.1f} samples/s"
                    if target:
                        headlines.append(ratio_headline(f"{name}, {side.removeprefix('store, ')} / local", ratio, target))
                        shown += (f" ({ratio:.2f}x local, per round {', '.join(f'{x:.2f}' for x in ratios)}; target "
                                  f">= {target}x: {verdict(ratio, target)})")
                    check = statistics.median(m["check_s"] for m in sides[side])
                    rows.append((f"{name}: {side}", f"{shown}; check + build {check:.1f} s"))
                peak = max(m["peak"] for m in sides["store, cold cache"] + sides["store, warm cache"])
                rows.append((f"{name}: cache peak on disk", f"{peak / 1e6:.2f} MB, cap {cap_gb * (1 << 30) / 1e6:.2f} MB "
                             f"({'within' if peak <= cap_gb * (1 << 30) else 'ABOVE'} the cap)"))
                half_rate = half["samples"] / half["seconds"]
                rows.append((f"{name}: store, cap = half the dataset", f"{half_rate:.1f} samples/s "
                             f"({half_rate / statistics.median(local):.2f}x local); peak {half['peak'] / 1e6:.2f} MB, "
                             f"cap {size / 2 / 1e6:.2f} MB ({'within' if half['peak'] <= size / 2 else 'ABOVE'} the cap)"))
        finally:
            server.kill()
    print_rows("Benchmark: a dataset in object storage vs on local disk", rows)
    notes += ["each epoch is what a rank does: the pre-launch check, build_data, then one epoch of batches through "
              "fresh data workers (no decoded frame reused); samples/s count the epoch's batches only",
              "the store is SeaweedFS on this machine (loopback) at nice 19, standing for another machine (its CPU "
              "is not the training's, as in bench_remote.py): a real store adds network latency per file fetched",
              "the cold cache is emptied before each round; the warm epoch reads the files the cold one fetched",
              "the machine is shared with other work: the load average above says how busy it was"]
    report(args, TITLE, rows, notes, combined(*headlines[-2:]))  # the last dataset's: g1, a real one, where present


if __name__ == "__main__":
    main()
