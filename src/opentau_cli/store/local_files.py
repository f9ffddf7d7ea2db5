"""Small files written so that a reader or a second writer never sees them half done: a directory's entries made
durable, and the conditional writes of a directory store (store/storage.py; the writer's lease, process/lease.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def content_version(data: bytes) -> str:
    """A small object's version where the store gives none: the hash of its content."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(bytes(data))


def read_file_version(path: Path) -> tuple[bytes, str, float] | None:
    """A file's content, version and age (this machine's clock against the file's modification time)."""
    import time

    try:
        data, mtime = Path(path).read_bytes(), Path(path).stat().st_mtime
    except FileNotFoundError:
        return None
    return data, content_version(data), max(0.0, time.time() - mtime)


def synced_temp(path: Path, data: bytes) -> Path:
    """A temporary file beside `path` (its directory made if need be) holding `data`, on disk: for a rename or a
    link into place. The caller removes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_file_new(path: Path, data: bytes) -> str | None:
    """Create `path` holding `data` if no file is there, atomically: the whole content is written under a temporary
    name, then hard-linked to `path`, which fails where a file exists (atomic on local filesystems and NFS)."""
    path = Path(path)
    tmp = synced_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return content_version(data)


def write_file_if(path: Path, data: bytes, version: str) -> str | None:
    """Replace `path` with `data` if it still holds the content of `version`: read, compare and rename under an
    exclusive lock of its directory (flock: one host, or NFS with working locks), so two writers never both win."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                current = content_version(path.read_bytes())
            except FileNotFoundError:
                return None
            if current != version:
                return None
            tmp = synced_temp(path, data)
            try:
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(path.parent)
            return content_version(data)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        os.close(lock)
