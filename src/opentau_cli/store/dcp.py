"""FSDP2 checkpoints: the sharded model and optimizer state written and read with torch.distributed.checkpoint (DCP),
inside the ordinary atomic save (docs/ARCHITECTURE.md, "Checkpoint contract", "FSDP2").

Every rank writes its own shard file into `DCP_DIR` of the checkpoint's temporary directory (DCP's own layout:
`__<rank>_0.distcp` and one `.metadata`); Accelerate's save_state writes the scheduler and each rank's RNG state
beside it, and the manifest, publish, `last` and retention are the same as for every backend. Reading never runs
pickled code: DCP's metadata is unpickled against an allow-list of its own record types, and the optimizer's
non-tensor values (hyper-parameters, steps) with `weights_only` loads. The EMA (train/ema.py) is saved in the same DCP
state under `ema.`; LoRA checkpoints hold only what trains (policies/lora.py). An asynchronous save stages this
rank's state into host memory and writes it with DCP from the background (train/async_save.py).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from opentau_cli.store.layout import DCP_DIR, DCP_METADATA

# The record types DCP's metadata pickle holds (torch.distributed.checkpoint.metadata / filesystem), and torch's
# value types they name.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
    ("torch", "strided"), ("torch", "contiguous_format"), ("torch", "preserve_format"), ("torch", "channels_last"),
    ("builtins", "set"), ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # where it was saved (storage_meta.checkpoint_id)
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.metadata  # noqa: F401  (the record types' module)

        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in _DCP_MODULES or (module, name) in _ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata references {module}.{name}, which a checkpoint never holds")


def read_metadata(path: Path):
    """DCP's `.metadata` of `path`, unpickled against the allow-list (no other code runs)."""
    with open(Path(path) / DCP_METADATA, "rb") as f:
        return _MetadataUnpickler(f).load()


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element  # noqa: F401  (used by the default planner)

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, whose non-tensor values are read with `weights_only` loads."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._nested_dict import set_element

            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


def save_sharded(directory: Path, model, optimizer, extra: dict | None = None, keys: set | None = None) -> None:
    """Write the model's and optimizer's sharded state (and `extra`'s, e.g. {"ema": ...}) into `directory / DCP_DIR`
    (a collective: every rank). `keys`: the model's entries to write (LoRA: what trains and the buffers)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(model, optimizer, extra, keys), storage_writer=dcp.FileSystemWriter(str(Path(directory) / DCP_DIR)))


def sharded_state(model, optimizer, extra: dict | None = None, keys: set | None = None) -> dict:
    """What DCP_DIR holds: {"model": ..., "optimizer": ...} as `get_state_dict` gives them (DTensors: this rank's
    shards, no copies), the model's only `keys` when given, plus `extra`'s top-level entries."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    if keys is not None:
        model_state = {k: v for k, v in model_state.items() if k in keys}
    return {"model": model_state, "optimizer": optim_state, **(extra or {})}


def load_sharded(directory: Path, model, optimizer, keys: set | None = None) -> None:
    """Read `directory / DCP_DIR` into the model and optimizer (a collective: every rank), reshaped by DCP to this
    launch's shards; `keys`: the model's entries the checkpoint holds (LoRA: the rest is the base, built)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = sharded_state(model, optimizer, keys=keys)
    dcp.load(state, storage_reader=_reader(Path(directory) / DCP_DIR), planner=_planner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=keys is None))


EMA_KEY = "ema"  # the EMA's entry in DCP_DIR (train/ema.py): its shards, by parameter name, beside the model's


def load_into(directory: Path, key: str, tensors: dict) -> None:
    """Read `key`'s tensors of `directory / DCP_DIR` into `tensors` ({name: DTensor}, in place; a collective)."""
    import torch.distributed.checkpoint as dcp

    root = Path(directory) / DCP_DIR
    saved = {fqn for fqn in read_metadata(root).state_dict_metadata if fqn.startswith(key + ".")}
    missing = sorted(f"{key}.{name}" for name in tensors if f"{key}.{name}" not in saved)
    if missing or len(saved) != len(tensors):
        from opentau_cli.errors import RunError

        raise RunError(f"{root} does not hold this run's {key} (missing {missing[:3]}, {len(saved)} saved, "
                       f"{len(tensors)} expected).")
    dcp.load({key: tensors}, storage_reader=_reader(root), planner=_planner())


class ShardedState:
    """The save_state pre-hook of an FSDP2 launch: writes the sharded model, optimizer and, when the launch keeps
    one, EMA (`ema`: a callable giving {name: DTensor} or None) with DCP. `stage` / `write_staged` are the
    asynchronous save's two halves (train/async_save.py)."""

    def __init__(self, model, optimizer, keys: set | None = None):
        self.model, self.optimizer, self.keys = model, optimizer, keys
        self.ema = lambda: None
        self._group = None

    def state(self) -> dict:
        ema = self.ema()
        return sharded_state(self.model, self.optimizer, {EMA_KEY: ema} if ema else None, self.keys)

    def __call__(self, models, weights, output_dir) -> None:
        save_sharded(Path(output_dir), self.model, self.optimizer, {EMA_KEY: e} if (e := self.ema()) else None, self.keys)

    def stage(self) -> dict:
        """This rank's state copied into fresh host memory (DCP's own staging functions: DTensors stay DTensors over
        host copies of their shards), so training may change the live tensors while it is written."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        live = self.state()
        staged = _create_cpu_state_dict(live, pin_memory=torch.cuda.is_available())
        _copy_state_dict(live, staged)  # blocking copies: done when it returns
        return staged

    def group(self):
        """The gloo group the background writes coordinate over (DCP's plan and metadata gathers): never the
        training's own group, whose collectives the main thread runs meanwhile. Made on the main thread by the
        first asynchronous save, which every rank reaches at the same point."""
        import torch.distributed as dist

        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def write_staged(self, staged: dict, directory: Path, rank: int, group) -> tuple[Path, int, str]:
        """Write a staged state into `directory / DCP_DIR` (a collective over `group`: every rank's background
        thread), synced; returns this rank's shard file as the manifest records it (path, size, hash)."""
        import torch.distributed.checkpoint as dcp

        from opentau_cli.store.manifest import hash_file

        root = Path(directory) / DCP_DIR
        dcp.save(staged, storage_writer=dcp.FileSystemWriter(str(root), sync_files=True), process_group=group)
        mine = root / f"__{rank}_0.distcp"  # one file per rank (FileSystemWriter's single_file_per_rank)
        return mine, mine.stat().st_size, hash_file(mine, fsync=True)


def register_with(accelerator, model, optimizer, keys: set | None = None) -> ShardedState:
    """Accelerate's save_state / load_state (what CheckpointManager calls on every rank) also write / read the
    sharded model and optimizer: Accelerate itself writes the scheduler and each rank's RNG state. `keys`: the
    model's entries a checkpoint holds (None: all; LoRA: policies/lora.py checkpoint_keys)."""
    hook = ShardedState(model, optimizer, keys)

    def load_hook(models, input_dir):
        load_sharded(Path(input_dir), model, optimizer, keys)

    accelerator.register_save_state_pre_hook(hook)
    accelerator.register_load_state_pre_hook(load_hook)
    return hook


def registered(accelerator) -> ShardedState | None:
    """The FSDP2 launch's save hook on `accelerator` (None: not an FSDP2 launch)."""
    return next((h for h in accelerator._save_model_state_pre_hook.values() if isinstance(h, ShardedState)), None)


MODEL_PREFIX = "model."  # the model's entries in the saved state ({"model": ..., "optimizer": ...}, flattened)


def model_entries(ckpt_dir: Path, *, ema: bool = False) -> list:
    """The model's tensors of an FSDP2 checkpoint as `TensorEntry`s (store/safetensors_writer.py) named by the
    policy's parameter names, each assembled from its per-rank chunks when its turn to be written comes: one tensor
    in memory at a time, never the model twice. Chunks are read with `weights_only` loads. With `ema` the trained
    parameters are the EMA's (train/ema.py), by the same names; buffers and frozen parameters as saved."""
    entries = saved_entries(ckpt_dir, MODEL_PREFIX)
    if ema:
        averaged = saved_entries(ckpt_dir, EMA_KEY + ".")
        if not averaged or set(averaged) - set(entries):
            from opentau_cli.errors import UserError

            raise UserError(f"{ckpt_dir / DCP_DIR} holds no EMA of this model's parameters: pass --weights live.")
        entries.update(averaged)
    return list(entries.values())


def saved_entries(ckpt_dir: Path, prefix: str) -> dict:
    """{name after `prefix`: TensorEntry} of the saved tensors whose flattened name starts with `prefix`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from opentau_cli.store.safetensors_writer import TensorEntry

    root = Path(ckpt_dir) / DCP_DIR
    metadata = read_metadata(root)
    chunks: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        chunks.setdefault(index.fqn, []).append((index.offset, info))
    entries = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        name = fqn[len(prefix):]
        entries[name] = TensorEntry(name, tuple(meta.size), meta.properties.dtype,
                                    _assemble(root, tuple(meta.size), meta.properties.dtype, chunks.get(fqn, [])))
    return entries


def _assemble(root: Path, shape: tuple, dtype: torch.dtype, chunks: list):
    def produce() -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        for offset, info in chunks:
            if getattr(info, "transform_descriptors", None):
                raise ValueError(f"{root}: a chunk is stored transformed ({info.transform_descriptors}); opentau writes none")
            with open(root / info.relative_path, "rb") as f:
                f.seek(info.offset)
                part = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
            if offset is None or not shape:
                out.copy_(part.reshape(shape))
                continue
            out[tuple(slice(o, o + n) for o, n in zip(offset, part.shape))] = part
        return out

    return produce


def consolidate_model(ckpt_dir: Path, output: Path, *, dtype: torch.dtype | None = None) -> Path:
    """The model of an FSDP2 checkpoint as one `output` safetensors file (a library entry point; `opentau checkpoint
    consolidate` plans its outputs itself and streams `model_entries`)."""
    from opentau_cli.store.safetensors_writer import TensorEntry, write_safetensors

    entries = model_entries(ckpt_dir)
    if dtype is not None:
        entries = [TensorEntry(e.name, e.shape, dtype if e.dtype.is_floating_point else e.dtype,
                               (lambda p, d: (lambda: p().to(d)))(e.produce, dtype if e.dtype.is_floating_point else e.dtype))
                   for e in entries]
    return write_safetensors(Path(output), entries)


def summary(ckpt_dir: Path) -> tuple[int, dict[str, int]]:
    """(values, {dtype: values}) of the model's tensors (parameters and buffers) of an FSDP2 checkpoint, from its
    metadata alone (`checkpoint inspect`)."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dtypes: dict[str, int] = {}
    for fqn, meta in read_metadata(Path(ckpt_dir) / DCP_DIR).state_dict_metadata.items():
        if fqn.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata):
            name = str(meta.properties.dtype).removeprefix("torch.")
            dtypes[name] = dtypes.get(name, 0) + math.prod(meta.size)
    return sum(dtypes.values()), dtypes


# Elastic resume (train/reshard.py): an FSDP2 checkpoint read by name, and full tensors put into an FSDP2 launch.

OPTIMIZER_STATE_PREFIX = "optimizer.state."


def read_canonical(ckpt_dir: Path, moments: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """(weights, moments, steps) of an FSDP2 checkpoint by parameter name: {name: produce}, {moment: {name: produce}},
    {name: step}; each tensor read when asked."""
    weights = {name: e.produce for name, e in saved_entries(ckpt_dir, MODEL_PREFIX).items()}
    found: dict[str, dict] = {m: {} for m in moments}
    steps: dict[str, float] = {}
    for key, entry in saved_entries(ckpt_dir, OPTIMIZER_STATE_PREFIX).items():
        name, _, what = key.rpartition(".")
        if what in found:
            found[what][name] = entry.produce
        elif what == "step":
            steps[name] = float(entry.produce())
    return weights, found, steps


def shard_like(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's shard of `full` as the DTensor `like` lays it out (every rank holds `full`: no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def is_sharded(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def apply_full(module, optimizer, weight, moments: dict, steps: dict, stateless: set, keep_frozen) -> None:
    """Put full tensors into an FSDP2 launch: every parameter's shard (`weight(name, p)` gives its full tensor;
    `keep_frozen(name, p)`: leave a frozen parameter as built) and AdamW's state of each trainable one (none for
    `stateless`). Buffers are left to the caller (they are not sharded)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if keep_frozen(name, p):
                continue
            p.to_local().copy_(shard_like(weight(name, p), p).to_local())
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if name in stateless:
                optimizer.state.pop(p, None)
                continue
            optimizer.state[p] = {"step": torch.tensor(steps[name], dtype=torch.float32),
                                  **{m: shard_like(moments[m][name]().float(), p).clone() for m in moments}}


def live_full(module, optimizer, moments: tuple[str, ...]):
    """(name, {"weight", moment...: full fp32 tensor or None, "step": float or None}) of every trainable parameter of
    an FSDP2 launch (a collective: every rank iterates, gathering each tensor)."""
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        s = optimizer.state.get(p, {})
        values = {"weight": p.detach(), **{m: s.get(m) for m in moments}, "step": s.get("step")}
        yield name, {k: (None if v is None else float(v) if k == "step" else
                         (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu())
                     for k, v in values.items()}
