"""A streaming safetensors writer: the header is computed from names, shapes and dtypes first, then each tensor's
bytes are produced and written one at a time, so only one tensor is ever in memory. Output is atomic."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable, Iterable

import torch

_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class TensorEntry:
    """A tensor to write: its name, final shape and dtype, and a function that produces it when its turn comes."""

    name: str
    shape: tuple
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

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


def write_safetensors(path: Path, entries: list[TensorEntry], metadata: dict[str, str] | None = None,
                      on_tensor: Callable[[TensorEntry], None] | None = None) -> Path:
    """Write entries to `path` via `.<name>.tmp` in the same directory, fsync, rename. Nothing is left on failure."""
    path = Path(path)
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header_bytes(entries, metadata))
            for e in entries:
                t = e.produce()
                if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                    raise ValueError(f"{e.name}: produced {t.dtype} {tuple(t.shape)}, planned {e.dtype} {tuple(e.shape)}")
                if t.numel():
                    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
                del t
                if on_tensor:
                    on_tensor(e)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
