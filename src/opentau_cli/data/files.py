"""How a dataset's readers reach its files (data/dataset.py, data/video.py): `LOCAL` reads them where they lie;
data/remote.py's `RemoteFiles` gives cached copies of a dataset in object storage. A reader holds a file (`Lease`)
while it reads it, which keeps the cache from evicting it (docs/ARCHITECTURE.md, "Datasets in object storage")."""

from __future__ import annotations

import os
import threading
import time
import weakref
from pathlib import Path


class Lease:
    """A local file held for reading: eviction leaves it alone until `close`."""

    def __init__(self, path: Path, fd: int | None = None):
        self.path, self._fd = Path(path), fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


# Objects of this process that hold leases only to keep files open for later (data/video.py's open containers):
# asked to let go when the cache has no room for a file a process of the run needs.
_HOLDERS: list = []
_WATCHERS: dict = {}  # (pid, cache) -> the thread that lets go when another process asks (`register_holder`)
WATCH_SECONDS = 0.05


def register_holder(release, files) -> None:
    """`release(blocking)` closes what its owner keeps open (a bound method, kept weakly). `files`' `pressed()` says
    when another process asks for room: a thread of this process then calls it at once, so that a process whose
    readers sit idle (a DataLoader worker waiting for its next batch) never keeps the others waiting for room."""
    _HOLDERS.append(weakref.WeakMethod(release))
    key = (os.getpid(), files.watch_key)
    if key not in _WATCHERS:  # after a fork too: the parent's thread did not come along
        _WATCHERS[key] = threading.Thread(target=_watch, args=(files,), name="opentau-cache-room", daemon=True)
        _WATCHERS[key].start()


def _watch(files) -> None:
    while True:
        time.sleep(WATCH_SECONDS)
        if files.pressed():
            release_held(blocking=False)  # a holder busy reading lets go when it next needs room or is asked again


def release_held(blocking: bool = True) -> None:
    """Ask every holder of this process to let go of what it keeps open."""
    for ref in list(_HOLDERS):
        method = ref()
        if method is not None:
            method(blocking)
            continue
        try:  # its owner is gone (the watcher thread may have removed it first)
            _HOLDERS.remove(ref)
        except ValueError:
            pass


class LocalFiles:
    """A dataset on this machine's disk: its files are read where they are."""

    url = None

    def lease(self, path: Path) -> Lease:
        return Lease(path)

    def open(self, path: Path) -> Lease:
        return Lease(path)

    def size(self, path: Path) -> int | None:
        try:
            return Path(path).stat().st_size
        except OSError:
            return None

    def shown(self, text: str) -> str:
        return text

    def read_ahead(self) -> None:
        pass


LOCAL = LocalFiles()
