"""LeRobot datasets in object storage: `dataset.root: s3://bucket/prefix/dataset` (docs/ARCHITECTURE.md, "Datasets in
object storage").

Before any process starts (`resolve`, called by the data check): the store is listed once (key, size, ETag, time of
every object of the dataset), `meta/` is brought into this machine's cache, and the files the run reads follow from it
(the selected episodes' data files, the selected cameras' videos: data/hub.py `wanted_files`). Their versions are
pinned: `revision` (a digest of their keys and ETags) names a pins file in the cache, and the launch writes it into
the config its ranks read. The checks of a local dataset then run on the cached meta and the pinned files.

While the run reads (`RemoteFiles`), a reader asks for a file by its place in the dataset's layout and gets a local
copy of exactly the pinned version: fetched on first use (If-Match on every request, so never another version),
or earlier by a data worker's read-ahead, then held by the reader (a shared lock on the file) while it reads. The cache (`FileCache`) is one directory per
machine, `$OPENTAU_CACHE_DIR/datasets`, shared by every process and run on it: what it holds on disk never exceeds
`dataset.cache_max_gb`. Room is made under one lock by removing the least recently used fetched files that no
process holds, and each download is given its whole size on disk before it starts (a preallocated temporary file,
renamed when complete), so concurrent downloads never add up past the cap. A store that does not answer is retried
with backoff for `dataset.remote_wait_seconds` while the reader (and so training) waits; then `DataUnavailable`.
The cache's files and folders are named in store/layout.py.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from opentau_cli.config.model import DatasetConfig, MixtureMember
from opentau_cli.data.files import LOCAL, Lease, release_held
from opentau_cli.errors import RunError, UserError
from opentau_cli.store.layout import (
    CACHE_LOCK,
    CACHE_PRESSURE,
    DATASET_CACHE,
    DATASET_FILES,
    DATASET_META,
    DATASET_SOURCE,
    DOWNLOAD_PART,
    cached_meta_dir,
    pins_file,
)
from opentau_cli.store.outputs import pid_alive
from opentau_cli.store.storage import is_url

GB = 1 << 30
_REVISION = re.compile(r"^[0-9a-f]{32}$")
# Each request to the store retries for a second only: the waiting (dataset.remote_wait_seconds) is this module's own
# loop, which says in the rank's log at once that the store is away.
_REQUEST_RETRY_SECONDS = 1.0
READ_AHEAD_THREADS = 4  # per process reading samples (RemoteFiles.read_ahead)
_STORE_LOCK = threading.Lock()
os.register_at_fork(after_in_child=lambda: globals().update(_STORE_LOCK=threading.Lock()))  # never inherited held


class DataUnavailable(RunError):
    """A file of a remote dataset could not be read: its store did not answer for dataset.remote_wait_seconds. The
    trainer saves what it trained and stops every rank with this sentence (exit 1), never skipping the data."""


class DataChanged(DataUnavailable):
    """A pinned file was replaced in the store while the run read the dataset."""


def cache_root() -> Path:
    from opentau_cli.data.synth import cache_dir

    return cache_dir() / DATASET_CACHE


def dataset_id(url: str) -> str:
    import hashlib

    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def _digest(lines) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for line in lines:
        h.update(line.encode() + b"\n")
    return h.hexdigest()


def _tag(etag: str) -> str:
    """A file name's part naming one version of an object."""
    import xxhash

    return xxhash.xxh3_64(etag.encode()).hexdigest()


def _shown_size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n:,} bytes"


# --- the cache ---------------------------------------------------------------------------------------------------

def _part_owner(name: str) -> int | None:
    """The pid in '<name>.<pid>.part', or None for another name."""
    if not name.endswith(DOWNLOAD_PART):
        return None
    pid = name[: -len(DOWNLOAD_PART)].rpartition(".")[2]
    return int(pid) if pid.isdigit() else None


class CacheFull(Exception):
    """No room can be made: what the cache holds that nobody reads does not free enough."""


class FileCache:
    """The machine's cache of dataset files (see the module doc), at most `max_bytes` on disk (blocks, as `du`
    counts them, directories included)."""

    def __init__(self, root: Path, max_gb: float):
        self.root = Path(root)
        self.max_gb = float(max_gb)  # as the user wrote it, for messages
        self.max_bytes = round(max_gb * GB)
        self._block = None

    def too_small(self, what: str) -> str:
        return f"dataset.cache_max_gb={self.max_gb:g} cannot hold {what}: raise dataset.cache_max_gb."

    @property
    def block(self) -> int:
        if self._block is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._block = os.statvfs(self.root).f_bsize or 4096
        return self._block

    def on_disk(self, size: int) -> int:
        """The disk a file of `size` bytes takes, allocated whole."""
        return -(-int(size) // self.block) * self.block

    def press(self) -> None:
        """Ask every process reading from this cache to let go of the files it only keeps open (`pressed`)."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / CACHE_PRESSURE).touch()

    def pressure(self) -> float:
        """When room was last asked for (0: never)."""
        try:
            return (self.root / CACHE_PRESSURE).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    @contextmanager
    def locked(self):
        """The cache's one lock, across processes (flock: released if the holder dies)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / CACHE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def walk(self) -> tuple[int, list[tuple[float, str, int]], set[str]]:
        """(bytes on disk now, fetched files as (last use, path, bytes), files being downloaded). Under the lock:
        leftovers of downloads whose process died are removed on the way. Plain strings and scandir: this runs
        before every download, over every file the cache holds."""
        used, files, busy = 0, [], set()
        root = str(self.root)
        stack = [(root, False)]  # (folder, whether it lies in some <id>/files/)
        while stack:
            folder, fetched = stack.pop()
            try:
                used += os.stat(folder).st_blocks * 512
                entries = list(os.scandir(folder))
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        in_files = entry.name == DATASET_FILES and os.path.dirname(folder) == root
                        stack.append((entry.path, fetched or in_files))
                        continue
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                owner = _part_owner(entry.name)
                if owner is not None and not pid_alive(owner):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass
                    continue
                used += st.st_blocks * 512
                if owner is not None:
                    busy.add(entry.path[: -len(DOWNLOAD_PART)].rpartition(".")[0])
                elif fetched:
                    files.append((st.st_mtime, entry.path, st.st_blocks * 512))
        return used, files, busy

    def reserve(self, target: Path, size: int, evict: bool = True) -> tuple[Path, int] | None:
        """Under the lock: room for `target` (its whole size and any folder it needs), made by removing the least
        recently used fetched files nobody holds (unless not `evict`), and its temporary file
        '<target>.<pid>.part' with that size allocated; returns (part, open descriptor), or None while another
        process is downloading `target`. Raises CacheFull (with the bytes missing) when no room can be made."""
        used, files, busy = self.walk()
        if str(target) in busy:
            return None
        new_dirs, parent = 0, target.parent
        while not parent.exists():
            new_dirs += 1
            parent = parent.parent
        need = self.on_disk(size) + new_dirs * self.block
        for _, path, taken in sorted(files) if evict else ():
            if used + need <= self.max_bytes:
                break
            if _evict(path):
                home = self.root / Path(path).relative_to(self.root).parts[0]
                used -= taken + _remove_empty_parents(Path(path).parent, home / DATASET_FILES)
        if used + need > self.max_bytes:
            raise CacheFull(str(used + need - self.max_bytes))
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f"{target.name}.{os.getpid()}{DOWNLOAD_PART}")
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if size:
                os.posix_fallocate(fd, 0, int(size))
        except BaseException:
            os.close(fd)
            part.unlink(missing_ok=True)
            raise
        return part, fd


def _evict(path: str) -> bool:
    """Remove a fetched file unless a process holds it (a reader's shared lock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
    return True


def _remove_empty_parents(folder: Path, stop: Path) -> int:
    """Remove `folder` and its parents up to `stop` while empty; returns the bytes their blocks took."""
    freed = 0
    while folder != stop and stop in folder.parents:
        try:
            size = folder.stat().st_blocks * 512
            folder.rmdir()
        except OSError:
            break
        freed += size
        folder = folder.parent
    return freed


def _hold(path: Path) -> int | None:
    """A shared lock on the file at `path` (what eviction respects), marked as just used; None when it is not there
    (or was evicted while this process opened it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    os.utime(path)  # the least-recently-used clock
    return fd


class RemoteFiles:
    """The files of one version of a dataset in object storage, as a reader sees them: paths under `root` (the
    cached meta's root, a LeRobot layout) map to cached copies of the pinned versions, fetched on first use."""

    def __init__(self, url: str, options: dict, root: Path, pins: dict[str, dict], cache: FileCache,
                 wait_seconds: float, store_totals: dict | None = None):
        self.url, self.options, self.root, self.pins = url.rstrip("/"), dict(options), Path(root), pins
        self.cache, self.wait_seconds = cache, float(wait_seconds)
        self.store_totals = dict(store_totals or {})  # {"files", "bytes"}: the store's data and video files
        self.objects = self.root.parent / DATASET_FILES
        self._store, self._pid, self._ahead = None, None, None

    def __getstate__(self):  # a DataLoader worker opens its own connection and reads ahead for itself
        return {**self.__dict__, "_store": None, "_pid": None, "_ahead": None}

    def store(self):
        """This process's client of the store: one, shared by its reader and read-ahead threads (making one costs
        ~0.1 s of CPU: five made at once delayed a worker's first batch by a second)."""
        from opentau_cli.store.remote import open_remote

        with _STORE_LOCK:
            if self._store is None or self._pid != os.getpid():
                self._store = open_remote(self.url, {**self.options, "retry_seconds": min(_REQUEST_RETRY_SECONDS,
                                                                                            self.wait_seconds)})
                self._pid = os.getpid()
            return self._store

    def rel(self, path: Path) -> str:
        return Path(path).relative_to(self.root).as_posix()

    def shown(self, text: str) -> str:
        """A message about a file of the layout, naming it by its URL."""
        return text.replace(str(self.root), self.url)

    def size(self, path: Path) -> int | None:
        pin = self.pins.get(self.rel(path))
        return None if pin is None else pin["size"]

    @property
    def watch_key(self) -> str:
        return str(self.cache.root)

    def pressed(self) -> bool:
        """Whether a process asked for room since this process last looked (data/files.py's watcher asks, one stat):
        then what this process only keeps open (video containers) is let go of."""
        when = self.cache.pressure()
        if when <= getattr(self, "_pressure_seen", 0.0):
            return False
        self._pressure_seen = when
        return True

    def open(self, path: Path) -> Lease:
        """`with files.open(path) as local:` the pinned version's local copy, held while the block reads it."""
        return self.lease(path)

    def lease(self, path: Path) -> Lease:
        rel = self.rel(path)
        pin = self.pins.get(rel)
        if pin is None:
            raise UserError(f"{self.url}/{rel} was not in the store when the run started (it is not among the files "
                            "the run's check pinned): restore the dataset's files, or train without the episodes "
                            "that read it (dataset.episodes).")
        local = self.local(rel, pin)
        fd = _hold(local)
        if fd is None:
            fd = self._fetch(rel, pin, local)
        return Lease(local, fd)

    def local(self, rel: str, pin: dict) -> Path:
        """Where the cache keeps the pinned version of `rel`."""
        return self.objects / f"{rel}.{_tag(pin['etag'])}"

    def _fetch(self, rel: str, pin: dict, local: Path) -> int:
        """Bring the pinned version of `rel` into the cache (or wait while another process brings it); returns a
        shared lock on it. Without room, this process lets go of the files it only keeps open and asks the other
        processes to do the same (`pressed`), then waits for them, for up to wait_seconds."""
        started = time.monotonic()
        while True:
            reserved = short = None
            with self.cache.locked():
                held = _hold(local)
                if held is not None:
                    return held
                try:
                    reserved = self.cache.reserve(local, pin["size"])
                except CacheFull as e:
                    short = int(str(e))
            if reserved is None:
                if short is not None:
                    if time.monotonic() - started > self.wait_seconds:
                        raise UserError(self.cache.too_small(
                            f"the files this run reads at once ({self.url}/{rel} needs {_shown_size(short)} more than "
                            "the files being read leave free)"))
                    release_held()
                    self.cache.press()
                # another process (or a read-ahead thread) is bringing it: small files come in milliseconds
                time.sleep((0.05 if short is not None else 0.005) * (1 + random.random()))
                continue
            held = self._bring(reserved, local, lambda out: self._download(rel, pin, out))
            if held is not None:
                return held

    def _bring(self, reserved: tuple[Path, int], local: Path, download, hold: bool = True) -> int | None:
        """Download into the reserved temporary file, then give it its name (and, if `hold`, a shared lock on it
        taken under the cache's lock, so that no eviction comes in between)."""
        part, fd = reserved
        try:
            with os.fdopen(fd, "r+b") as out:
                download(out)
                out.flush()
                os.fdatasync(out.fileno())  # a crash never leaves a torn file under the final name
            with self.cache.locked():
                os.replace(part, local)
                return _hold(local) if hold else None
        except BaseException:
            part.unlink(missing_ok=True)
            raise

    def read_ahead(self) -> None:
        """Called by each read of a sample in a data worker (a process that never forks: a fork while a thread
        holds the cache's lock would leave the lock held by the child); the first in a process starts threads that
        fetch the pinned data and video files the cache does not hold yet, into its free room
        only (never evicting), so that the first epoch's reads find them there. The processes of a machine share
        the work (a file another is fetching is skipped). A thread stops at the first file without room or that
        the store does not give at once: the reader that needs it fetches it as usual (waiting, retrying)."""
        if self._ahead == os.getpid():
            return
        self._ahead = os.getpid()
        todo = iter([rel for rel in sorted(self.pins) if rel.split("/", 1)[0] in ("data", "videos")])
        lock, stop = threading.Lock(), threading.Event()

        def work() -> None:
            while not stop.is_set():
                with lock:
                    rel = next(todo, None)
                try:
                    if rel is None or not self._fetch_ahead(rel):
                        return stop.set()
                except Exception:  # noqa: BLE001 (the reader meets the same problem and says it)
                    return stop.set()

        for _ in range(READ_AHEAD_THREADS):
            threading.Thread(target=work, name="opentau-read-ahead", daemon=True).start()

    def _fetch_ahead(self, rel: str) -> bool:
        """Fetch `rel` if the cache has free room for it; False when it has none."""
        pin = self.pins[rel]
        local = self.local(rel, pin)
        with self.cache.locked():
            if local.exists():
                return True
            try:
                reserved = self.cache.reserve(local, pin["size"], evict=False)
            except CacheFull:
                return False
        if reserved is not None:  # else another process is fetching it
            self._bring(reserved, local, lambda out: self.store().fetch_version(rel, out, pin["etag"], pin["size"]),
                        hold=False)
        return True

    def _download(self, rel: str, pin: dict, out) -> None:
        """The store's bytes of the pinned version into `out`, retried with backoff while the store does not answer,
        for up to wait_seconds (said once in this process's log)."""
        from opentau_cli.store.remote import ObjectChanged, RemoteError

        started, attempt, said = time.monotonic(), 0, False
        while True:
            try:
                self.store().fetch_version(rel, out, pin["etag"], pin["size"])
                if said:
                    print(f"{self.url}: the store answers again; {rel} read after {time.monotonic() - started:.0f} s.",
                          flush=True)
                return
            except FileNotFoundError:
                raise UserError(f"{self.url}/{rel} is no longer in the store (it was there when the run started): "
                                "restore it, or train without the episodes that read it (dataset.episodes).") from None
            except ObjectChanged as e:
                try:  # a store starting up may refuse a read it cannot check yet: only another ETag is a change
                    now = self.store().version(rel)
                except RemoteError:
                    now = pin
                if now is None or now["etag"] != pin["etag"]:
                    raise DataChanged(f"{self.url}/{rel} changed in the store while the run read the dataset (the "
                                      "run reads the versions its launch pinned)") from None
                error = e
            except RemoteError as e:
                error = e
            waited, why = time.monotonic() - started, str(error).rpartition(" failed: ")[2].rstrip(".")
            if waited >= self.wait_seconds:
                raise DataUnavailable(f"The store of {self.url} did not answer for {waited:.0f} s "
                                      f"(dataset.remote_wait_seconds) while {rel} was read ({why})")
            if not said:
                print(f"{self.url}: reading {rel} failed ({why}); retrying for up to {self.wait_seconds:g} s "
                      "(dataset.remote_wait_seconds) while training waits.", flush=True)
                said = True
            time.sleep(min(min(30.0, 0.5 * 2 ** attempt) * random.uniform(0.5, 1.0),
                           max(0.0, self.wait_seconds - waited)))
            attempt += 1


# --- before launch -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteDataset:
    """A dataset in object storage, resolved for one run: its cached meta and the versions it reads."""

    url: str
    revision: str
    files: RemoteFiles

    @property
    def root(self) -> Path:
        return self.files.root


def cache_for(dataset: DatasetConfig) -> FileCache:
    return FileCache(cache_root(), dataset.cache_max_gb)


def resolve(member: MixtureMember, dataset: DatasetConfig, prefix: str = "dataset") -> RemoteDataset:
    """List `member`'s dataset in its store, bring its meta/ into the cache and pin the versions of every file the run
    reads (`revision`); raises UserError with one sentence when the store, the credentials, the listing or the cap
    do not allow it. A revision the config already names must still be the store's (else the files changed)."""
    from opentau_cli.store.remote import RemoteError, open_remote, preflight

    url = str(member.root).rstrip("/")
    problem = preflight(url, member.remote_options)
    if problem:
        raise UserError(f"{prefix}.root {url}: {problem}")
    store = open_remote(url, member.remote_options)
    try:
        listing = store.objects("")
    except RemoteError as e:
        raise UserError(f"{prefix}.root {url}: {e}") from None
    if "meta/info.json" not in listing:
        raise UserError(f"{url}/meta/info.json is missing: '{url}' is not a LeRobot dataset (expected meta/info.json, "
                        "meta/episodes, data/).")
    cache = cache_for(dataset)
    meta_files = {k: v for k, v in listing.items() if k.startswith(DATASET_META + "/")}
    root = _cached_meta(cache, url, store, meta_files)
    from opentau_cli.data.hub import wanted_files

    try:
        wanted = {rel: listing[rel] for rel in wanted_files(root, member, dataset.num_cameras) if rel in listing}
    except UserError as e:  # meta/ that does not read: named by its URL
        raise UserError(str(e).replace(str(root), url)) from None
    pinned = {**meta_files, **wanted}
    revision = _digest(f"{rel}\t{pin['etag']}\t{pin['size']}" for rel, pin in sorted(pinned.items()))
    if member.revision and member.revision != revision:
        raise UserError(f"{prefix}.root {url} is no longer at version {member.revision} ({prefix}.revision): files the "
                        "run reads changed in the store; leave the revision out to train on them as they are.")
    largest = max(wanted, key=lambda rel: wanted[rel]["size"], default=None)
    meta_bytes = sum(cache.on_disk(v["size"]) for v in meta_files.values())
    if largest is not None and cache.on_disk(wanted[largest]["size"]) + meta_bytes > cache.max_bytes:
        at_least = (cache.on_disk(wanted[largest]["size"]) + meta_bytes) / GB
        raise UserError(f"dataset.cache_max_gb={cache.max_gb:g} cannot hold {url}'s meta/ and the largest file the "
                        f"run reads ({largest}, {_shown_size(wanted[largest]['size'])}): raise it to at least "
                        f"{at_least:.3g} (room for many files makes the reads wait less).")
    store_files = {k: v for k, v in listing.items() if k.split("/", 1)[0] in ("data", "videos")}
    record = {"url": url, "meta": root.name, "files": pinned,
              "store": {"files": len(store_files), "bytes": sum(v["size"] for v in store_files.values())}}
    pins = pins_file(root.parent, revision)
    if not pins.is_file():
        _write_json(cache, pins, record)
    return RemoteDataset(url, revision, RemoteFiles(url, member.remote_options, root, pinned, cache,
                                                    dataset.remote_wait_seconds, record["store"]))


def _write_json(cache: FileCache, path: Path, data: dict) -> None:
    """A small file of the cache's own, written whole (temp + rename) within the cap."""
    body = json.dumps(data, sort_keys=True).encode()
    while not path.is_file():
        with cache.locked():
            try:
                reserved = cache.reserve(path, len(body))
            except CacheFull:
                raise UserError(cache.too_small(f"the run's record of the files it reads in {cache.root}")) from None
            if reserved is not None:  # else another process is writing the same record
                part, fd = reserved
                with os.fdopen(fd, "r+b") as f:
                    f.write(body)
                os.replace(part, path)
                return
        time.sleep(0.05)


def _cached_meta(cache: FileCache, url: str, store, meta_files: dict[str, dict]) -> Path:
    """The folder holding this version of the dataset's meta/ (fetched into the cache once per version)."""
    import shutil

    from opentau_cli.store.remote import RemoteError

    home = cache.root / dataset_id(url)
    version = _digest(f"{rel}\t{pin['etag']}" for rel, pin in sorted(meta_files.items()))
    root = cached_meta_dir(home, version)
    if root.is_dir():
        return root
    if not (home / DATASET_SOURCE).is_file():
        _write_json(cache, home / DATASET_SOURCE, {"url": url})
    staging = home / f".{root.name}.{os.getpid()}.dir"
    try:
        for rel, pin in sorted(meta_files.items()):
            with cache.locked():
                try:
                    reserved = cache.reserve(staging / rel, pin["size"])
                except CacheFull:
                    raise UserError(cache.too_small(f"even {url}'s meta/ files")) from None
            part, fd = reserved
            try:
                with os.fdopen(fd, "r+b") as out:
                    store.fetch_version(rel, out, pin["etag"], pin["size"])
            except (RemoteError, FileNotFoundError) as e:
                part.unlink(missing_ok=True)
                raise UserError(f"{url}/{rel} could not be read: {e}") from None
            os.replace(part, staging / rel)
        with cache.locked():
            try:
                staging.rename(root)
            except OSError:  # another process brought the same version meanwhile
                if not root.is_dir():
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def pin(cfg, index: int | None, resolved: RemoteDataset) -> None:
    """Name the pinned version in `cfg` (dataset, or dataset.mixture[index]): what the launch gives its ranks, so
    that each of them reads exactly these files."""
    target = cfg.dataset if index is None else cfg.dataset.mixture[index]
    target.revision = resolved.revision


def unpin(cfg) -> None:
    """Forget the versions a checkpoint's config names for its datasets in object storage: a resume compares what the
    store holds now with what the checkpoint recorded instead (data/fingerprint.py check_unchanged), and its launch
    pins what it will read."""
    for member in cfg.dataset.mixture if cfg.dataset.mixture is not None else [cfg.dataset]:
        if member.root and is_url(member.root) and not member.repo_id:
            member.revision = None


def open_files(member: MixtureMember, dataset: DatasetConfig, prefix: str = "dataset") -> RemoteFiles:
    """The pinned files of `member` for a process of the run: from the pins its launch wrote into this machine's cache
    (no listing), else (another machine, a tool on a checkpoint's config) resolved again, and refused when the store
    no longer holds that version."""
    url = str(member.root).rstrip("/")
    revision = member.revision or ""
    pins = pins_file(cache_root() / dataset_id(url), revision)
    if _REVISION.match(revision) and pins.is_file():
        record = json.loads(pins.read_text())
        root = pins.parent.parent / f"{record['meta']}"
        if (root / DATASET_META / "info.json").is_file():
            return RemoteFiles(url, member.remote_options, root, record["files"], cache_for(dataset),
                               dataset.remote_wait_seconds, record["store"])
    return resolve(member, dataset, prefix).files


def member_files(member: MixtureMember, dataset: DatasetConfig, prefix: str = "dataset"):
    """How a process reads `member`: (the local root its meta is read from, the files object its readers go through):
    a dataset in object storage through the cache, any other where it is (the demo generated, a Hub snapshot in the
    Hugging Face cache)."""
    if member.root and is_url(member.root) and not member.repo_id:
        files = open_files(member, dataset, prefix)
        return files.root, files
    from opentau_cli.data.hub import dataset_root

    return dataset_root(member, dataset.num_cameras, prefix), LOCAL
