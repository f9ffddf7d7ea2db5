"""FSDP2 checkpoints: the sharded model and optimizer state written and read with torch.distributed.checkpoint (DCP),
inside the ordinary atomic save (docs/ARCHITECTURE.md, "Checkpoint contract", "FSDP2").

Every rank writes its own shard file into `DCP_DIR` of the checkpoint's temporary directory (DCP's own layout:
`__<rank>_0.distcp` and one `.metadata`); Accelerate's save_state writes the scheduler and each rank's RNG state
beside it, and the manifest, publish, `last` and retention are the same as for every backend. Reading never runs
pickled code: DCP's metadata is unpickled against an allow-list of its own record types, and the optimizer's
non-tensor values (hyper-parameters, steps) with `weights_only` loads.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

DCP_DIR = "fsdp_state"  # the checkpoint's DCP directory (model + optimizer, sharded per rank)
DCP_METADATA = ".metadata"

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


def save_sharded(directory: Path, model, optimizer) -> None:
    """Write the model's and optimizer's sharded state into `directory / DCP_DIR` (a collective: every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=dcp.FileSystemWriter(str(Path(directory) / DCP_DIR)))


def load_sharded(directory: Path, model, optimizer) -> None:
    """Read `directory / DCP_DIR` into the model and optimizer (a collective: every rank), reshaped by DCP to this
    launch's shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, storage_reader=_reader(Path(directory) / DCP_DIR), planner=_planner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def register_with(accelerator, model, optimizer) -> None:
    """Accelerate's save_state / load_state (what CheckpointManager calls on every rank) also write / read the
    sharded model and optimizer: Accelerate itself writes the scheduler and each rank's RNG state."""

    def save_hook(models, weights, output_dir):
        save_sharded(Path(output_dir), model, optimizer)

    def load_hook(models, input_dir):
        load_sharded(Path(input_dir), model, optimizer)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def is_dcp_checkpoint(ckpt_dir: Path) -> bool:
    """Whether `ckpt_dir` holds an FSDP2 checkpoint's sharded state (DCP_DIR with its metadata)."""
    return (Path(ckpt_dir) / DCP_DIR / DCP_METADATA).is_file()


MODEL_PREFIX = "model."  # the model's entries in the saved state ({"model": ..., "optimizer": ...}, flattened)


def model_entries(ckpt_dir: Path) -> list:
    """The model's tensors of an FSDP2 checkpoint as `TensorEntry`s (checkpoint/safetensors_writer.py) named by the
    policy's parameter names, each assembled from its per-rank chunks when its turn to be written comes: one tensor
    in memory at a time, never the model twice. Chunks are read with `weights_only` loads."""
    return list(saved_entries(ckpt_dir, MODEL_PREFIX).values())


def saved_entries(ckpt_dir: Path, prefix: str) -> dict:
    """{name after `prefix`: TensorEntry} of the saved tensors whose flattened name starts with `prefix`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from opentau_cli.checkpoint.safetensors_writer import TensorEntry

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
    from opentau_cli.checkpoint.safetensors_writer import TensorEntry, write_safetensors

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


# Elastic resume (checkpoint/reshard.py): an FSDP2 checkpoint read by name, and full tensors put into an FSDP2 launch.

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


def _shard_like(full: torch.Tensor, like) -> torch.Tensor:
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
            p.to_local().copy_(_shard_like(weight(name, p), p).to_local())
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if name in stateless:
                optimizer.state.pop(p, None)
                continue
            optimizer.state[p] = {"step": torch.tensor(steps[name], dtype=torch.float32),
                                  **{m: _shard_like(moments[m][name]().float(), p).clone() for m in moments}}


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
