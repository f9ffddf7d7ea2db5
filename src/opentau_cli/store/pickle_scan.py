"""Vet the pickles of a checkpoint before a library loader (Accelerate's RNG states, DeepSpeed's shards, torch.load
with weights_only=False) unpickles them: every Python global a file references must be on an allow-list.

The scan runs a pickle machine whose every global is an inert stand-in, so scanning constructs and calls nothing.
It does not import torch (the launcher runs it before any process is spawned).
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

_STORAGES = ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool", "Untyped",
             "ComplexFloat", "ComplexDouble", "Float8_e4m3fn", "Float8_e5m2")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")

# Globals that Accelerate / DeepSpeed / torch.save legitimately put into the files of a checkpoint.
ALLOWED_GLOBALS = {
    "collections.OrderedDict", "builtins.set", "builtins.frozenset", "builtins.slice", "builtins.complex",
    "torch._utils._rebuild_tensor_v2", "torch._tensor._rebuild_from_type_v2", "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state", "torch.Size", "torch.Tensor", "torch.nn.parameter.Parameter",
    "torch.torch_version.TorchVersion",
    "_codecs.encode", "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
    "numpy.random._pickle.__randomstate_ctor", "numpy.random._pickle.__bit_generator_ctor",
    "numpy.random._pickle.__generator_ctor", "numpy.random._mt19937.MT19937", "numpy.random.mtrand.RandomState",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
} | {f"torch.{n}Storage" for n in _STORAGES} | {f"torch.{n}" for n in _DTYPES}
_NUMPY_DTYPE_CLASS = re.compile(r"^numpy\.dtypes\.\w+DType$")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


class UnsafePickleError(Exception):
    """A file references a Python global outside the allow-list (or is not a readable pickle)."""


class _Inert:
    """Absorbs whatever the pickle does to it (call, state, items); constructs nothing real."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _ScanUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path):
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        if full in ALLOWED_GLOBALS or _NUMPY_DTYPE_CLASS.match(full):
            return OrderedDict if full == "collections.OrderedDict" else _Inert
        raise UnsafePickleError(
            f"{self.path} references the Python global '{full}', which a checkpoint has no reason to contain; "
            "refusing to load it (it could run arbitrary code)"
        )

    def persistent_load(self, pid):
        return _Inert()


def _pickle_bytes(path: Path) -> bytes:
    """The pickle stream of a file: torch.save's zip (its data.pkl record) or a plain pickle."""
    if not zipfile.is_zipfile(path):
        return path.read_bytes()
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(names) != 1:
                raise UnsafePickleError(f"{path} is a zip file without a single data.pkl: not a torch checkpoint file")
            info = zf.getinfo(names[0])
        return _stored_record(path, info)
    except (zipfile.BadZipFile, OSError, struct.error, ValueError) as e:
        raise UnsafePickleError(f"{path} is truncated or corrupt ({e})") from None


def record_data_start(path: Path, info: zipfile.ZipInfo, size: int) -> int:
    """Offset of a stored record's bytes in a `size`-byte torch.save zip, from its local header; ValueError naming
    the file if the record is compressed, the header is not one, or the file ends before the record does."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: compressed record {info.filename} (not written by torch.save)")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"{path} is truncated or corrupt (bad local header)")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > size:
        raise ValueError(f"{path} is truncated")
    return start


def _stored_record(path: Path, info: zipfile.ZipInfo) -> bytes:
    """A record's bytes read at its offset, without zipfile's CRC check: checkpoints are written without zip CRCs
    (their integrity is the manifest's hash, docs/ARCHITECTURE.md "Checkpoint contract")."""
    try:
        start = record_data_start(path, info, path.stat().st_size)
    except ValueError as e:
        raise UnsafePickleError(str(e)) from None
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(info.file_size)


def scan_pickle_file(path: Path) -> None:
    """Raise UnsafePickleError if the pickle in `path` references a non-allow-listed global or cannot be read."""
    path = Path(path)
    data = _pickle_bytes(path)
    try:
        _ScanUnpickler(data, path).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # malformed pickle: refuse it too, in one line
        raise UnsafePickleError(f"{path}: unreadable pickle ({type(e).__name__}: {e})") from None


def scan_checkpoint_pickles(ckpt_dir: Path) -> list[str]:
    """One line per pickle file under ckpt_dir that is unsafe or unreadable; [] when every one passes."""
    problems = []
    for p in sorted(Path(ckpt_dir).rglob("*")):
        if p.is_file() and p.suffix in PICKLE_SUFFIXES:
            try:
                scan_pickle_file(p)
            except UnsafePickleError as e:
                problems.append(str(e))
    return problems
