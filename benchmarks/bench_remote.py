"""Remote checkpoints against a local S3 server: upload throughput vs the plain client, training time lost per save,
resume from the store vs a plain download, bytes per checkpoint.

Side by side in one run, against a local SeaweedFS (tests/s3_server.py, one server for the whole run):
1. Upload: a pi05_small checkpoint (the real save of a 1-step run) and a checkpoint of 1 GB or more (the same with a
   1.1 GB file added and the manifest written again) through opentau's commit protocol (store/remote_run.py: every
   file checked against the manifest before it is sent and from the store's side once stored, then the history, the
   manifest and `last`) vs boto3's transfer manager sending the same files with the same part size and concurrency
   (the fastest plain client, benchmarks/bench_remote_clients.py). Rounds alternate which goes first; the ratio is
   the median of the rounds' ratios (target >= 0.9x).
2. Training time lost per save: the same pi05_small run (N steps, a save every K) with `checkpoint.remote` on and
   off, `remote_drain_seconds=0` so that the launch does not wait for its last upload: (wall on - wall off) / saves,
   and the walls' ratio (target <= 1.05x). Three ways: training on every core (CPU-bound training: the upload's hashing
   and sending can only take CPU from it), training on one thread (OMP_NUM_THREADS=1), a core left free as a
   GPU-bound rank leaves its host's CPU, and the cores split as on a GPU node's host: the rank and its data workers
   pinned to core 0, the launcher (whose thread uploads) and the store to core 1 (tests/hooks' BENCH_RANK_CPUS): a GPU
   node's host has idle cores for the upload, and the store stands for another machine. The store
   runs at nice 19 throughout. Each row says how many of the launch's saves were committed in the store when it
   ended (uploads are not skipped to save time: an upload still running is left, as with remote_drain_seconds=0).
3. Resume on an empty disk: `opentau resume URL` (download, check, launch, one more step) vs downloading the same
   files with boto3 and `opentau resume` of that directory (target <= 1.1x).
4. Bytes per checkpoint (the sum of its committed manifest): full fine-tuning, a frozen vision tower, LoRA rank 16.
5. Interference (the cores' shared memory and caches): a one-thread matmul loop on core 0 alone, then while core 1
   copies memory, then while core 1 uploads the checkpoint of 1. to the store (this process and the store pinned
   there): how much moving bytes on one core slows training on another, which no scheduling priority removes.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, combined, print_rows, ratio_headline, report, run, verdict  # noqa: E402
from _common import opentau_bin  # noqa: E402
from s3_server import S3Server  # noqa: E402

from opentau_cli.process.launch import LOCAL_ONLY_EXIT  # noqa: E402 (a launch that left checkpoints local only)

PART, CONCURRENCY = 16 << 20, 8  # store/remote.py's defaults
ALL_PARTS = "upload,resume,training,bytes,interference"
ALL_VARIANTS = "all,one,split"  # of the training part
EVERY_CORE = set(range(os.cpu_count() or 1))


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n


PROBE = """import os, sys, time, torch
os.sched_setaffinity(0, {0}); torch.set_num_threads(1); a = torch.randn(512, 512)
for _ in range(20): a @ a
n, t = 0, time.perf_counter()
while time.perf_counter() - t < float(sys.argv[1]): a @ a; n += 1
print(n / (time.perf_counter() - t))"""
COPY = "import os, numpy as np\nos.sched_setaffinity(0, {1}); x = np.ones(200_000_000, dtype=np.uint8)\nwhile True: x.copy()"


def probe(seconds: float, busy=None) -> float:
    """Matmuls per second of one thread on core 0 over `seconds`, while `busy()` runs here again and again."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", PROBE, str(seconds)], stdout=subprocess.PIPE, text=True)
    while busy is not None and proc.poll() is None:
        busy()
    return float(proc.communicate()[0])


def interference(server: S3Server, ckpt: Path, seconds: float) -> list[tuple[str, str]]:
    import subprocess

    pin(server.proc.pid, {1})
    os.sched_setaffinity(0, {1})
    try:
        alone = statistics.median(probe(seconds) for _ in range(2))
        copier = subprocess.Popen([sys.executable, "-c", COPY])
        time.sleep(1)
        copying = probe(seconds)
        copier.kill()
        copier.wait()
        count = itertools.count()
        uploading = probe(seconds, lambda: ours_upload(server, ckpt, f"bench/interference{next(count)}"))
    finally:
        os.sched_setaffinity(0, EVERY_CORE)
        pin(server.proc.pid, EVERY_CORE)
    return [("one-thread matmul on core 0, core 1 idle", f"{alone:.1f} per s"),
            ("the same while core 1 copies memory", f"{alone / copying:.2f}x slower ({copying:.1f} per s)"),
            ("the same while core 1 uploads the checkpoint (this process and the store on core 1)",
             f"{alone / uploading:.2f}x slower ({uploading:.1f} per s)")]


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit them)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def checkpoint_files(ckpt: Path) -> list[tuple[Path, str]]:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return [(ckpt / rel, rel) for rel in sorted(manifest["files"])]


class Plain:
    """boto3's transfer manager, as a user would drive it (the same part size and concurrency as opentau's)."""

    def __init__(self, server: S3Server):
        import boto3
        from boto3.s3.transfer import TransferConfig, create_transfer_manager
        from botocore.config import Config

        self.bucket = server.bucket
        self.client = boto3.session.Session().client(
            "s3", config=Config(retries={"mode": "standard", "max_attempts": 10}, max_pool_connections=2 * CONCURRENCY + 2))
        self.manager = create_transfer_manager(self.client, TransferConfig(
            multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY))

    def upload(self, files: list[tuple[Path, str]], prefix: str) -> None:
        futures = [self.manager.upload(str(local), self.bucket, f"{prefix}/{rel}") for local, rel in files]
        for f in futures:
            f.result()

    def download(self, keys: list[str], prefix: str, into: Path) -> None:
        futures = []
        for rel in keys:
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            futures.append(self.manager.download(self.bucket, f"{prefix}/{rel}", str(into / rel)))
        for f in futures:
            f.result()


def ours_upload(server: S3Server, ckpt: Path, prefix: str) -> None:
    from opentau_cli.store.remote_run import RemoteRun, history_files
    from opentau_cli.store.storage import open_storage

    remote = RemoteRun(open_storage(server.url(prefix)))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert remote.upload(ckpt.name, {rel: ckpt / rel for rel in manifest["files"]}, manifest)
    remote.commit(ckpt.name, ckpt / "manifest.json", history_files(ckpt.parent.parent))


def upload_rounds(server: S3Server, ckpt: Path, rounds: int, tag: str) -> dict:
    plain = Plain(server)
    files = checkpoint_files(ckpt)
    size = sum(p.stat().st_size for p, _ in files)
    times = {"plain": [], "ours": []}
    for r in range(rounds):
        order = ("plain", "ours") if r % 2 == 0 else ("ours", "plain")
        for who in order:
            started = time.perf_counter()
            if who == "plain":
                plain.upload(files, f"bench/{tag}/plain{r}/checkpoints/{ckpt.name}")
            else:
                ours_upload(server, ckpt, f"bench/{tag}/ours{r}")
            times[who].append(time.perf_counter() - started)
    ratios = [p / o for p, o in zip(times["plain"], times["ours"])]  # throughput ours / plain
    return {"bytes": size, "plain_mbs": size / 1e6 / statistics.median(times["plain"]),
            "ours_mbs": size / 1e6 / statistics.median(times["ours"]), "ratio": statistics.median(ratios),
            "ratios": ratios}


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/opentau-bench-remote"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-mb", type=int, default=1100, help="The file added to make a checkpoint of >= 1 GB.")
    parser.add_argument("--steps", type=int, default=30, help="Steps of the on / off training runs.")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--store-dir", type=Path, default=None,
                        help="Where the local S3 server keeps its data (default: under --workdir).")
    parser.add_argument("--training-variants", default=ALL_VARIANTS,
                        help="Of the training part: all (every core), one (one thread), split (cores split).")
    parser.add_argument("--parts", default=ALL_PARTS,
                        help="Comma-separated, of upload, resume, training, bytes, interference.")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if args.smoke:
        # the added file just over one 16 MiB part (PART): the large checkpoint still goes up in several parts
        args.rounds, args.big_mb, args.steps, args.save_every = 1, 17, 4, 2
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store_dir = args.store_dir or work / "s3"
    shutil.rmtree(store_dir, ignore_errors=True)
    server = S3Server(store_dir, nice=19).start()
    os.environ.update(server.env)
    train = [opentau_bin(), "train", f"--config_path={config}", "--log_freq", "1", "--logging.progress_bar=plain"]
    rows, notes = [], []
    headlines = {}  # part -> its headline; training: the last variant measured (split, a GPU node's host, where run)
    try:
        # The run that makes the checkpoint uploads it too (the resume below starts from it).
        made = work / "made"
        run([*train, f"--output_dir={made}", "--steps", "1", "--save_freq", "1",
             f"--checkpoint.remote={server.url('bench/made')}"])
        ckpt = made / "checkpoints" / "000001"
        if "upload" in parts:  # 1. Upload throughput.
            small = upload_rounds(server, ckpt, args.rounds, "small")
            big_run = work / "big"
            shutil.copytree(made, big_run)
            big = big_run / "checkpoints" / "000001"
            write_random(big / "extra.bin", args.big_mb << 20)
            from opentau_cli.store.manifest import write_manifest

            (big / "manifest.json").unlink()
            write_manifest(big)
            large = upload_rounds(server, big, args.rounds, "big")
            headlines["upload"] = ratio_headline("upload throughput, opentau / boto3", small["ratio"], 0.9)
            for name, r in (("checkpoint", small), ("large checkpoint", large)):
                rows.append((f"upload, {name} ({r['bytes'] / 1e9:.2f} GB): opentau / boto3",
                             f"{r['ratio']:.2f}x ({r['ours_mbs']:.1f} vs {r['plain_mbs']:.1f} MB/s; rounds "
                             f"{', '.join(f'{x:.2f}' for x in r['ratios'])}; target >= 0.9x, {verdict(r['ratio'], 0.9)})"))

        from opentau_cli.store.remote_run import RemoteRun
        from opentau_cli.store.storage import open_storage

        if "resume" in parts:  # 2. Resume on an empty disk (the launch does not wait for its own new checkpoint).
            url = server.url("bench/made")
            remote = RemoteRun(open_storage(url))
            last = remote.last()
            step = int(last)
            more = ["--steps", str(step + 1)]
            _, ours_wall = run([opentau_bin(), "resume", url, f"--output_dir={work / 'resumed-ours'}", *more,
                                "--checkpoint.remote_drain_seconds=0"], ok=(0, LOCAL_ONLY_EXIT))
            started = time.perf_counter()
            plain_dir = work / "resumed-plain"
            keys = sorted(remote.manifest(last)["files"]) + ["manifest.json"]
            Plain(server).download(keys, f"bench/made/checkpoints/{last}", plain_dir / "checkpoints" / last)
            run([opentau_bin(), "resume", str(plain_dir / "checkpoints" / last), *more, "--checkpoint.remote=null"])
            plain_wall = time.perf_counter() - started
            headlines["resume"] = ratio_headline("resume from the store, opentau / boto3 + resume", ours_wall / plain_wall,
                                                 1.1, higher_is_better=False)
            rows.append(("resume on an empty disk: opentau resume URL / boto3 download + resume",
                         f"{ours_wall / plain_wall:.2f}x ({ours_wall:.1f} vs {plain_wall:.1f} s; target <= 1.1x, "
                         f"{verdict(ours_wall / plain_wall, 1.1, higher_is_better=False)})"))

        if "training" in parts and not args.smoke:  # 3. Training time lost per save: two launches of each side.
            common = ["--steps", str(args.steps), "--save_freq", str(args.save_every)]
            saves = args.steps // args.save_every
            variants = (("all", {}, "training on every core"),
                        ("one", {"OMP_NUM_THREADS": "1"}, "training on one thread"),
                        ("split", {"OMP_NUM_THREADS": "1", "BENCH_RANK_CPUS": "0", "BENCH_OTHER_CPUS": "1",
                                   "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "tests" / "hooks")},
                         "rank on core 0, uploader and store on core 1 (a GPU node's host)"))
            for name, variables, label in variants:
                if name not in args.training_variants.split(",") or (name == "split" and (os.cpu_count() or 1) < 2):
                    continue
                walls, committed = {}, []
                pin(server.proc.pid, {1} if name == "split" else EVERY_CORE)
                for who in ("off", "on", "off2", "on2"):
                    tag = f"{who}-{name}"
                    url = server.url("bench/train-" + tag)
                    extra = [f"--checkpoint.remote={url}", "--checkpoint.remote_drain_seconds=0"] if who.startswith("on") else []
                    _, wall = run([*train, f"--output_dir={work / ('train-' + tag)}", *common, *extra], extra_env=variables,
                                  ok=(0, LOCAL_ONLY_EXIT))
                    walls.setdefault(who.rstrip("2"), []).append(wall)
                    if extra:
                        committed.append(len(RemoteRun(open_storage(url)).committed()))
                    shutil.rmtree(work / ("train-" + tag), ignore_errors=True)
                on, off = statistics.median(walls["on"]), statistics.median(walls["off"])
                headlines["training"] = ratio_headline(f"training wall, remote on / off ({label})", on / off, 1.05,
                                                       higher_is_better=False, digits=3)
                rows.append((f"training wall, checkpoint.remote on / off, {label}",
                             f"{on / off:.3f}x ({on:.1f} vs {off:.1f} s, {args.steps} steps, {saves} saves, committed "
                             f"in the store at the end: {' and '.join(map(str, committed))} of {saves}; target <= "
                             f"1.05x, {verdict(on / off, 1.05, higher_is_better=False)})"))
                rows.append((f"training time lost per save, {label}", f"{(on - off) / saves:.2f} s"))
            pin(server.proc.pid, EVERY_CORE)

        if "interference" in parts and not args.smoke and (os.cpu_count() or 1) >= 2:  # 5. (quiet: before 4.)
            rows += interference(server, ckpt, 8)
            headlines["interference"] = Headline(f"one-thread matmul while core 1 uploads: {rows[-1][1].split(' (')[0]}")

        if "bytes" in parts:  # 4. Bytes per checkpoint (full fine-tuning: the checkpoint of step 1 above).
            full = RemoteRun(open_storage(server.url("bench/made")))
            rows.append(("bytes uploaded per checkpoint, full fine-tuning",
                         f"{sum(e['size'] for e in full.manifest(full.last())['files'].values()) / 1e6:.1f} MB"))
            for label, extra in (("frozen vision tower", ["--policy.freeze_vision_encoder=true"]),
                                 ("LoRA rank 16", ["--policy.lora.rank=16"])):
                if args.smoke:
                    break
                tag = label.split()[0].lower()
                url = server.url(f"bench/bytes-{tag}")
                run([*train, f"--output_dir={work / ('bytes-' + tag)}", "--steps", "1", "--save_freq", "1",
                     f"--checkpoint.remote={url}", *extra])
                r = RemoteRun(open_storage(url))
                size = sum(e["size"] for e in r.manifest(r.last())["files"].values())
                rows.append((f"bytes uploaded per checkpoint, {label}", f"{size / 1e6:.1f} MB"))
    finally:
        server.kill()
        if not args.smoke:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(store_dir, ignore_errors=True)
    title = "Remote checkpoints: upload, training time lost per save, resume from the store"
    if parts != set(ALL_PARTS.split(",")):  # a part alone is its own section: the latest full run keeps its figures
        title = f"Remote checkpoints, {args.parts} only"
    if "training" in parts and args.training_variants != ALL_VARIANTS:
        title += f" ({args.training_variants})"
    notes.append(f"config {Path(config).name}; a local SeaweedFS {server.ports.get('s3.port', '')} on loopback at nice "
                 f"19, its data in {store_dir} (it stands for another machine); parts of {PART >> 20} MiB, {CONCURRENCY} in flight; "
                 f"{args.rounds} upload rounds alternated; parts measured: {args.parts}")
    print_rows(title, rows)
    report(args, title, rows, notes,
           combined(*headlines.values()) if headlines else Headline("bytes uploaded per checkpoint only"))


if __name__ == "__main__":
    main()
