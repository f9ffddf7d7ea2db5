"""LeRobot datasets in object storage (`dataset.root: s3://...`, data/remote.py) against a real S3 server (SeaweedFS,
tests/s3_server.py) holding the bundled demo dataset, the real g1 dataset and small synthetic video datasets, each put
there with a plain boto3 client. In-process: the pre-launch check, what a rank builds (build_data) and reads, the
cache under its cap with several processes reading at once, the store going away and coming back, a file replaced
in the store. What is on disk is measured by this test's own walk of the cache folder; what the store holds is read
with the plain client; a sample is compared with the same dataset read from local disk."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import shutil
import threading
import time
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch
from botocore.config import Config
from conftest import EXAMPLES, offline_hub, refused, run_cli_in_process
from s3_server import ACCESS_KEY, SECRET_KEY, S3Server

from opentau_cli.config.load import load_config
from opentau_cli.config.model import DatasetConfig, MixtureMember
from opentau_cli.data import build_data, write_synth
from opentau_cli.data.check import check_dataset
from opentau_cli.data.remote import (
    DataChanged,
    DataUnavailable,
    FileCache,
    RemoteFiles,
    cache_root,
    resolve,
)
from opentau_cli.data.synth import DEMO_SETTINGS
from opentau_cli.data.video import VideoFrames
from opentau_cli.errors import UserError

pytestmark = [pytest.mark.full, pytest.mark.timeout(600)]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
TOP, FRONT = "observation.images.top", "observation.images.front"


def plain_client(server: S3Server):
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name="us-east-1", config=Config(retries={"max_attempts": 1}))


def upload(server: S3Server, folder: Path, prefix: str) -> str:
    """`folder`'s files under s3://bucket/prefix/ (a plain client), returns the URL."""
    client = plain_client(server)
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        client.upload_file(str(path), server.bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return server.url(prefix)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The datasets on local disk: the bundled demo and a 2-camera video dataset (v2.1 and v3.0)."""
    base = tmp_path_factory.mktemp("datasets")
    video = dict(episodes=4, steps_per_episode=8, cameras=2, seed=3, video=True)
    return {"demo": write_synth(base / "demo", **DEMO_SETTINGS),
            "v21": write_synth(base / "v21", fmt="v2.1", **video), "v30": write_synth(base / "v30", fmt="v3.0", **video)}


@pytest.fixture(scope="module")
def stored(s3_server, local):
    """The same datasets in the store, under a prefix of this module's own."""
    base = f"datasets-{os.getpid()}"
    return {name: upload(s3_server, folder, f"{base}/{name}") for name, folder in local.items()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path / "opentau_cache"))
    return tmp_path / "opentau_cache" / "datasets"


def config(*args: str):
    return load_config(None, [
        "--policy.preset=pi05_tiny", "--policy.chunk_size=4", "--policy.n_action_steps=4", "--policy.max_state_dim=32",
        "--policy.max_action_dim=32", "--policy.image_resolution=[32,32]", "--batch_size=4", "--dataset.num_workers=0",
        "--dataset.num_cameras=1", *args,
    ])


def on_disk(folder: Path) -> int:
    """What `du` counts under `folder`: the blocks of every file and folder, the folder itself included."""
    total = 0
    for dirpath, dirs, files in os.walk(folder):
        try:  # measured while the cache changes: a folder may go between listing and stat
            total += os.lstat(dirpath).st_blocks * 512
        except FileNotFoundError:
            continue
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def cached_files(cache: Path) -> set[str]:
    """The dataset files the cache holds, by their path in the dataset (the version tag cut off)."""
    return {"/".join(p.relative_to(cache).parts[2:]).rpartition(".")[0] for p in cache.glob("*/files/**/*") if p.is_file()}


def read_all(data) -> None:
    for i in range(len(data.train_dataset)):
        data.train_dataset[i]


@pytest.mark.parametrize("layout", ["v21", "v30"])
def test_meta_is_read_first_then_only_the_selected_episodes_and_cameras_are_fetched(s3, stored, cache, layout):
    cfg = config(f"--dataset.root={stored[layout]}", "--dataset.episodes=[0,2]",
                 f'--dataset.camera_keys={{"{TOP}": "camera0"}}')
    assert check_dataset(cfg) == []
    revision = cfg.dataset.revision  # pinned for the launch: the versions of what the run reads
    pins = json.loads(next(cache.glob(f"*/pins/{revision}.json")).read_text())
    data = build_data(cfg)  # what a rank does
    try:
        read_all(data)
    finally:
        data.stream.close()
    if layout == "v21":
        wanted = {f"data/chunk-000/episode_00000{e}.parquet" for e in (0, 2)} | {
            f"videos/chunk-000/{TOP}/episode_00000{e}.mp4" for e in (0, 2)}
    else:  # one file holds every episode
        wanted = {"data/chunk-000/file-000.parquet", f"videos/{TOP}/chunk-000/file-000.mp4"}
    listing = plain_client(s3).list_objects_v2(Bucket=s3.bucket, Prefix=stored[layout].split("/", 3)[3] + "/")
    meta = {o["Key"].split(f"{layout}/", 1)[1]: o for o in listing["Contents"] if "/meta/" in o["Key"]}
    assert set(pins["files"]) == wanted | set(meta)
    assert {rel: pins["files"][rel]["etag"] for rel in meta} == {rel: o["ETag"] for rel, o in meta.items()}
    assert cached_files(cache) == wanted  # never the other camera, never the episodes not selected
    assert sorted("/".join(p.relative_to(cache).parts[2:]) for p in cache.glob("*/meta-*/meta/**/*") if p.is_file()) == \
        sorted(meta)


def test_the_same_samples_in_the_same_order_as_the_same_dataset_on_local_disk(s3, stored, local, cache, tmp_path, monkeypatch):
    """The demo from the store and from disk, then a mixture of it from the store, from disk and from a Hub cache:
    batch after batch equal in every tensor and text, through two data workers."""
    from test_data_hub import lay_out

    offline_hub(monkeypatch, tmp_path / "hf_cache")
    lay_out(tmp_path / "hf_cache", "org/demo", local["demo"], "main")
    mixture = '[{"root": "%s", "name": "store"}, {"root": "%s", "name": "disk"}, {"repo_id": "org/demo", "name": "hub"}]'
    for store_args, disk_args in (
        ([f"--dataset.root={stored['demo']}"], [f"--dataset.root={local['demo']}"]),
        ([f"--dataset.mixture={mixture % (stored['demo'], local['demo'])}"],
         [f"--dataset.mixture={mixture % (local['demo'], local['demo'])}"]),
    ):
        same_batches([*store_args, "--dataset.num_workers=2", "--validation.val_split=0.1"],
                     [*disk_args, "--dataset.num_workers=2", "--validation.val_split=0.1"], 6)


def same_batches(store_args: list[str], disk_args: list[str], batches: int) -> None:
    """The first `batches` batches of the two configs' streams (each checked first, as a launch does) are equal in
    every tensor and text, and so are their statistics."""
    streams = []
    for args in (store_args, disk_args):
        cfg = config(*args)
        assert check_dataset(cfg) == []
        streams.append(build_data(cfg))
    try:
        for _ in range(batches):
            a, b = next(streams[0].stream), next(streams[1].stream)
            assert a.keys() == b.keys()
            for key in a:
                assert (torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]), key
        assert streams[0].stats == streams[1].stats
    finally:
        for data in streams:
            data.stream.close()


def test_the_real_g1_dataset_from_the_store_gives_the_batches_it_gives_from_local_disk(s3, g1, cache):
    """AV1 480x640 video, 26-wide state: the first batches of a shuffled epoch through a data worker, tensor for tensor,
    from the store and from the shared copy on disk."""
    url = upload(s3, g1, f"g1-{os.getpid()}")
    same_batches([f"--dataset.root={url}", "--dataset.num_workers=1", "--validation.val_split=0"],
                 [f"--dataset.root={g1}", "--dataset.num_workers=1", "--validation.val_split=0"], 2)


def blobs(server: S3Server, prefix: str, sizes: list[int]) -> dict[str, bytes]:
    """Files of random bytes in the store, laid out as a dataset's data files; {relative path: bytes}."""
    client, rng, out = plain_client(server), random.Random(7), {}
    for i, size in enumerate(sizes):
        rel = f"data/chunk-000/episode_{i:06d}.parquet"
        out[rel] = rng.randbytes(size)
        client.put_object(Bucket=server.bucket, Key=f"{prefix}/{rel}", Body=out[rel])
    return out


def files_for(server: S3Server, prefix: str, cap: int, wait: float = 30.0) -> RemoteFiles:
    """A RemoteFiles over everything under `prefix`, pinned as the store lists it now (the plain client's listing)."""
    listing = plain_client(server).list_objects_v2(Bucket=server.bucket, Prefix=prefix + "/")["Contents"]
    pins = {o["Key"][len(prefix) + 1:]: {"size": o["Size"], "etag": o["ETag"]} for o in listing}
    root = cache_root() / "ds" / "meta-x"
    return RemoteFiles(server.url(prefix), {}, root, pins, FileCache(cache_root(), cap / (1 << 30)), wait)


def _reader(url_prefix, server_env, cache_dir, cap, rels, expected, seed, rounds, errors):
    os.environ.update(server_env)
    os.environ["OPENTAU_CACHE_DIR"] = cache_dir
    try:
        server = type("Server", (), {"bucket": url_prefix[0], "endpoint": server_env["AWS_ENDPOINT_URL"],
                                     "url": lambda self, key: f"s3://{url_prefix[0]}/{key}"})()
        files = files_for(server, url_prefix[1], cap)
        rng = random.Random(seed)
        for _ in range(rounds):
            rel = rng.choice(rels)
            with files.open(files.root / rel) as path:
                if hashlib.sha256(path.read_bytes()).hexdigest() != expected[rel]:
                    errors.put(f"{rel}: other bytes")
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        errors.put(repr(e))


def test_the_cache_never_holds_more_than_its_cap_while_several_processes_fetch_and_read(s3, cache):
    prefix = f"blobs-{os.getpid()}"
    content = blobs(s3, prefix, [random.Random(i).randint(20_000, 300_000) for i in range(24)])
    cap = 1_200_000  # about a third of the files
    peak, stop = [0], threading.Event()

    def measure():
        while not stop.is_set():
            peak[0] = max(peak[0], on_disk(cache) if cache.exists() else 0)

    sampler = threading.Thread(target=measure)
    sampler.start()
    errors = multiprocessing.get_context("fork").Queue()
    expected = {rel: hashlib.sha256(data).hexdigest() for rel, data in content.items()}
    args = ((s3.bucket, prefix), s3.env, str(cache.parent), cap, sorted(content), expected)
    readers = [multiprocessing.get_context("fork").Process(target=_reader, args=(*args, seed, 40, errors))
               for seed in range(3)]
    for p in readers:
        p.start()
    for p in readers:
        p.join(300)
    stop.set()
    sampler.join()
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert problems == [] and all(p.exitcode == 0 for p in readers)
    assert 0 < peak[0] <= cap, peak[0]
    assert on_disk(cache) <= cap and not list(cache.rglob("*.part"))


def _idle_reader(server, prefix, cap, rel, ready, done):
    """(Forked, in the test's environment.) Reads a frame of `rel`, then sits idle with its container (and so the
    file) kept open, as a data worker waiting for its next batch."""
    files = files_for(server, prefix, cap)
    frames = VideoFrames()
    frames.get(files.root / rel, 0.0, 10.0, (32, 32), files)
    ready.set()
    done.wait(120)


def test_a_process_that_holds_a_video_open_while_idle_lets_go_when_another_needs_the_room(s3, local, cache):
    """Room for one video: an idle process holds the other one open; the reader asking for room gets it (without the
    idle process letting go it would wait dataset.remote_wait_seconds, then fail)."""
    prefix, client = f"held-{os.getpid()}", plain_client(s3)
    rels = [f"videos/chunk-000/{TOP}/episode_00000{e}.mp4" for e in (0, 1)]
    for rel in rels:
        client.upload_file(str(local["v21"] / rel), s3.bucket, f"{prefix}/{rel}")
    probe = FileCache(cache_root(), 1.0)
    # one video and the six folders of the cache it lies in (datasets/ds/files/videos/chunk-000/<camera>)
    cap = max(probe.on_disk((local["v21"] / rel).stat().st_size) for rel in rels) + 6 * probe.block
    fork = multiprocessing.get_context("fork")
    ready, done = fork.Event(), fork.Event()
    idle = fork.Process(target=_idle_reader, args=(s3, prefix, cap, rels[0], ready, done))
    idle.start()
    try:
        assert ready.wait(60) and cached_files(cache) == {rels[0]}
        files = files_for(s3, prefix, cap, wait=20)
        with files.open(files.root / rels[1]) as path:
            assert path.read_bytes() == (local["v21"] / rels[1]).read_bytes()
        assert cached_files(cache) == {rels[1]} and on_disk(cache) <= cap
    finally:
        done.set()
        idle.join(60)
    assert idle.exitcode == 0


def test_the_least_recently_used_files_make_room_and_a_file_being_read_is_never_evicted(s3, cache):
    prefix = f"lru-{os.getpid()}"
    content = blobs(s3, prefix, [100_000] * 5)
    a, b, c, d, e = sorted(content)
    probe = FileCache(cache_root(), 1.0)
    room = 3 * probe.on_disk(100_000) + 8 * probe.block  # three files and the folders they lie in
    files = files_for(s3, prefix, room, wait=2)
    for rel in (a, b, c):
        files.open(files.root / rel).close()
        time.sleep(0.02)
    files.open(files.root / a).close()  # a is used again: b is now the least recently used
    files.open(files.root / d).close()
    assert cached_files(cache) == {a, c, d}
    held = files.lease(files.root / a)  # a reader holds a: least recently used now, but never evicted while held
    time.sleep(0.02)
    for rel in (c, d):
        files.open(files.root / rel).close()
    files.open(files.root / e).close()
    assert cached_files(cache) == {a, d, e} and on_disk(cache) <= room
    assert held.path.read_bytes() == content[a]
    leases = [files.lease(files.root / rel) for rel in (d, e)]  # everything held: no room for another file
    with pytest.raises(UserError, match=r"dataset.cache_max_gb=.* cannot hold the files this run reads at once"):
        files.open(files.root / b)
    for lease in [held, *leases]:
        lease.close()
    with files.open(files.root / b) as path:
        assert path.read_bytes() == content[b]


def test_a_data_worker_fetches_the_selected_files_ahead_of_its_reads_and_nothing_else(s3, cache, tmp_path):
    """20 one-camera episodes, 16 selected: one batch of 4 samples reads at most 4 videos, and the worker's read-ahead
    brings the other selected ones meanwhile, never an unselected episode's."""
    folder = write_synth(tmp_path / "many", episodes=20, steps_per_episode=8, video=True, seed=8)
    url = upload(s3, folder, f"ahead-{os.getpid()}")
    cfg = config(f"--dataset.root={url}", "--dataset.episodes=[" + ",".join(map(str, range(16))) + "]",
                 "--dataset.num_workers=1", "--validation.val_split=0")
    assert check_dataset(cfg) == []
    data = build_data(cfg)
    try:
        next(data.stream)
        videos = {f"videos/chunk-000/{TOP}/episode_{e:06d}.mp4" for e in range(16)}
        deadline = time.monotonic() + 60
        while not videos <= cached_files(cache) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        data.stream.close()
    assert cached_files(cache) == videos | {f"data/chunk-000/episode_{e:06d}.parquet" for e in range(16)}


def test_a_second_run_on_the_same_machine_reads_the_cache(s3, stored, cache):
    runs = []
    for _ in range(2):
        cfg = config(f"--dataset.root={stored['v21']}", f'--dataset.camera_keys={{"{TOP}": "camera0"}}')
        assert check_dataset(cfg) == []
        data = build_data(cfg)
        try:
            read_all(data)
        finally:
            data.stream.close()
        runs.append({p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.glob("*/files/**/*") if p.is_file()})
    first, second = runs
    assert len(first) == 8 and first.keys() == second.keys()  # 4 data files, 4 videos of the one camera
    assert all(second[p][0] == first[p][0] for p in first)  # the same files: nothing fetched again
    assert any(second[p][1] > first[p][1] for p in first)  # read again (each use marks it recently used)


def test_a_store_away_for_a_while_is_waited_for_and_one_away_too_long_is_one_sentence(s3, local, cache, tmp_path):
    """The session's server itself goes away and comes back (same ports, same data: this worker's tests run one at a
    time), rather than a second server started beside it."""
    server = s3
    url = upload(server, local["v21"], f"away-{os.getpid()}")
    files = resolve(MixtureMember(root=url), DatasetConfig(remote_wait_seconds=30, num_cameras=2)).files
    video = files.root / f"videos/chunk-000/{TOP}/episode_000001.mp4"
    returned = threading.Event()
    back = threading.Timer(4, lambda: (returned.set(), server.start()))  # back after 4 s
    try:
        server.kill()  # gone at once (a clean stop leaves the restarted store slow to write for up to 20 s)
        back.start()
        with files.open(video) as path:
            assert path.read_bytes() == (local["v21"] / f"videos/chunk-000/{TOP}/episode_000001.mp4").read_bytes()
        assert returned.is_set()  # it waited for the store: the read came back only once the store did
        back.join()
        files.wait_seconds = 3
        server.kill()
        with pytest.raises(DataUnavailable) as caught:
            files.open(files.root / f"videos/chunk-000/{TOP}/episode_000002.mp4")
        message = str(caught.value)
        assert message.startswith(f"The store of {url} did not answer for ")
        assert f"while videos/chunk-000/{TOP}/episode_000002.mp4 was read" in message and "\n" not in message
        assert SECRET_KEY not in message and ACCESS_KEY not in message
        assert " s (dataset.remote_wait_seconds) while " in message  # it gave up once the setting's time was spent
        assert not list(cache.rglob("*.part"))
    finally:
        if back.is_alive():
            back.join()
        if server.proc.poll() is not None:
            server.start()


def test_a_file_replaced_in_the_store_is_never_read_in_another_version(s3, local, cache, tmp_path):
    prefix = f"replaced-{os.getpid()}"
    url = upload(s3, local["v21"], prefix)
    member = MixtureMember(root=url)
    dataset = DatasetConfig(num_cameras=2)
    first = resolve(member, dataset)
    rel = f"videos/chunk-000/{TOP}/episode_000003.mp4"
    plain_client(s3).put_object(Bucket=s3.bucket, Key=f"{prefix}/{rel}", Body=b"another version")
    with pytest.raises(DataChanged, match=f"{url}/{rel} changed in the store while the run read the dataset"):
        first.files.open(first.files.root / rel)
    second = resolve(member, dataset)  # a new launch pins the new version
    assert second.revision != first.revision
    with second.files.open(second.files.root / rel) as path:
        assert path.read_bytes() == b"another version"
    with pytest.raises(UserError, match=f"is no longer at version {first.revision}"):
        resolve(MixtureMember(root=url, revision=first.revision), dataset)


@pytest.fixture
def damaged(s3_server, local):
    """Copies of the small v2.1 video dataset in the store, each with one thing wrong."""
    base, client = f"damaged-{os.getpid()}", plain_client(s3_server)
    out = {}
    for case in ("no_meta", "missing_video", "empty_data", "undecodable", "good"):
        out[case] = upload(s3_server, local["v21"], f"{base}/{case}")
    key = lambda case: f"{base}/{case}/{DAMAGED[case]}"  # noqa: E731
    client.delete_object(Bucket=s3_server.bucket, Key=key("no_meta"))
    client.delete_object(Bucket=s3_server.bucket, Key=key("missing_video"))
    client.put_object(Bucket=s3_server.bucket, Key=key("empty_data"), Body=b"")
    client.put_object(Bucket=s3_server.bucket, Key=key("undecodable"), Body=b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 40)
    return out


# The file each damaged copy has wrong (put back as it was to retry).
DAMAGED = {"no_meta": "meta/info.json", "missing_video": f"videos/chunk-000/{TOP}/episode_000002.mp4",
           "empty_data": "data/chunk-000/episode_000001.parquet", "undecodable": f"videos/chunk-000/{TOP}/episode_000000.mp4"}


CAM = f'--dataset.camera_keys={{"{TOP}": "camera0"}}'


@pytest.mark.parametrize("case, args, needles", [
    ("no_meta", [], ["/meta/info.json is missing:", "is not a LeRobot dataset"]),
    ("missing_video", [CAM], [f"/videos/chunk-000/{TOP}/episode_000002.mp4 is missing", "video_path", "dataset.episodes"]),
    ("empty_data", [CAM], ["/data/chunk-000/episode_000001.parquet is empty", "data_path"]),
    ("undecodable", [CAM], [f"/videos/chunk-000/{TOP}/episode_000000.mp4", "damaged"]),
    ("good", [CAM, "--dataset.cache_max_gb=0.00001"], ["dataset.cache_max_gb=1e-05 cannot hold", "raise"]),
    ("good", [CAM, '--dataset.remote_options={"secret_access_key": "x"}'], ["must not hold credentials (secret_access_key)"]),
    ("good", [CAM, "--dataset.remote_wait_seconds=3600"], ["dataset.remote_wait_seconds (3600) must be shorter than"]),
    ("good", [CAM, '--dataset.remote_options={"endpoint_url": "http://127.0.0.1:9"}'], ["cannot be reached"]),
])
def test_each_problem_of_a_dataset_in_object_storage_is_one_sentence_before_anything_starts(
        s3, damaged, local, cache, tmp_path, case, args, needles):
    """... and what a refused check leaves behind never blocks the retry once the store or the config is put right
    (tried where the cache was written to: a damaged video fetched, then replaced; a cap too small)."""
    url = damaged[case]
    out = tmp_path / "run"
    result = run_cli_in_process(["config", "validate", TINY, f"--dataset.root={url}", f"--output_dir={out}", *args])
    refused(result, *needles)
    if case not in ("no_meta", "good"):
        assert url + "/" in result.stderr  # named by its URL, never by its copy in the cache
    assert not out.exists()
    assert not list(cache.rglob("*.part"))
    if case == "undecodable" or "cache_max_gb" in " ".join(args):
        if case in DAMAGED:
            plain_client(s3).upload_file(str(local["v21"] / DAMAGED[case]), s3.bucket,
                                         f"{url.split('/', 3)[3]}/{DAMAGED[case]}")
        retry = run_cli_in_process(["config", "validate", TINY, f"--dataset.root={url}", f"--output_dir={out}", CAM])
        assert retry.returncode == 0, retry.stderr


def test_a_wrong_secret_or_a_missing_bucket_is_one_sentence(s3, stored, cache, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    refused(run_cli_in_process(["config", "validate", TINY, f"--dataset.root={stored['demo']}"]), "refused the credentials")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    refused(run_cli_in_process(["config", "validate", TINY, "--dataset.root=s3://no-such-bucket-here/demo"]),
            "The bucket 'no-such-bucket-here' does not exist")


def test_a_video_that_does_not_decode_is_refused_before_launch_on_local_disk_too(local, tmp_path):
    copy = tmp_path / "v21"
    shutil.copytree(local["v21"], copy)
    (copy / f"videos/chunk-000/{TOP}/episode_000000.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    result = run_cli_in_process(["config", "validate", TINY, f"--dataset.root={copy}", CAM, f"--output_dir={tmp_path / 'r'}"])
    refused(result, f"{copy}/videos/chunk-000/{TOP}/episode_000000.mp4", "damaged")


def test_dataset_info_describes_and_verifies_a_dataset_in_object_storage(s3, stored, cache):
    result = run_cli_in_process(["dataset", "info", stored["v30"], "--json", "--verify"])
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["root"] == stored["v30"] and info["episodes"] == 4 and sorted(info["cameras"]) == sorted([TOP, FRONT])
    assert "Verified: all 32 frames" in result.stderr


def test_no_file_of_the_cache_holds_a_credential(s3, stored, cache):
    cfg = config(f"--dataset.root={stored['v21']}", CAM)
    assert check_dataset(cfg) == []
    data = build_data(cfg)
    data.stream.close()
    for path in cache.rglob("*"):
        if path.is_file():
            body = path.read_bytes()
            assert SECRET_KEY.encode() not in body and ACCESS_KEY.encode() not in body, path
    assert np.isfinite(data.stats["state"]["mean"]).all()
