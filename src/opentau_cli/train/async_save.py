"""Asynchronous checkpoint saves (`checkpoint.async_save`): the step blocks only while the state is copied into host
memory; a writer process of every rank writes its copy, a background thread waits for it, and rank 0 publishes once
every rank's part is written.

docs/ARCHITECTURE.md, "Checkpoint contract". The files are the ones `accelerator.save_state` writes, with the same
names and contents: under DeepSpeed, DeepSpeed's own `save_checkpoint` runs with a checkpoint engine that copies each
state dict instead of writing it (DeepSpeed still decides every file); otherwise the models, optimizers, schedulers
and RNG states that Accelerate saves are copied. The writer bypasses the page cache and hashes each file as it
writes it, so the manifest need not read it back (UncachedFile). The copy lies in shared memory that the writer
process maps (HostStaging): serializing, hashing and writing never hold the training process's GIL, which a writer
thread did, and on a machine whose cores are all busy a descheduled thread holding it stalled the training loop (a
save then cost more than a synchronous one). The background threads never run a collective on the training's process
group: the main thread learns their progress (CheckpointManager.poll), so the ranks agree on it. FSDP2's shards are
the exception to the writer process: DCP writes them from the background thread, coordinating over a gloo group of
its own (store/dcp.py ShardedState).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import math
import mmap
import os
import pickle
import random
import threading
import time
import weakref
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import xxhash

from opentau_cli.store.layout import MODEL_WEIGHTS, OPTIMIZER, SCHEDULER, rank_state_file
from opentau_cli.store.manifest import HASH_NAME

WRITER_NICE = 10  # how much lower the writer process's priority is than the training process's
Write = Callable[[], tuple[Path, int, str]]  # writes one file: (its path, size, hash as the manifest records it)
Job = Callable[[], None]


class HostStaging:
    """Host-memory copies of the tensors a save writes, and the process that writes them. A snapshot's tensors, of
    every file, lie back to back in one buffer of exactly their size (each at a multiple of its element size, the
    whole rounded up to a page): a shared-memory mapping (memfd) the writer process maps, pinned on CUDA so that the
    device-to-host copies run asynchronously. The first save allocates it and the next ones refill it (a save waits
    for the previous one), so host memory stays at one snapshot, `nbytes`, which is what the mapping holds. The
    writer process writes, hashes and syncs there, so the training process spends no CPU and no GIL on it. Without
    memfd (not Linux) the writes run in the calling thread, through `bounce`."""

    BOUNCE = 16 << 20  # the writer's aligned buffer (UncachedFile)

    def __init__(self, pin: bool | None = None):
        self._arena: _Arena | None = None  # the snapshot's one buffer
        self._pending: list[Staged] = []  # the files of the snapshot being taken, copied by `end`
        self._staged: dict[int, tuple] = {}  # id(host copy) -> where it lies, for the writer process (_StatePickler)
        self._keep: list[torch.Tensor] = []  # the host copies of the snapshot in flight (their ids stay theirs)
        self._pin = pin  # None: pin when the state is on CUDA
        self.bounce = mmap.mmap(-1, self.BOUNCE)  # page-aligned, as O_DIRECT needs
        self._writer: _WriterProcess | None = None
        self.stats: list[dict] = []  # per file written by the writer process: bytes and CPU seconds by phase

    @property
    def nbytes(self) -> int:
        """Host memory held: the snapshot's buffer (whole pages) and the write buffer."""
        return (self._arena.size if self._arena else 0) + len(self.bounce)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors the last snapshot copied, alignment to their element sizes included."""
        return self._arena.used if self._arena else 0

    def describe(self) -> str:
        """What the log says of the host memory a snapshot holds."""
        mib = 2**20
        return (f"{self.nbytes / mib:.0f} MiB of host memory: one {'pinned ' if self._arena and self._arena.pinned else ''}"
                f"buffer of {self.tensor_bytes} bytes of tensors rounded up to {self._arena.size if self._arena else 0} "
                f"(whole pages), and a {self.BOUNCE // mib} MiB write buffer")

    def begin(self) -> None:
        self._pending, self._staged, self._keep = [], {}, []
        if self._writer is None and hasattr(os, "memfd_create"):
            # Started here, on the thread that runs the training loop: the writer dies with it (_writer_main).
            self._writer = _WriterProcess()

    def copy(self, obj) -> "Staged":
        """obj to be copied into host memory by `end` (every tensor replaced by its host copy, containers rebuilt,
        other values deep-copied). Tensors that are the same view of the same memory share one copy, as torch.save
        stores them once."""
        tensors: dict[tuple, torch.Tensor] = {}
        _walk(obj, tensors)
        staged = Staged(obj, tensors)
        self._pending.append(staged)
        return staged

    def end(self) -> None:
        """Copy every file's tensors of this snapshot into the one buffer (the previous snapshot's when the tensors
        are the same shapes, else a new one of exactly their size); wait for the device-to-host copies."""
        places, offset = [], 0
        for staged in self._pending:
            for t in staged.tensors.values():
                offset = -(-offset // t.element_size()) * t.element_size()
                places.append((t, offset))
                offset += t.numel() * t.element_size()
        layout = [(t.dtype, tuple(t.shape)) for t, _ in places]
        cuda = any(t.is_cuda for t, _ in places)
        if self._arena is None or self._arena.layout != layout:
            self._drop()
            pin = cuda if self._pin is None else self._pin
            self._arena = _Arena(offset, layout, shared=self._writer is not None, pin=pin)
            self._arena.views = [self._arena.view(off, t.dtype, tuple(t.shape)) for t, off in places]
        arena, views = self._arena, iter(zip(self._arena.views, places))
        for staged in self._pending:
            copies = {}
            for ident in staged.tensors:
                buf, (t, off) = next(views)
                with torch.no_grad():
                    buf.copy_(t.detach(), non_blocking=t.is_cuda)
                out = _saved_as(buf, t.requires_grad, isinstance(t, torch.nn.Parameter))
                self._staged[id(out)] = (arena.id, off, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                         t.requires_grad, isinstance(t, torch.nn.Parameter))
                self._keep.append(out)
                copies[ident] = out
            staged.value = _rebuild(staged.obj, copies)
            staged.obj = staged.tensors = None  # the live state is not held past the snapshot
        self._pending = []
        if cuda:
            torch.cuda.synchronize()

    def write(self, job: "FileWrite") -> tuple[Path, int, str]:
        """Write one file of the snapshot: in the writer process when there is one, else in this thread."""
        if isinstance(job.state, Staged):
            job = replace(job, state=job.state.value)
        if self._writer is None:
            return job.run(self.bounce)
        if self._arena.id not in self._writer.arenas:
            self._writer.share(self._arena)
        result, stats = self._writer.write(job, self._staged)
        self.stats.append(stats)
        return result

    def _drop(self) -> None:
        if self._arena is None:
            return
        if self._writer is not None:
            self._writer.forget(self._arena)
        self._arena.close()
        self._arena = None


@dataclass
class Staged:
    """One file's objects of a snapshot: the live ones until `HostStaging.end`, then `value`, their host copies."""

    obj: object
    tensors: dict
    value: object = None


def _ident(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())


def _walk(obj, found: dict) -> None:
    """Every tensor in obj (dicts, lists, tuples), once per view of the same memory, in the order torch.save meets them."""
    if isinstance(obj, torch.Tensor):
        found.setdefault(_ident(obj), obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, found)
    elif isinstance(obj, list) or type(obj) is tuple:
        for v in obj:
            _walk(v, found)


def _rebuild(obj, copies: dict):
    if isinstance(obj, torch.Tensor):
        return copies[_ident(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the dict's type (OrderedDict, ...)
        for k, v in obj.items():
            out[k] = _rebuild(v, copies)
        return out
    if isinstance(obj, list):
        return [_rebuild(v, copies) for v in obj]
    if type(obj) is tuple:
        return tuple(_rebuild(v, copies) for v in obj)
    return copy.deepcopy(obj)


class _Arena:
    """A snapshot's host copies, back to back in one mapping of whole pages: a memfd the writer process maps (shared),
    else anonymous memory. On CUDA it is pinned (page-locked), so that the device-to-host copies run asynchronously.
    `used`: the bytes the tensors take; `size`: the mapping's length, `used` rounded up to a page."""

    _next = 0

    def __init__(self, used: int, layout: list, *, shared: bool, pin: bool):
        _Arena._next += 1
        page = mmap.PAGESIZE
        self.id, self.used, self.layout = _Arena._next, used, layout
        self.size = max(page, -(-used // page) * page)
        self.fd = os.memfd_create("opentau-checkpoint", os.MFD_CLOEXEC) if shared else -1
        if shared:
            os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.views: list[torch.Tensor] = []
        self.pinned = pin and _pin(self.map, self.size)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        return _tensor_at(self.map, offset, dtype, shape)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(_address(self.map))
        self.views = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        # The mapping itself goes with the last tensor viewing it.


def _address(buf) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _pin(buf, size: int) -> bool:
    """Page-lock a host mapping for CUDA (cudaHostRegister); False where it cannot be (the copies then block)."""
    try:
        return int(torch.cuda.cudart().cudaHostRegister(_address(buf), size, 0)) == 0
    except Exception:
        return False


def _saved_as(buf: torch.Tensor, requires_grad: bool, parameter: bool) -> torch.Tensor:
    """A host copy as the original would be saved: a Parameter stays one, requires_grad is kept (the copy stays a
    leaf)."""
    if parameter:
        return torch.nn.Parameter(buf, requires_grad=requires_grad)
    return buf.detach().requires_grad_(requires_grad)


def _tensor_at(buf, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor of its own storage, exactly its size, over buf[offset:] (no copy)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)


def snapshot(accelerator, save_dir: Path, staging: HostStaging, save_kwargs: dict, extra: dict | None = None) -> list[Write]:
    """Copy this rank's part of `accelerator.save_state(save_dir, **save_kwargs)` into host memory; returns the writes
    that put it in save_dir. Runs on the main thread (under DeepSpeed it runs save_checkpoint's collectives); only
    small files (DeepSpeed's RNG states, `latest` and scripts) are written right away. `extra`: safetensors files
    this rank adds ({name: tensors}, e.g. its EMA), copied with the rest."""
    from opentau_cli.store.dcp import registered

    Path(save_dir).mkdir(parents=True, exist_ok=True)  # as save_state does
    staging.begin()
    if accelerator.state.deepspeed_plugin is not None:
        writes = _deepspeed_snapshot(accelerator, Path(save_dir), staging, save_kwargs)
    else:
        writes = _accelerate_snapshot(accelerator, Path(save_dir), staging)
    sharded = registered(accelerator)
    if sharded is not None:
        # FSDP2 (store/dcp.py): this rank's shards copied to host memory now; DCP writes them from the
        # background thread, its plan and metadata gathered over a gloo group of their own (never the training's).
        group = sharded.group()
        writes.insert(0, partial(sharded.write_staged, sharded.stage(), Path(save_dir), accelerator.process_index, group))
    for name, tensors in (extra or {}).items():
        writes.append(partial(staging.write, FileWrite(Path(save_dir) / name, staging.copy(tensors), safetensors=True)))
    staging.end()  # every file's tensors into the one buffer
    return writes


def _accelerate_snapshot(acc, save_dir: Path, staging: HostStaging) -> list[Write]:
    """What save_state saves without DeepSpeed (accelerate.checkpointing.save_accelerator_state), copied now."""
    from accelerate.utils.constants import SCALER_NAME

    if acc._custom_objects or acc._dataloaders:
        raise RuntimeError("async_save copies models, optimizers, schedulers and RNG states; this Accelerator also "
                           "checkpoints registered objects or prepared DataLoaders")
    writes: list[Write] = []
    rng = _rng_states(acc.step)
    writes.append(partial(staging.write, FileWrite(save_dir / rank_state_file(acc.process_index), rng)))
    if not acc.is_main_process:  # Accelerate's `save` writes the rest on the main process only
        return writes
    from opentau_cli.store.dcp import ShardedState

    weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
    for hook in acc._save_model_state_pre_hook.values():
        if not isinstance(hook, ShardedState):  # FSDP2's shards: every rank, staged by `snapshot`
            hook(acc._models, weights, str(save_dir))
    for i, state in enumerate(weights):
        name = _indexed(MODEL_WEIGHTS, i)
        writes.append(partial(staging.write, FileWrite(save_dir / name, staging.copy(state), safetensors=True)))
    for base, objects in ((OPTIMIZER, acc._optimizers), (SCHEDULER, acc._schedulers)):
        for i, obj in enumerate(objects):
            name = _indexed(base, i)
            writes.append(partial(staging.write, FileWrite(save_dir / name, staging.copy(obj.state_dict()))))
    if acc.scaler is not None:
        state = staging.copy(acc.scaler.state_dict())
        writes.append(partial(staging.write, FileWrite(save_dir / SCALER_NAME, state)))
    return writes


def _indexed(name: str, i: int) -> str:
    """Accelerate's name for the i-th model / optimizer / scheduler: model.safetensors, model_1.safetensors, ..."""
    return name if i == 0 else name.replace(".", f"_{i}.", 1)


def _rng_states(step: int) -> dict:
    """This rank's random states, as save_accelerator_state records them (CPU and CUDA)."""
    states = {"step": step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


class _DeferredWrites:
    """A DeepSpeed checkpoint engine that copies each state dict into host memory instead of writing it; everything
    else (create, makedirs, commit, load) is the engine's own. DeepSpeed's decoupled engine does not serve here: it
    refuses ZeRO-2's optimizer state (tensors that require grad cannot cross into its writer process), needs
    DeepSpeed's own launcher, and holds the next optimizer step until its writes are done."""

    def __init__(self, engine, staging: HostStaging):
        self._engine, self._staging = engine, staging
        self.deferred: list[tuple[dict, str]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def save(self, state_dict, path: str) -> None:
        self.deferred.append((self._staging.copy(state_dict), path))

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed then skips its own clone: the staged copies are already compact


def _deepspeed_snapshot(acc, save_dir: Path, staging: HostStaging, save_kwargs: dict) -> list[Write]:
    engines = [m for m in acc._models if hasattr(m, "checkpoint_engine")]
    capture = {id(e): _DeferredWrites(e.checkpoint_engine, staging) for e in engines}
    originals = {id(e): e.checkpoint_engine for e in engines}
    for e in engines:
        e.checkpoint_engine = capture[id(e)]
    try:
        acc.save_state(str(save_dir), safe_serialization=True, **save_kwargs)
    finally:
        for e in engines:
            e.checkpoint_engine = originals[id(e)]
    return [partial(staging.write, FileWrite(Path(path), state, zipfile=getattr(originals[i], "zipfile_serialization", True)))
            for i, c in capture.items() for state, path in c.deferred]


@dataclass
class FileWrite:
    """One file of a save: the objects (host copies) and how save_state would write them."""

    path: Path
    state: object
    safetensors: bool = False
    zipfile: bool = True  # torch.save's format (DeepSpeed's engine may ask for the legacy one)

    def run(self, bounce: mmap.mmap) -> tuple[Path, int, str]:
        if self.safetensors:
            return _save_safetensors(self.state, self.path, bounce)
        return _torch_save(self.state, self.path, bounce, self.zipfile)


def _torch_save(obj, path: Path, bounce: mmap.mmap, zipfile: bool = True) -> tuple[Path, int, str]:
    with UncachedFile(path, bounce) as f:
        torch.save(obj, f, _use_new_zipfile_serialization=zipfile)
    return f.result()


def _save_safetensors(state: dict, path: Path, bounce: mmap.mmap) -> tuple[Path, int, str]:
    """The file Accelerate's `save(state, path, safe_serialization=True)` writes, byte for byte, through an
    UncachedFile: shared tensors once, format=pt metadata, and the tensors in the order safetensors gives them (it
    sorts by dtype and name; asked here with empty stand-ins, so no data is copied)."""
    import json
    import struct
    from collections import OrderedDict

    from accelerate.utils.other import clean_state_dict_for_safetensors
    from safetensors.torch import save as safetensors_bytes

    from opentau_cli.store.safetensors_writer import TensorEntry, header_bytes

    if isinstance(state, OrderedDict):
        state = clean_state_dict_for_safetensors(state)
    layout = safetensors_bytes({name: torch.empty(0, dtype=t.dtype) for name, t in state.items()})
    order = [k for k in json.loads(layout[8:8 + struct.unpack("<Q", layout[:8])[0]]) if k != "__metadata__"]
    tensors = [(name, state[name].contiguous()) for name in order]
    entries = [TensorEntry(name, tuple(t.shape), t.dtype, lambda: None) for name, t in tensors]
    with UncachedFile(path, bounce) as f:
        f.write(header_bytes(entries, {"format": "pt"}))
        for _, t in tensors:
            f.write(t.reshape(-1).view(torch.uint8).numpy())
    return f.result()


class UncachedFile:
    """A file written around the page cache (O_DIRECT) through an aligned buffer, hashed as it is written and synced
    when closed: on a busy machine the kernel's copying and write-back of buffered writes, and reading the file back
    for the manifest, would take CPU from training, which this writer runs next to. The copies into the buffer
    release the GIL. Where the filesystem refuses O_DIRECT it writes the ordinary way. `cpu` adds up, over every
    file of this process, the CPU seconds of this thread spent hashing, copying into the buffer and writing (the
    write and sync system calls)."""

    BLOCK = 4096  # O_DIRECT's alignment of offsets and lengths
    cpu = {"hash": 0.0, "copy": 0.0, "write": 0.0}

    def __init__(self, path: Path, bounce: mmap.mmap):
        self._path, self._buf, self._fill, self._size = Path(path), bounce, 0, 0
        self._hash = getattr(xxhash, HASH_NAME)()
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(bounce))
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self._direct = hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self._direct else 0), 0o666)
        except OSError as e:
            if not self._direct or e.errno != errno.EINVAL:  # EINVAL: this filesystem does not do O_DIRECT
                raise
            self._direct = False
            self._fd = os.open(path, flags, 0o666)

    def __enter__(self) -> "UncachedFile":
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None:
                self._finish()
        finally:
            os.close(self._fd)

    def write(self, data) -> int:
        src = np.frombuffer(data, dtype=np.uint8)
        began = time.thread_time()
        self._hash.update(src)
        self.cpu["hash"] += time.thread_time() - began
        done = 0
        while done < src.size:
            n = min(src.size - done, len(self._buf) - self._fill)
            began = time.thread_time()
            ctypes.memmove(self._addr + self._fill, src.ctypes.data + done, n)
            self.cpu["copy"] += time.thread_time() - began
            self._fill += n
            done += n
            if self._fill == len(self._buf):
                self._drain(self._fill)
        self._size += src.size
        return src.size

    def flush(self) -> None:
        pass  # whole blocks go out as the buffer fills; the rest when the file is finished

    def _drain(self, length: int) -> None:
        began = time.thread_time()
        with memoryview(self._buf)[:length] as view:
            written = 0
            while written < length:
                written += os.write(self._fd, view[written:])
        self._fill = 0
        self.cpu["write"] += time.thread_time() - began

    def _finish(self) -> None:
        if self._fill:
            tail = self._fill
            if self._direct:  # a last whole block, cut back to the file's size below
                pad = -tail % self.BLOCK
                self._buf[tail:tail + pad] = bytes(pad)
                tail += pad
            self._drain(tail)
        began = time.thread_time()
        if self._direct:
            os.ftruncate(self._fd, self._size)
        os.fsync(self._fd)
        self.cpu["write"] += time.thread_time() - began

    def result(self) -> tuple[Path, int, str]:
        """(path, size, hash) of the finished file."""
        return self._path, self._size, self._hash.hexdigest()


class _StatePickler(pickle.Pickler):
    """Pickles a snapshot for the writer process: a host copy goes as where it lies in its arena (persistent id)."""

    def __init__(self, file, staged: dict[int, tuple]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._staged = staged

    def persistent_id(self, obj):
        return self._staged.get(id(obj)) if isinstance(obj, torch.Tensor) else None


class _StateUnpickler(pickle.Unpickler):
    """The writer process's side: a host copy becomes a tensor over the mapped arena; the same place, the same tensor
    (tied weights stay one object, as torch.save needs to store them once)."""

    def __init__(self, file, arenas: dict[int, mmap.mmap]):
        super().__init__(file)
        self._arenas, self._made = arenas, {}

    def persistent_load(self, pid):
        if pid not in self._made:
            arena, offset, dtype, shape, requires_grad, parameter = pid
            t = _tensor_at(self._arenas[arena], offset, getattr(torch, dtype), shape)
            self._made[pid] = _saved_as(t, requires_grad, parameter)
        return self._made[pid]


class _WriterProcess:
    """The process that writes this rank's snapshots (one per training process, started with its first async save).
    It is fed through a socket: an arena's memfd once, then per file a pickle that names places in the arenas. It
    writes under the file-size limit the training process has at that moment (RLIMIT_FSIZE), and dies with it."""

    def __init__(self):
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        env = dict(os.environ, OMP_NUM_THREADS="1")  # it never computes: no thread pool
        code = f"from opentau_cli.train.async_save import _writer_main; _writer_main({theirs.fileno()})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env,
                                      stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self.arenas: set[int] = set()
        weakref.finalize(self, _WriterProcess._stop, self._conn, self._proc)

    @staticmethod
    def _stop(conn, proc) -> None:
        conn.close()  # its end of the socket: the writer leaves
        try:
            proc.wait(timeout=10)
        except Exception:
            proc.kill()

    def share(self, arena: _Arena) -> None:
        from multiprocessing.reduction import send_handle

        with self._talking():
            self._conn.send(("arena", arena.id, arena.size))
            send_handle(self._conn, arena.fd, self._proc.pid)
        self.arenas.add(arena.id)

    @contextlib.contextmanager
    def _talking(self):
        """A lost connection is the writer's end: said so, not as a broken pipe (manager.describe_write_error)."""
        try:
            yield
        except (EOFError, OSError):
            raise RuntimeError(f"the checkpoint writer process ended (exit code {self._proc.poll()})") from None

    def forget(self, arena: _Arena) -> None:
        if arena.id in self.arenas:
            self.arenas.discard(arena.id)
            with contextlib.suppress(OSError):  # a writer that is gone has forgotten it
                self._conn.send(("forget", arena.id))

    def write(self, job: FileWrite, staged: dict[int, tuple]) -> tuple[tuple[Path, int, str], dict]:
        import io
        import resource

        payload = io.BytesIO()
        _StatePickler(payload, staged).dump(job)
        with self._talking():
            self._conn.send(("write", payload.getvalue(), resource.getrlimit(resource.RLIMIT_FSIZE)))
            ok, value, stats = self._conn.recv()
        if not ok:
            raise value
        return value, stats


def _writer_main(fd: int) -> None:
    """The writer process: write each file it is sent; leave when the training process closes the socket or dies."""
    import io
    import resource
    from multiprocessing.connection import Connection
    from multiprocessing.reduction import recv_handle

    from opentau_cli.process.runtime import die_with_parent

    # Die with the training process (the thread that started this one is its main thread, which outlives it).
    die_with_parent()
    # Below training and its data workers: on a machine whose cores are all busy the scheduler gives the writer the
    # CPU they leave (a nice-10 process gets about a tenth of a nice-0 one's share), so a save slows no step by more
    # than that share; it still finishes, only later (docs/ARCHITECTURE.md, "Asynchronous saves").
    with contextlib.suppress(OSError):
        os.nice(WRITER_NICE)
    conn = Connection(fd)
    arenas: dict[int, mmap.mmap] = {}
    bounce = mmap.mmap(-1, HostStaging.BOUNCE)
    from opentau_cli.store.format import skip_zip_crcs

    skip_zip_crcs()  # as the training process writes them
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "arena":
            handle = recv_handle(conn)
            arenas[message[1]] = mmap.mmap(handle, message[2])
            os.close(handle)
        elif message[0] == "forget":
            arenas.pop(message[1], None)
        else:
            _, payload, fsize = message
            before, cpu, job = dict(UncachedFile.cpu), time.process_time(), None
            try:
                resource.setrlimit(resource.RLIMIT_FSIZE, fsize)
                job = _StateUnpickler(io.BytesIO(payload), arenas).load()
                result = job.run(bounce)
                stats = {k: UncachedFile.cpu[k] - before[k] for k in before}
                stats.update(bytes=result[1], cpu=time.process_time() - cpu)
                reply = (True, result, stats)
            except Exception as e:
                reply = (False, e, None)
            del job  # the arenas' tensors go before the next message may forget an arena
            try:
                conn.send(reply)
            except Exception:  # an exception that does not pickle
                conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}"), None))


class BackgroundSave:
    """One checkpoint being written by a thread of this rank: first this rank's part (`write_part`); then, on rank 0,
    once the main threads have agreed that every rank's part is written (`publish`), the publish itself."""

    def __init__(self, step: int, tmp: Path, final: Path, write_part: Job, publish: Job | None):
        self.step, self.tmp, self.final = step, tmp, final
        self.publishing = False  # the main thread's view: every rank's part is written
        self.error: BaseException | None = None
        self._write_part, self._publish = write_part, publish
        self._written, self._go, self._done = threading.Event(), threading.Event(), threading.Event()
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write_part()
        except BaseException as e:  # reported by the main thread (CheckpointManager.poll) on every rank
            self.error = e
        self._written.set()
        if self.error is None and self._publish is not None:
            self._go.wait()
            if not self._abandoned:
                try:
                    self._publish()
                except BaseException as e:
                    self.error = e
        self._done.set()

    def raise_error(self) -> None:
        """Raise what stopped this rank's thread, if anything did."""
        if self.error is not None:
            raise self.error

    def progress(self) -> tuple[float, float]:
        """(part written, published) on this rank, as numbers the ranks sum; 0 for what failed."""
        written, done = self._written.is_set(), self._done.is_set()  # read first: the thread sets error before them
        ok = self.error is None
        return float(written and ok), float(done and ok and self._publish is not None)

    def wait_for_milestone(self) -> None:
        """Block until this rank has something new to report: its part written, then (rank 0) the publish done."""
        if not self.publishing:
            self._written.wait()
        elif self._publish is not None:
            self._done.wait()

    def start_publishing(self) -> None:
        self.publishing = True
        self._go.set()

    def abandon(self) -> None:
        """Stop after this rank's part (a rank failed): never publish; returns once the thread is done."""
        self._abandoned = True
        self._go.set()
        self._thread.join()
