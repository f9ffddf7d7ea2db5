"""How a dataset's readers reach its files (data/dataset.py, data/video.py): `LOCAL` reads them where they lie;
data/remote.py's `RemoteFiles` gives cached copies of a dataset in object storage. A reader holds a file (`Lease`)
while it reads it, which keeps the cache from evicting it (docs/ARCHITECTURE.md, "Datasets in object storage")."""

from __future__ import annotations

import os
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
# asked to let go when the cache has no room for a file this process needs.
_HOLDERS: list = []


def register_holder(release) -> None:
    """`release()` closes what its owner keeps open (a bound method, kept weakly)."""
    _HOLDERS.append(weakref.WeakMethod(release))


def release_held() -> None:
    """Ask every holder of this process to let go of what it keeps open."""
    for ref in list(_HOLDERS):
        method = ref()
        if method is None:
            _HOLDERS.remove(ref)
        else:
            method()


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

    def pressed(self) -> bool:
        return False


LOCAL = LocalFiles()
