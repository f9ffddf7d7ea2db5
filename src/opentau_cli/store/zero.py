"""Read a DeepSpeed ZeRO-1/2/3 checkpoint (any number of ranks) without unpickling it: check that its shards belong
together and plan every full tensor as zero_to_fp32.py builds it (same names, shapes, dtypes and values), each read
lazily from its ranks' slices only when asked (docs/ARCHITECTURE.md, "Checkpoint contract").

Order of the plan (as zero_to_fp32 builds it): buffers (floats as fp32), frozen parameters (kept in the model-states
files), trainable parameters (from the fp32 master partitions in the optimizer files), then tied / shared parameters
under each name. Consolidation (tools/consolidate.py) writes the plan out; the elastic resume (train/reshard.py) and
the EMA (train/ema.py) read from it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opentau_cli.errors import UserError
from opentau_cli.store.layout import DS_MODEL_STATES, ds_shard_glob, ema_group_name, ema_rank_file, find_tag_dir, rank_shard_files
from opentau_cli.store.safetensors_writer import FileSpan, TensorEntry
from opentau_cli.store.shard_reader import LazyTensor, Opaque, ShardFormatError, load_shard


@dataclass
class ZeroCheckpoint:
    """What consolidation learned from a DeepSpeed tag directory (the one holding the *_states.pt files)."""

    tag_dir: Path
    zero_stage: int
    world_size: int
    step: int | None
    entries: list[TensorEntry] = field(default_factory=list)  # source dtype (before output casting)
    # AdamW's moments of every trainable parameter, by name ("exp_avg" / "exp_avg_sq" -> name -> entry), and the
    # optimizer's step count: what an elastic resume carries into another topology (train/reshard.py).
    moments: dict[str, dict[str, TensorEntry]] = field(default_factory=dict)
    optimizer_step: float | None = None


def _zero_stage(value) -> int:
    if isinstance(value, Opaque):  # ZeroStageEnum(n), never constructed: its argument is the stage
        value = value.args[0] if value.args else None
    if not isinstance(value, int):
        raise ShardFormatError(f"unreadable zero_stage {value!r}")
    return int(value)


def _scalar(t) -> float | None:
    return float(t.read().reshape(-1)[0]) if isinstance(t, LazyTensor) and t.numel() == 1 else None


MOMENTS = ("exp_avg", "exp_avg_sq")


def _base_optimizer_states(optim_sd: dict) -> list[dict]:
    """The wrapped (torch) optimizer's state of each flat fp32 group in an optim-states file, in group order: ZeRO-3
    keeps its state_dict under optimizer_state_dict, ZeRO-1/2 under base_optimizer_state (a state_dict, or with
    elastic checkpoints a list of per-group states); empty before the first optimizer step."""
    base = optim_sd.get("optimizer_state_dict") if "fp32_flat_groups" in optim_sd else optim_sd.get("base_optimizer_state")
    if isinstance(base, list):
        return [s for s in base if isinstance(s, dict)]
    state = base.get("state") if isinstance(base, dict) else None
    if not isinstance(state, dict):
        return []
    return [state[k] for k in sorted(state) if isinstance(state[k], dict)]


def _optimizer_step(optim_sd: dict) -> float | None:
    """The optimizer's step count in an optim-states file (same on every rank of one save)."""
    for s in _base_optimizer_states(optim_sd):
        if "step" in s:
            return _scalar(s["step"]) if isinstance(s["step"], LazyTensor) else float(s["step"])
    return None


def read_zero_checkpoint(ckpt_dir: Path, *, moments: bool = False, ema: bool = False) -> ZeroCheckpoint:
    """Open a DeepSpeed ZeRO checkpoint, check that its shards belong together, and plan every output tensor (with
    `moments`, AdamW's moments too). With `ema` the trainable parameters are the EMA's (ema_rank<r>.safetensors, the
    ranks' EMAs of their fp32 master partitions, cut by the same plan); buffers and frozen parameters as saved."""
    tag_dir = find_tag_dir(ckpt_dir)
    try:
        return _read_zero_checkpoint(tag_dir, moments, Path(ckpt_dir) if ema else None)
    except ShardFormatError as e:  # a malformed value inside a readable shard (an unreadable zero_stage, a tensor past its record)
        raise UserError(f"{tag_dir}: {e}") from None


def _read_zero_checkpoint(tag_dir: Path, moments: bool, ema_dir: Path | None = None) -> ZeroCheckpoint:
    model_files = rank_shard_files(tag_dir, "model")
    optim_files = rank_shard_files(tag_dir, "optim")
    if not optim_files:
        raise UserError(f"{tag_dir} holds no {ds_shard_glob('optim')} files: not a ZeRO checkpoint (or the save did not finish).")
    optim = {r: load_shard(p) for r, p in sorted(optim_files.items())}
    first = optim[min(optim)]["optimizer_state_dict"]
    if "zero_stage" not in first:
        raise UserError(f"{optim_files[min(optim)]} is not a ZeRO optimizer-states file.")
    stage = _zero_stage(first["zero_stage"])
    world = first["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)

    missing = sorted(set(range(world)) - set(optim_files))
    if missing:
        raise UserError(f"{tag_dir}: the optimizer shard of rank(s) {', '.join(map(str, missing))} is missing "
                        f"(the checkpoint was written by {world} ranks).")
    extra = sorted(set(optim_files) - set(range(world)))
    if extra:
        raise UserError(f"{optim_files[extra[0]]} is from another run: this checkpoint was written by {world} ranks.")
    steps = {}
    for r, sd in optim.items():
        osd = sd["optimizer_state_dict"]
        pc = osd.get("partition_count")
        pc = max(pc) if isinstance(pc, list) else pc
        if pc != world or _zero_stage(osd.get("zero_stage")) != stage:
            raise UserError(f"{optim_files[r]} is from another run (ZeRO-{_zero_stage(osd.get('zero_stage'))}, "
                            f"{pc} ranks; the others: ZeRO-{stage}, {world} ranks).")
        steps[r] = _optimizer_step(osd)

    if stage <= 2:
        if 0 not in model_files:
            raise UserError(f"{tag_dir}: the model-states file ({DS_MODEL_STATES}) is missing.")
        models = {0: load_shard(model_files[0])}
    else:
        missing = sorted(set(range(world)) - set(model_files))
        if missing:
            raise UserError(f"{tag_dir}: the model-states shard of rank(s) {', '.join(map(str, missing))} is missing "
                            f"(the checkpoint was written by {world} ranks).")
        models = {r: load_shard(model_files[r]) for r in range(world)}
    for r, sd in models.items():
        if not isinstance(sd, dict) or "buffer_names" not in sd or "module" not in sd:
            raise UserError(f"{model_files[r]} is not a DeepSpeed model-states file.")
        dp = sd.get("dp_world_size")
        if dp is not None and int(dp) != world:
            raise UserError(f"{model_files[r]} is from another run: written by {dp} ranks, the optimizer shards by {world}.")
    global_steps = {r: sd.get("global_steps") for r, sd in models.items()}
    if len(set(global_steps.values())) > 1:
        r = next(r for r, s in global_steps.items() if s != global_steps[0])
        raise UserError(f"{model_files[r]} is from another save: step {global_steps[r]}, rank 0 has step {global_steps[0]}.")
    if len({s for s in steps.values()}) > 1:
        r = next(r for r, s in steps.items() if s != steps[0])
        raise UserError(f"{optim_files[r]} is from another save: its optimizer is at step {steps[r]:g}, "
                        f"rank 0's at {steps[0]:g}.")

    ckpt = ZeroCheckpoint(tag_dir, stage, world, global_steps.get(0), optimizer_step=steps[0])
    ema = _ema_partitions(ema_dir, world) if ema_dir is not None else None
    ckpt.entries = _plan(stage, world, models, optim, optim_files, ema)
    if moments:
        ckpt.moments = _plan_moments(stage, world, models, optim, optim_files)
    return ckpt


def _plan(stage, world, models, optim, optim_files, ema=None) -> list[TensorEntry]:
    m0 = models[0]
    entries: dict[str, TensorEntry] = {}

    # Buffers: full copies in rank 0's module state; floats promoted to fp32 like zero_to_fp32.
    for name in m0["buffer_names"]:
        t = m0["module"].get(name)
        if isinstance(t, LazyTensor):
            entries[name] = TensorEntry(name, tuple(t.shape), t.dtype, _reader_whole(t),
                                        _file_spans([(t, 0, t.numel())], t.numel()))

    # Frozen parameters live in the model-states files: whole tensors (ZeRO-1/2) or per-rank fragments (ZeRO-3).
    frozen_shapes = m0.get("frozen_param_shapes") or {}
    for name, shape in frozen_shapes.items():
        shape = tuple(shape)
        if stage <= 2:
            frag = m0["frozen_param_fragments"][name]
            entries[name] = TensorEntry(name, tuple(frag.shape), frag.dtype, _reader_whole(frag),
                                        _file_spans([(frag, 0, frag.numel())], frag.numel()))
        else:
            frags = [models[r]["frozen_param_fragments"][name] for r in range(world)]
            entries[name] = _zero3_entry(name, shape, frags, frags[0].numel())

    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    groups = [optim[r]["optimizer_state_dict"][key] for r in range(world)]
    if ema is not None:  # the EMA's partitions have the master partitions' layout, value for value
        for r in range(world):
            if [t.numel() for t in ema[r]] != [t.numel() for t in groups[r]]:
                raise UserError(f"{ema[r][0].path} does not fit the optimizer shard of rank {r}: another run's EMA.")
        groups = ema
    if any(len(g) != len(groups[0]) for g in groups):
        raise UserError(f"{optim_files[world - 1]} is from another run: its number of parameter groups differs from rank 0's.")
    param_shapes = m0["param_shapes"]
    if stage <= 2:
        paddings = optim[0]["optimizer_state_dict"].get("param_alignment_paddings")
        for g, shapes in enumerate(param_shapes):
            parts = [groups[r][g] for r in range(world)]
            _plan_zero2_group(entries, shapes, parts, paddings[g] if paddings is not None else None, world, optim_files)
    else:
        _plan_zero3(entries, param_shapes, groups, world, optim_files)

    # Tied / shared parameters: DeepSpeed stores one copy; the state dict names both (zero_to_fp32 does the same).
    for alias, source in (m0.get("shared_params") or {}).items():
        if source in entries:
            src = entries[source]
            entries[alias] = TensorEntry(alias, src.shape, src.dtype, src.produce, src.spans)
    return list(entries.values())


def _plan_moments(stage, world, models, optim, optim_files) -> dict[str, dict[str, TensorEntry]]:
    """AdamW's moments by parameter name: their flat per-group partitions have the layout of the fp32 master
    partitions, so they are cut exactly like them (ZeRO-1/2's padding lies past the last parameter)."""
    states = [_base_optimizer_states(optim[r]["optimizer_state_dict"]) for r in range(world)]
    if not all(states) or any(m not in s for rank in states for s in rank for m in MOMENTS):
        return {}  # saved before the first optimizer step, or another optimizer
    param_shapes = models[0]["param_shapes"]
    out = {}
    for moment in MOMENTS:
        groups = [[s[moment] for s in states[r]] for r in range(world)]
        entries: dict[str, TensorEntry] = {}
        if stage <= 2:
            paddings = optim[0]["optimizer_state_dict"].get("param_alignment_paddings")
            for g, shapes in enumerate(param_shapes):
                _plan_zero2_group(entries, shapes, [groups[r][g] for r in range(world)],
                                  paddings[g] if paddings is not None else None, world, optim_files)
        else:
            _plan_zero3(entries, param_shapes, groups, world, optim_files)
        out[moment] = entries
    return out


class _SafetensorsFlat:
    """A 1-D tensor in a safetensors file, read only when (and as far as) asked: the slice of a LazyTensor the plan
    uses."""

    def __init__(self, path: Path, name: str, numel: int, dtype: torch.dtype, data_start: int):
        self.path, self.name, self._numel, self.dtype = path, name, numel, dtype
        self.data_start = data_start  # byte offset of its first value in the file

    def numel(self) -> int:
        return self._numel

    def read_flat(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        from safetensors import safe_open

        count = self._numel - start if count is None else count
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_slice(self.name)[start:start + count]

    def read(self) -> torch.Tensor:
        return self.read_flat()

    def file_spans(self, start: int, count: int) -> list[FileSpan]:
        if start < 0 or count < 0 or start + count > self._numel:
            raise ShardFormatError(f"{self.path}: read past the end of {self.name}")
        item = self.dtype.itemsize
        return [FileSpan(self.path, self.data_start + start * item, count * item)]


def _ema_partitions(ckpt_dir: Path, world: int) -> list[list[_SafetensorsFlat]]:
    """Each rank's EMA partitions (group_0, group_1, ...) from its ema_rank<r>.safetensors, unread."""
    from safetensors import SafetensorError, safe_open

    out = []
    for r in range(world):
        path = ckpt_dir / ema_rank_file(r)
        if not path.is_file():
            raise UserError(f"{ckpt_dir} holds no EMA of rank {r} ({path.name}): it was saved without ema.decay; "
                            "pass --weights live.")
        try:
            with safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                parts = []
                for g in range(len(names)):
                    piece = f.get_slice(ema_group_name(g)) if ema_group_name(g) in names else None
                    if piece is None or piece.get_dtype() != "F32" or len(piece.get_shape()) != 1:
                        raise UserError(f"{path} is not an opentau EMA file (no 1-D fp32 {ema_group_name(g)}).")
                    parts.append(_SafetensorsFlat(path, ema_group_name(g), piece.get_shape()[0], torch.float32,
                                                  _safetensors_data_start(path, ema_group_name(g))))
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path}: not a readable safetensors file ({e}).") from None
        out.append(parts)
    return out


def _safetensors_data_start(path: Path, name: str) -> int:
    """Byte offset of tensor `name`'s data in a safetensors file (an 8-byte header length, the JSON header, the data;
    safe_open has checked the layout already)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + int(header[name]["data_offsets"][0])


def _reader_whole(t: LazyTensor):
    return lambda: t.read()


def _plan_zero2_group(entries, shapes, parts, paddings, world, optim_files):
    """ZeRO-1/2: the group's full fp32 vector is the ranks' partitions concatenated; params lie in it in order."""
    avail = sum(p.numel() for p in parts)
    offset = 0
    if paddings is not None and len(paddings) != len(shapes):
        raise UserError("the optimizer shards' alignment paddings do not match the model's parameters.")
    for i, (name, shape) in enumerate(shapes.items()):
        shape = tuple(shape)
        n = math.prod(shape)
        entries[name] = TensorEntry(name, shape, parts[0].dtype, _reader_concat(parts, offset, n, shape),
                                    _file_spans(_pieces(parts, offset, n), n))
        offset += n + (paddings[i] if paddings is not None else 0)
    align = 2 * world  # ZeRO-2 pads groups to a multiple of 2 * world size (as zero_to_fp32 checks)
    if align * math.ceil(offset / align) != align * math.ceil(avail / align):
        raise UserError(f"{optim_files[world - 1]} does not fit this checkpoint's parameters "
                        f"({avail} values for {offset}): a shard from another run or model.")


def _pieces(parts, pos: int, count: int) -> list[tuple]:
    """(part, start, count) of `count` values from position `pos` of `parts` taken end to end (they may cross parts)."""
    out, start = [], 0
    for part in parts:
        end = start + part.numel()
        if count and start <= pos < end:
            take = min(count, end - pos)
            out.append((part, pos - start, take))
            pos += take
            count -= take
        start = end
    if count:
        raise UserError("the optimizer shards are shorter than the parameters they should hold.")
    return out


def _read_span(parts, pos: int, count: int) -> list[torch.Tensor]:
    """`count` values from position `pos` of `parts` taken end to end (a span may cross parts)."""
    return [part.read_flat(start, take) for part, start, take in _pieces(parts, pos, count)]


def _file_spans(pieces, n: int) -> list[FileSpan] | None:
    """Where the bytes of (part, start, count) pieces, n values of one dtype, lie in the shard files, end to end: what
    the writer copies file to file when the output keeps the source dtype (docs/ARCHITECTURE.md "Checkpoint contract").
    None when a piece has no such place (a tensor stored strided) or the pieces do not make the tensor: then
    it is produced, and what is wrong is reported when its turn to be written comes, as ever."""
    if sum(count for _, _, count in pieces) != n or len({part.dtype for part, _, _ in pieces}) > 1:
        return None
    out = []
    try:
        for part, start, count in pieces:
            spans = part.file_spans(start, count)
            if spans is None:
                return None
            out += spans
    except (ShardFormatError, UserError):
        return None
    return out


def _reader_concat(parts: list[LazyTensor], offset: int, n: int, shape):
    def read():
        out = _read_span(parts, offset, n)
        if not out:  # a zero-element parameter
            return torch.empty(shape, dtype=parts[0].dtype)
        return (out[0] if len(out) == 1 else torch.cat(out)).view(shape)

    return read


def _plan_zero3(entries, param_shapes, groups, world, optim_files):
    """ZeRO-3: each parameter is split into `world` slices of ceil(n / world) values, slice r at the same offset of
    rank r's (concatenated) flat groups; the last slice is zero-padded."""
    per_rank_total = [sum(g.numel() for g in groups[r]) for r in range(world)]
    if len(set(per_rank_total)) != 1:
        r = next(r for r in range(world) if per_rank_total[r] != per_rank_total[0])
        raise UserError(f"{optim_files[r]} is from another run: its partition holds {per_rank_total[r]} values, rank 0's {per_rank_total[0]}.")
    offset = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            shape = tuple(shape)
            n = math.prod(shape)
            part = math.ceil(n / world)
            entries[name] = _zero3_entry(name, shape, [_GroupSlice(groups[r], offset, part) for r in range(world)], part)
            offset += part
    if offset != per_rank_total[0]:
        raise UserError(f"{optim_files[0]} does not fit this checkpoint's parameters ({per_rank_total[0]} values per "
                        f"rank for {offset}): a shard from another run or model.")


class _GroupSlice:
    """`count` values at `offset` of one rank's flat groups taken end to end (a slice may span two groups)."""

    def __init__(self, groups: list[LazyTensor], offset: int, count: int):
        self.groups, self.offset, self.count = groups, offset, count
        self.dtype = groups[0].dtype

    def numel(self) -> int:
        return self.count

    def read_flat(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        count = self.count - start if count is None else count
        out = _read_span(self.groups, self.offset + start, count)
        return out[0] if len(out) == 1 else torch.cat(out)

    def file_spans(self, start: int, count: int) -> list[FileSpan] | None:
        return _file_spans(_pieces(self.groups, self.offset + start, count), count)


def _zero3_entry(name: str, shape: tuple, frags, part: int) -> TensorEntry:
    """A parameter split over ranks: `part` values from each rank's fragment, in rank order, cut to its size."""
    n = math.prod(shape)
    return TensorEntry(name, shape, frags[0].dtype, _reader_zero3(frags, part, shape),
                       _file_spans(_zero3_takes(frags, part, n), n))


def _zero3_takes(frags, part: int, n: int) -> list[tuple]:
    """(fragment, 0, count) for each rank's share of a ZeRO-3 parameter of n values (the last share unpadded)."""
    out, have = [], 0
    for f in frags:
        if have >= n:
            break
        out.append((f, 0, min(part, n - have)))
        have += out[-1][2]
    return out


def _reader_zero3(frags, part: int, shape):
    n = math.prod(shape)

    def read():
        pieces = [f.read_flat(start, take) for f, start, take in _zero3_takes(frags, part, n)]
        if not pieces:  # a zero-element parameter
            return torch.empty(shape, dtype=frags[0].dtype)
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if flat.numel() != n:
            raise UserError("the ZeRO-3 fragments are shorter than the parameters they should hold.")
        return flat.view(shape)

    return read
