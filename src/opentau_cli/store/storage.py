"""The storage seam: the few operations a checkpoint needs from where it lives (docs/ARCHITECTURE.md, "Layers").

A save is always written to local disk first and published there by an atomic rename: Accelerate, DeepSpeed and
DCP write files, not objects. Whatever else holds a run's checkpoints (a mounted share, an object store) is reached
through a `Storage`, whose keys are '/'-separated paths under its root. Its contract, which the checkpoint code relies
on and nothing more: `write_bytes` and `put_file` are atomic for readers (a reader sees the whole new content or the
old, never part), `put_file` returns the content's checksum as the store records it and `checksum` gives the stored
object's, computed on the store's side where it can (else read back), so that an upload is checked by comparing the
two; `read_bytes` / `get_file` raise FileNotFoundError for a missing key; `list` names every key under a prefix
(recursively), `sizes` / `objects` with each key's size / version (what changes when the object is replaced);
`delete` removes keys that exist and ignores the others; `copy` copies an object within the store; `put_files` may
report the bytes it sends as they go (`sending`, for a progress display only); `cancel` stops the transfers in flight
for good (the process is ending: nothing may keep it alive to finish sending). `LocalStorage` is a directory on this
machine; store/remote.py is an object store or any other fsspec URL.

Conditional writes, for the writer's lease (process/lease.py; docs/ARCHITECTURE.md, "Remote checkpoints"):
`read_version` gives a small object's content, its version (the store's ETag, or a hash of the content) and its age
by the store's own clock; `write_new` creates an object only where none is, `write_if` replaces one only while it is
still the version given; both return the new version, or None when the condition failed (another writer was first).
`conditional` says whether the store makes that check and the write one atomic step (S3 and its compatible stores
with `If-None-Match` / `If-Match`, a directory with an exclusive create and a lock) or checks, then writes (other
fsspec stores: a window of one request).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Protocol

from opentau_cli.store.local_files import (  # noqa: F401 (fsync_dir: its users import it from here)
    fsync_dir, read_file_version, write_file_if, write_file_new,
)


class Storage(Protocol):
    url: str

    def read_bytes(self, key: str) -> bytes: ...
    def write_bytes(self, key: str, data: bytes) -> None: ...
    def put_file(self, local: Path, key: str) -> str: ...
    def put_files(self, pairs: list[tuple[Path, str]], sending: Callable[[int], None] | None = None
                  ) -> dict[str, str]: ...
    def get_file(self, key: str, local: Path) -> None: ...
    def get_files(self, pairs: list[tuple[str, Path]]) -> None: ...
    def checksum(self, key: str) -> str | None: ...
    def size(self, key: str) -> int | None: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def sizes(self, prefix: str = "") -> dict[str, int]: ...
    def objects(self, prefix: str = "") -> dict[str, dict]: ...
    def delete(self, keys: list[str]) -> None: ...
    def copy(self, src: str, dst: str) -> None: ...
    def cancel(self) -> None: ...
    conditional: bool
    def read_version(self, key: str) -> tuple[bytes, str, float] | None: ...
    def write_new(self, key: str, data: bytes) -> str | None: ...
    def write_if(self, key: str, data: bytes, version: str) -> str | None: ...



class LocalStorage:
    """A directory on this machine (a local disk or a mounted share): atomic by write-to-temp, fsync, rename."""

    conditional = True

    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = self.root.resolve().as_uri()

    def _path(self, key: str) -> Path:
        parts = [p for p in key.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"not a storage key: {key!r}")
        return self.root.joinpath(*parts)

    def read_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def write_bytes(self, key: str, data: bytes) -> None:
        self._replace(key, lambda f: f.write(data))

    def put_file(self, local: Path, key: str) -> str:
        with open(local, "rb") as src:
            self._replace(key, lambda f: shutil.copyfileobj(src, f, 16 << 20))
        return _xxh3(Path(local))

    def put_files(self, pairs: list[tuple[Path, str]], sending: Callable[[int], None] | None = None) -> dict[str, str]:
        return {key: self.put_file(local, key) for local, key in pairs}

    def get_file(self, key: str, local: Path) -> None:
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), local)

    def get_files(self, pairs: list[tuple[str, Path]]) -> None:
        for key, local in pairs:
            self.get_file(key, local)

    def checksum(self, key: str) -> str | None:
        """Read back: a directory has no checksum of its own."""
        path = self._path(key)
        return _xxh3(path) if path.is_file() else None

    def copy(self, src: str, dst: str) -> None:
        self.put_file(self._path(src), dst)

    def cancel(self) -> None:
        """Nothing to stop: a copy runs in its caller's thread."""

    def read_version(self, key: str) -> tuple[bytes, str, float] | None:
        return read_file_version(self._path(key))

    def write_new(self, key: str, data: bytes) -> str | None:
        return write_file_new(self._path(key), data)

    def write_if(self, key: str, data: bytes, version: str) -> str | None:
        return write_file_if(self._path(key), data, version)

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())

    def sizes(self, prefix: str = "") -> dict[str, int]:
        return {key: (self.root / key).stat().st_size for key in self.list(prefix)}

    def objects(self, prefix: str = "") -> dict[str, dict]:
        """{key: {"size", "etag"}}: a file's version is its size and modification time (a replaced file has another)."""
        out = {}
        for key in self.list(prefix):
            st = (self.root / key).stat()
            out[key] = {"size": st.st_size, "etag": f"{st.st_size}@{st.st_mtime_ns}"}
        return out

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            for parent in path.parents:  # as in an object store, no folder outlives its last key
                if parent == self.root or not parent.is_relative_to(self.root):
                    break
                try:
                    parent.rmdir()
                except OSError:
                    break

    def _replace(self, key: str, write) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def _xxh3(path: Path) -> str:
    from opentau_cli.store.manifest import HASH_NAME, hash_file

    return f"{HASH_NAME}:{hash_file(path)}"


def is_url(text: str) -> bool:
    """`scheme://...`: a storage URL rather than a local path."""
    scheme, sep, _ = str(text).partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum() and scheme[:1].isalpha()


def open_storage(url: str, options: dict | None = None) -> Storage:
    """The storage at `url`: a `file://` URL is a directory here (a mounted share); anything else goes to the object
    store client (store/remote.py)."""
    scheme, _, rest = url.partition("://")
    if scheme == "file":
        return LocalStorage(Path("/" + rest.lstrip("/")))
    from opentau_cli.store.remote import open_remote

    return open_remote(url, options or {})


def check_storage(url: str, options: dict | None = None) -> str | None:
    """One sentence on why `url` cannot hold a run's checkpoints (an unknown scheme, a missing bucket, wrong
    credentials, an unreachable endpoint, a directory that cannot be written), or None; quick, without long retries."""
    scheme, _, rest = url.partition("://")
    if scheme == "file":
        path = Path("/" + rest.lstrip("/"))
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is None or not existing.is_dir():
            return f"checkpoint.remote {url}: {existing} is not a directory."
        if not os.access(existing, os.W_OK | os.X_OK):
            return f"checkpoint.remote {url}: {existing} is not writable."
        return None
    from opentau_cli.store.remote import preflight

    return preflight(url, options or {})
