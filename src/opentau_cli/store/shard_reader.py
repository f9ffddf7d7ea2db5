"""Read `torch.save` zip files (DeepSpeed's `.pt` shards) without executing pickled code and without loading data.

A restricted unpickler resolves only an allow-list of globals: containers and torch's own tensor-rebuild functions
become plain Python values and `LazyTensor` references (file offset, dtype, shape); DeepSpeed's bookkeeping objects
(loss scaler, enums) become inert `Opaque` stand-ins whose real classes are never imported or called. Any other
global (`os.system`, `builtins.eval`, ...) is refused. Tensor bytes are read only when asked, slice by slice, with
plain file reads, so memory stays near the slice being read.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from opentau_cli.errors import UserError
from opentau_cli.store.pickle_scan import record_data_start
from opentau_cli.store.safetensors_writer import FileSpan


class UnsafeCheckpointError(Exception):
    """The file references a Python global outside the allow-list: it is refused, never executed."""


class ShardFormatError(Exception):
    """The file is not a readable torch zip checkpoint (truncated, corrupt, or another format)."""


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "UntypedStorage": torch.uint8,
}
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in set(_STORAGE_DTYPES.values())}


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


class Opaque:
    """Inert stand-in for a DeepSpeed object in a pickle: keeps its name and raw state, runs none of its code."""

    def __init__(self, name: str, args=(), state=None):
        self.name, self.args, self.state = name, args, state

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque({self.name})"


def _opaque_factory(name: str):
    class _Stub(Opaque):
        def __new__(cls, *args, **kwargs):
            obj = object.__new__(cls)
            Opaque.__init__(obj, name, args)
            return obj

        def __init__(self, *args, **kwargs):  # arguments kept by __new__
            pass

    _Stub.__name__ = _Stub.__qualname__ = name.rsplit(".", 1)[-1]
    return _Stub


@dataclass
class LazyTensor:
    """A tensor inside a shard file: nothing is read until `read()` / `read_flat()`."""

    shard: "ShardFile"
    storage: _StorageRef
    offset: int  # in elements, into the storage
    shape: tuple
    stride: tuple

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def numel(self) -> int:
        return prod(self.shape)

    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for n in reversed(self.shape):
            expected.append(acc)
            acc *= n
        return tuple(reversed(expected)) == tuple(self.stride) or self.numel() <= 1

    def read_flat(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements [start, start+count) of this (contiguous) tensor, flattened; reads only those bytes."""
        if not self.is_contiguous():
            return self.read().reshape(-1)[start : start + (self.numel() - start if count is None else count)].clone()
        count = self.numel() - start if count is None else count
        if start < 0 or count < 0 or start + count > self.numel():
            raise ShardFormatError(f"{self.shard.path}: read past the end of a tensor")
        return self.shard.read_elements(self.storage, self.offset + start, count)

    def file_spans(self, start: int = 0, count: int | None = None) -> list[FileSpan] | None:
        """Where in the file elements [start, start+count) of this tensor lie (None unless it is contiguous)."""
        if not self.is_contiguous():
            return None
        count = self.numel() - start if count is None else count
        if start < 0 or count < 0 or start + count > self.numel():
            raise ShardFormatError(f"{self.shard.path}: read past the end of a tensor")
        return [self.shard.element_span(self.storage, self.offset + start, count)]

    def read(self) -> torch.Tensor:
        if self.is_contiguous():
            return self.read_flat().reshape(self.shape)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if self.numel() else 0
        base = self.shard.read_elements(self.storage, self.offset, span)
        return torch.as_strided(base, self.shape, self.stride).clone()


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return ("__lazy__", storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)  # func is itself an allow-listed rebuild function


def _rebuild_parameter(data, requires_grad, backward_hooks):
    return data


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    return data


_SAFE_GLOBALS = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
    ("torch", "Size"): tuple,
    ("torch", "Tensor"): "Tensor",
    ("torch.nn.parameter", "Parameter"): "Parameter",
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, shard: "ShardFile"):
        super().__init__(io.BytesIO(data))
        self.shard = shard

    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
        # DeepSpeed's bookkeeping classes (LossScaler, ZeroStageEnum, config objects): inert stand-ins.
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _opaque_factory(f"{module}.{name}")
        raise UnsafeCheckpointError(
            f"{self.shard.path} references the Python global '{module}.{name}', which a checkpoint has no reason to "
            "contain; refusing to load it (it could run arbitrary code)"
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise ShardFormatError(f"{self.shard.path}: unexpected persistent id in the pickle")
        storage_type, key, _location, numel = pid[1], str(pid[2]), pid[3], int(pid[4])
        if not isinstance(storage_type, _StorageType):
            raise ShardFormatError(f"{self.shard.path}: unknown storage type in the pickle")
        return _StorageRef(key, storage_type.dtype, numel)


def _materialize(obj, shard):
    """Turn the unpickler's tensor tuples into LazyTensor objects, walking containers."""
    if isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "__lazy__":
        _, storage, offset, shape, stride = obj
        return LazyTensor(shard, storage, int(offset), shape, stride)
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            obj[k] = _materialize(obj[k], shard)
        return obj
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            obj[i] = _materialize(v, shard)
        return obj
    if isinstance(obj, tuple):
        return tuple(_materialize(v, shard) for v in obj)
    return obj


class ShardFile:
    """One `torch.save` zip file opened for safe, lazy reading. `load()` returns its object tree."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._size = self.path.stat().st_size
        try:
            with zipfile.ZipFile(self.path) as zf:
                infos = {i.filename: i for i in zf.infolist()}
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise ShardFormatError(f"{self.path} is truncated or not a torch checkpoint file ({e})") from None
        pkl = [n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise ShardFormatError(f"{self.path} is not a torch checkpoint file (no data.pkl)")
        self._prefix = pkl[0][: -len("data.pkl")]
        self._infos = infos
        byteorder = infos.get(self._prefix + "byteorder")
        if byteorder is not None and self._read_record(byteorder) != b"little":
            raise ShardFormatError(f"{self.path} was written on a big-endian machine; not supported")
        self._offsets: dict[str, tuple[int, int]] = {}

    def _data_start(self, info: zipfile.ZipInfo) -> int:
        try:
            return record_data_start(self.path, info, self._size)
        except ValueError as e:
            raise ShardFormatError(str(e)) from None

    def _read_record(self, info: zipfile.ZipInfo) -> bytes:
        start = self._data_start(info)
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(info.file_size)
        if len(data) != info.file_size:
            raise ShardFormatError(f"{self.path} is truncated")
        return data

    def load(self):
        data = self._read_record(self._infos[self._prefix + "data.pkl"])
        try:
            obj = _RestrictedUnpickler(data, self).load()
        except (UnsafeCheckpointError, ShardFormatError):
            raise
        except Exception as e:  # a malformed pickle must not escape as a random traceback
            raise ShardFormatError(f"{self.path}: unreadable pickle ({type(e).__name__}: {e})") from None
        return _materialize(obj, self)

    def element_span(self, storage: _StorageRef, start: int, count: int) -> FileSpan:
        """Where `count` elements of a storage from element `start` lie in the file (checked against its record)."""
        if storage.key not in self._offsets:
            info = self._infos.get(f"{self._prefix}data/{storage.key}")
            if info is None:
                raise ShardFormatError(f"{self.path}: storage record {storage.key} is missing")
            self._offsets[storage.key] = (self._data_start(info), info.file_size)
        base, nbytes = self._offsets[storage.key]
        item = torch.empty((), dtype=storage.dtype).element_size()
        if (start + count) * item > nbytes:
            raise ShardFormatError(f"{self.path}: tensor data runs past its storage record")
        return FileSpan(self.path, base + start * item, count * item)

    def read_elements(self, storage: _StorageRef, start: int, count: int) -> torch.Tensor:
        """`count` elements of a storage from element `start`, read straight from the file into a new tensor."""
        span = self.element_span(storage, start, count)
        out = torch.empty(count, dtype=storage.dtype)
        if count:
            buf = out.view(torch.uint8).numpy() if storage.dtype != torch.bool else out.numpy().view("uint8")
            with open(self.path, "rb", buffering=0) as f:
                got = os.preadv(f.fileno(), [memoryview(buf)], span.offset)
            if got != span.nbytes:
                raise ShardFormatError(f"{self.path} is truncated")
        return out


def load_shard(path: Path):
    """The object tree of a torch.save file with tensors as LazyTensor. A non-allow-listed global, an unreadable or
    a truncated file is a UserError whose message names the file (and the global)."""
    try:
        return ShardFile(path).load()
    except (UnsafeCheckpointError, ShardFormatError) as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"Cannot read {path}: {e.strerror or e}") from None
