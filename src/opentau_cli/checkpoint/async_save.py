"""Asynchronous checkpoint saves (`checkpoint.async_save`): the step blocks only while the state is copied into host
memory; a background thread of every rank writes its copy, and rank 0 publishes once every rank's part is written.

docs/ARCHITECTURE.md, "Checkpoint contract". The files are the ones `accelerator.save_state` writes, with the same
names and contents: under DeepSpeed, DeepSpeed's own `save_checkpoint` runs with a checkpoint engine that copies each
state dict instead of writing it (DeepSpeed still decides every file); otherwise the models, optimizers, schedulers
and RNG states that Accelerate saves are copied. The writer bypasses the page cache and hashes each file as it
writes it, so the manifest need not read it back (UncachedFile). The background threads never run a collective: the
main thread learns their progress (CheckpointManager.poll), so the ranks agree on it.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import mmap
import os
import random
import threading
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import xxhash

from opentau_cli.checkpoint.layout import MODEL_WEIGHTS, OPTIMIZER, SCHEDULER, rank_state_file
from opentau_cli.checkpoint.manifest import HASH_NAME

Write = Callable[[], tuple[Path, int, str]]  # writes one file: (its path, size, hash as the manifest records it)
Job = Callable[[], None]


class HostStaging:
    """Host-memory copies of the tensors a save writes, and the writer's aligned buffer. The copies are made by the
    first save and reused by the next ones (a save waits for the previous one), so host memory stays at one snapshot,
    `nbytes`. On CUDA they are pinned and filled by device-to-host copies."""

    BOUNCE = 16 << 20  # the writer's aligned buffer (UncachedFile)

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()
        self._cuda = False
        self.bounce = mmap.mmap(-1, self.BOUNCE)  # page-aligned, as O_DIRECT needs

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values()) + len(self.bounce)

    def begin(self) -> None:
        self._used = set()

    def end(self) -> None:
        """Drop buffers this snapshot did not use; wait for the device-to-host copies."""
        self._buffers = {k: b for k, b in self._buffers.items() if k in self._used}
        if self._cuda:
            torch.cuda.synchronize()

    def copy(self, obj, key: tuple):
        """obj with every tensor replaced by its host copy (containers rebuilt, other values deep-copied). Tensors that
        are the same view of the same memory share one copy, as torch.save stores them once."""
        return self._copy(obj, key, {})

    def _copy(self, obj, key: tuple, seen: dict):
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key, seen)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the dict's type (OrderedDict, ...)
            for k, v in obj.items():
                out[k] = self._copy(v, key + (k,), seen)
            return out
        if isinstance(obj, list):
            return [self._copy(v, key + (i,), seen) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self._copy(v, key + (i,), seen) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, key: tuple, seen: dict) -> torch.Tensor:
        ident = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())
        if ident in seen:
            return seen[ident]
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[key] = buf
        self._used.add(key)
        with torch.no_grad():
            buf.copy_(t.detach(), non_blocking=t.is_cuda)
        self._cuda |= t.is_cuda
        # Saved as the original would be: a Parameter stays one, requires_grad is kept (the buffer itself stays a leaf).
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(buf, requires_grad=t.requires_grad)
        else:
            out = buf.detach().requires_grad_(t.requires_grad)
        seen[ident] = out
        return out


def snapshot(accelerator, save_dir: Path, staging: HostStaging, save_kwargs: dict, extra: dict | None = None) -> list[Write]:
    """Copy this rank's part of `accelerator.save_state(save_dir, **save_kwargs)` into host memory; returns the writes
    that put it in save_dir. Runs on the main thread (under DeepSpeed it runs save_checkpoint's collectives); only
    small files (DeepSpeed's RNG states, `latest` and scripts) are written right away. `extra`: safetensors files
    this rank adds ({name: tensors}, e.g. its EMA), copied with the rest."""
    Path(save_dir).mkdir(parents=True, exist_ok=True)  # as save_state does
    staging.begin()
    try:
        if accelerator.state.deepspeed_plugin is not None:
            writes = _deepspeed_snapshot(accelerator, Path(save_dir), staging, save_kwargs)
        else:
            writes = _accelerate_snapshot(accelerator, Path(save_dir), staging)
        for name, tensors in (extra or {}).items():
            writes.append(partial(_save_safetensors, staging.copy(tensors, (name,)), Path(save_dir) / name, staging.bounce))
        return writes
    finally:
        staging.end()


def _accelerate_snapshot(acc, save_dir: Path, staging: HostStaging) -> list[Write]:
    """What save_state saves without DeepSpeed (accelerate.checkpointing.save_accelerator_state), copied now."""
    from accelerate.utils.constants import SCALER_NAME

    if acc._custom_objects or acc._dataloaders:
        raise RuntimeError("async_save copies models, optimizers, schedulers and RNG states; this Accelerator also "
                           "checkpoints registered objects or prepared DataLoaders")
    writes: list[Write] = []
    rng = _rng_states(acc.step)
    writes.append(partial(_torch_save, rng, save_dir / rank_state_file(acc.process_index), staging.bounce))
    if not acc.is_main_process:  # Accelerate's `save` writes the rest on the main process only
        return writes
    weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
    for hook in acc._save_model_state_pre_hook.values():
        hook(acc._models, weights, str(save_dir))
    for i, state in enumerate(weights):
        name = _indexed(MODEL_WEIGHTS, i)
        writes.append(partial(_save_safetensors, staging.copy(state, (name,)), save_dir / name, staging.bounce))
    for base, objects in ((OPTIMIZER, acc._optimizers), (SCHEDULER, acc._schedulers)):
        for i, obj in enumerate(objects):
            name = _indexed(base, i)
            writes.append(partial(_torch_save, staging.copy(obj.state_dict(), (name,)), save_dir / name, staging.bounce))
    if acc.scaler is not None:
        state = staging.copy(acc.scaler.state_dict(), (SCALER_NAME,))
        writes.append(partial(_torch_save, state, save_dir / SCALER_NAME, staging.bounce))
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

    def __init__(self, engine, save_dir: Path, staging: HostStaging):
        self._engine, self._save_dir, self._staging = engine, save_dir, staging
        self.deferred: list[tuple[dict, str]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def save(self, state_dict, path: str) -> None:
        key = (Path(path).relative_to(self._save_dir).as_posix(),)
        self.deferred.append((self._staging.copy(state_dict, key), path))

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed then skips its own clone: the staged copies are already compact


def _deepspeed_snapshot(acc, save_dir: Path, staging: HostStaging, save_kwargs: dict) -> list[Write]:
    engines = [m for m in acc._models if hasattr(m, "checkpoint_engine")]
    capture = {id(e): _DeferredWrites(e.checkpoint_engine, save_dir, staging) for e in engines}
    originals = {id(e): e.checkpoint_engine for e in engines}
    for e in engines:
        e.checkpoint_engine = capture[id(e)]
    try:
        acc.save_state(str(save_dir), safe_serialization=True, **save_kwargs)
    finally:
        for e in engines:
            e.checkpoint_engine = originals[id(e)]
    return [partial(_torch_save, state, Path(path), staging.bounce, getattr(originals[i], "zipfile_serialization", True))
            for i, c in capture.items() for state, path in c.deferred]


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

    from opentau_cli.checkpoint.safetensors_writer import TensorEntry, header_bytes

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
    release the GIL. Where the filesystem refuses O_DIRECT it writes the ordinary way."""

    BLOCK = 4096  # O_DIRECT's alignment of offsets and lengths

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
        self._hash.update(src)
        done = 0
        while done < src.size:
            n = min(src.size - done, len(self._buf) - self._fill)
            ctypes.memmove(self._addr + self._fill, src.ctypes.data + done, n)
            self._fill += n
            done += n
            if self._fill == len(self._buf):
                self._drain(self._fill)
        self._size += src.size
        return src.size

    def flush(self) -> None:
        pass  # whole blocks go out as the buffer fills; the rest when the file is finished

    def _drain(self, length: int) -> None:
        with memoryview(self._buf)[:length] as view:
            written = 0
            while written < length:
                written += os.write(self._fd, view[written:])
        self._fill = 0

    def _finish(self) -> None:
        if self._fill:
            tail = self._fill
            if self._direct:  # a last whole block, cut back to the file's size below
                pad = -tail % self.BLOCK
                self._buf[tail:tail + pad] = bytes(pad)
                tail += pad
            self._drain(tail)
        if self._direct:
            os.ftruncate(self._fd, self._size)
        os.fsync(self._fd)

    def result(self) -> tuple[Path, int, str]:
        """(path, size, hash) of the finished file."""
        return self._path, self._size, self._hash.hexdigest()


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
