"""A streaming safetensors writer: the header is computed from names, shapes and dtypes first, then each tensor's
bytes are produced and written one at a time, so only one tensor is ever in memory. Output is atomic.

A tensor whose bytes already lie in files exactly as they are to be written (a consolidated fp32 weight is its fp32
master partitions end to end) names those byte ranges (`spans`): they are copied file to file by the kernel
(`os.copy_file_range`), never passing through this process's memory. Writeback to disk starts while later tensors are
still being copied, so the final fsync waits only for the tail (docs/ARCHITECTURE.md "Checkpoint contract").
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import torch

_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class FileSpan(NamedTuple):
    """`nbytes` bytes of the file at `path` from byte `offset`."""

    path: Path
    offset: int
    nbytes: int


@dataclass
class TensorEntry:
    """A tensor to write: its name, final shape and dtype, and a function that produces it when its turn comes.
    `spans`, when known, are the files' byte ranges that hold exactly its bytes, end to end (then they are copied
    rather than produced)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    spans: list[FileSpan] | None = None

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def header_bytes(entries: Iterable[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for e in entries:
        if e.dtype not in _CODES:
            raise ValueError(f"safetensors cannot store dtype {e.dtype} ({e.name})")
        header[e.name] = {"dtype": _CODES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


_WRITEBACK_EVERY = 64 * 2**20  # bytes written between two requests to start writing them to disk
# copy_file_range's refusals that mean "not between these two files" (another filesystem, an old kernel): write instead
_NO_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM, errno.ENODATA}


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: the final fsync does all the writing back
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it


class _Output:
    """The temp file being written, by its descriptor and our own position in it (writes and copies both name
    their offset): whole writes, kernel copies, early writeback."""

    def __init__(self, fd: int):
        self.fd, self.pos, self._flushed, self._copy = fd, 0, 0, hasattr(os, "copy_file_range")
        self._sources: dict[Path, int] = {}

    def write(self, data: memoryview) -> None:
        while data:
            n = os.pwrite(self.fd, data, self.pos)
            data, self.pos = data[n:], self.pos + n
        self._writeback()

    def copy(self, spans: list[FileSpan], produce: Callable[[], torch.Tensor]) -> None:
        start = self.pos
        try:
            for span in spans:
                self._copy_span(span)
        except OSError as e:
            if e.errno not in _NO_COPY:
                raise
            self._copy = False  # these files cannot be copied between: every tensor is produced from now on
            self.pos = start
            self.write_tensor(produce())
        self._writeback()

    def _copy_span(self, span: FileSpan) -> None:
        if not self._copy:
            raise OSError(errno.ENOSYS, "copy_file_range unavailable")
        src = self._sources.get(span.path)
        if src is None:
            src = self._sources[span.path] = os.open(span.path, os.O_RDONLY)
        offset, left = span.offset, span.nbytes
        while left:
            n = os.copy_file_range(src, self.fd, left, offset, self.pos)
            if n == 0:  # the source ends early (or its filesystem copies nothing): reading it says which
                raise OSError(errno.ENODATA, f"{span.path}: nothing to copy at byte {offset}")
            offset, left, self.pos = offset + n, left - n, self.pos + n

    def write_tensor(self, t: torch.Tensor) -> None:
        if t.numel():
            self.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))

    def _writeback(self) -> None:
        # Written data is pushed to the disk while the next tensors are copied: the fsync at the end then waits for
        # the last few MB, not the whole file (what `sync` after an unsynced write pays in full).
        if _SYNC_FILE_RANGE is not None and self.pos - self._flushed >= _WRITEBACK_EVERY:
            _SYNC_FILE_RANGE(self.fd, self._flushed, self.pos - self._flushed, _SYNC_FILE_RANGE_WRITE)
            self._flushed = self.pos

    def close_sources(self) -> None:
        for fd in self._sources.values():
            os.close(fd)
        self._sources.clear()


def write_safetensors(path: Path, entries: list[TensorEntry], metadata: dict[str, str] | None = None,
                      on_tensor: Callable[[TensorEntry], None] | None = None, *, rename: bool = True) -> Path:
    """Write entries to `path` via `.<name>.tmp-<pid>` in the same directory, fsync, rename. Nothing is left on
    failure. With rename=False the synced temp file is returned instead, for the caller to vouch for before it
    renames it (a file added to a checkpoint: tools/consolidate.py)."""
    path = Path(path)
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb", buffering=0) as f:
            out = _Output(f.fileno())
            try:
                out.write(memoryview(header_bytes(entries, metadata)))
                for e in entries:
                    if e.spans is not None:
                        if sum(s.nbytes for s in e.spans) != e.nbytes:
                            raise ValueError(f"{e.name}: its spans hold {sum(s.nbytes for s in e.spans)} bytes, "
                                             f"planned {e.nbytes}")
                        out.copy(e.spans, lambda e=e: _checked(e))
                    else:
                        out.write_tensor(_checked(e))
                    if on_tensor:
                        on_tensor(e)
            finally:
                out.close_sources()
            os.fsync(f.fileno())
        if not rename:
            return tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _checked(e: TensorEntry) -> torch.Tensor:
    t = e.produce()
    if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
        raise ValueError(f"{e.name}: produced {t.dtype} {tuple(t.shape)}, planned {e.dtype} {tuple(e.shape)}")
    return t
