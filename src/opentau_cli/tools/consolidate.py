"""Streaming consolidation of DeepSpeed ZeRO-1/2/3 checkpoints (any number of ranks) and FSDP2 DCP shards into
safetensors.

Reproduces DeepSpeed's `zero_to_fp32.py` tensor for tensor (same names, shapes, dtypes and values) without its
memory cost: the shards are planned by store/zero.py (read lazily and safely, nothing unpickled beyond an
allow-list), each output tensor is assembled from its ranks' slices only when it is written, floating tensors are
cast to the requested dtype, and the output is written atomically.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opentau_cli.errors import RunError, UserError
from opentau_cli.store import manifest as mf
from opentau_cli.store.dcp import model_entries
from opentau_cli.store.format import check_readable, migrate_training_state
from opentau_cli.store.layout import (
    EMA_STATE, TRAINING_STATE, MANIFEST, MODEL_WEIGHTS, find_tag_dir, is_dcp_checkpoint, weights_index_path,
    weights_shard_path,
)
from opentau_cli.store.lineage import archive_of
from opentau_cli.store.faults import fault_point
from opentau_cli.store.outputs import check_target, make_parents, publishing, remove_made, writable_parent, written_by
from opentau_cli.store.safetensors_writer import TensorEntry, write_safetensors
from opentau_cli.store.shard_reader import ShardFormatError
from opentau_cli.store.storage import fsync_dir
from opentau_cli.store.zero import read_zero_checkpoint
from opentau_cli.units import parse_size

CONSOLIDATE_COMMAND = "checkpoint consolidate"  # names its outputs (opentau_cli/store/outputs.py): --force replaces only those
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ConsolidateResult:
    files: list[Path]
    num_tensors: int
    total_bytes: int
    already: bool = False
    notes: list[str] = field(default_factory=list)  # what this run repaired or removed of an interrupted one


def _cast(entry: TensorEntry, dtype: torch.dtype) -> TensorEntry:
    if not entry.dtype.is_floating_point or entry.dtype == dtype:
        return entry
    produce = entry.produce
    # Floats go through fp32 first, as zero_to_fp32 promotes buffers before casting: identical bits either way. The
    # bytes change, so they are produced, never copied.
    return TensorEntry(entry.name, entry.shape, dtype, lambda: produce().float().to(dtype))


def _split_shards(entries: list[TensorEntry], max_bytes: int) -> list[list[TensorEntry]]:
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        shards.append(cur)
    return shards


WEIGHTS = ("ema", "live")


def wants_ema(ckpt_dir: Path, weights: str | None) -> bool:
    """Whether `--weights` (ema | live; None: the EMA when the checkpoint holds one) asks for the EMA weights."""
    if weights is not None and weights not in WEIGHTS:
        raise UserError(f"--weights must be ema or live, not '{weights}'.")
    try:
        has_ema = bool(json.loads((Path(ckpt_dir) / TRAINING_STATE).read_text()).get(EMA_STATE))
    except (OSError, ValueError, AttributeError):
        has_ema = False
    if weights == "ema" and not has_ema:
        raise UserError(f"{ckpt_dir} holds no EMA weights (it was trained without ema.decay): pass --weights live.")
    return has_ema if weights is None else weights == "ema"


def weights_kind(single: Path) -> str:
    """Which weights (ema | live) an existing consolidated output holds; one written before the EMA: live."""
    from safetensors import SafetensorError, safe_open

    try:
        first = single
        if not single.is_file():
            weight_map = json.loads(weights_index_path(single).read_text()).get("weight_map", {})
            first = single.with_name(sorted(weight_map.values())[0]) if weight_map else single
        with safe_open(str(first), framework="pt") as f:
            return (f.metadata() or {}).get("weights", "live")
    except (OSError, ValueError, AttributeError, SafetensorError):  # unreadable: its reader will say what is wrong
        return "live"


def output_paths(ckpt_dir: Path, output: Path | None) -> Path:
    """The single-file output path: CKPT_DIR/model.safetensors, --output FILE.safetensors, or --output DIR/model.safetensors."""
    if output is None:
        return Path(ckpt_dir) / MODEL_WEIGHTS
    output = Path(output)
    return output if output.suffix == ".safetensors" else output / MODEL_WEIGHTS


def is_consolidated(single: Path) -> bool:
    return single.is_file() or weights_index_path(single).is_file()


def consolidate(ckpt_dir: Path, *, dtype: str = "fp32", max_shard_size: str = "5GB", output: Path | None = None,
                force: bool = False, progress=None, weights: str | None = None) -> ConsolidateResult:
    """Write the consolidated weights of a DeepSpeed checkpoint as safetensors: its EMA weights when it holds them
    (`weights` None or "ema"), else (or with "live") the live fp32 master weights. Raises UserError / RunError."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, not '{dtype}'.")
    max_bytes = parse_size(max_shard_size, "--max-shard-size")
    ckpt_dir = Path(ckpt_dir)
    single = output_paths(ckpt_dir, output)
    fsdp = is_dcp_checkpoint(ckpt_dir)  # FSDP2: its DCP shards (store/dcp.py)
    if not fsdp:
        find_tag_dir(ckpt_dir)  # not a DeepSpeed checkpoint: one clear error before anything else is looked at
    check_readable(ckpt_dir)
    kind = "ema" if wants_ema(ckpt_dir, weights) else "live"
    if output is None and archive_of(ckpt_dir) is not None:  # nothing under rolled_back/ is written (lineage.py)
        raise UserError(f"{ckpt_dir} was moved aside by a rollback, and nothing in an archive is written: pass "
                        f"--output DIR (outside any run) to write its consolidated weights there.")
    notes = []
    if output is not None:  # the output convention (opentau_cli/store/outputs.py): never into a run, --force only over ours
        check_target(Path(output), force=force, source=ckpt_dir, command=CONSOLIDATE_COMMAND)
        check_target(weights_index_path(single), force=force, source=ckpt_dir, command=CONSOLIDATE_COMMAND)
    else:  # its own place in the checkpoint
        left = mf.clean_siblings(ckpt_dir)  # what a killed run of this command left (put back first where vouched for)
        if left:
            notes.append(f"Removed {', '.join(p.name for p in left)}, left by an interrupted consolidation.")
        existing = single if single.is_file() else weights_index_path(single)
        if is_consolidated(single) and not _vouched(ckpt_dir, single):
            if not written_by(existing, CONSOLIDATE_COMMAND):
                raise UserError(f"{existing} is not listed in {ckpt_dir / MANIFEST} and was not written by `opentau "
                                f"{CONSOLIDATE_COMMAND}`: move it out of the checkpoint, then run the same command again.")
            notes.append(f"{existing.name} was left unlisted in the manifest by an interrupted consolidation: writing it again.")
        elif is_consolidated(single) and not force:  # done already, nothing to refuse
            if weights_kind(single) != kind:
                raise UserError(f"{existing} holds the {weights_kind(single)} weights, not the {kind} ones: pass --force to "
                                f"replace it, or --output to write the {kind} weights elsewhere.")
            return ConsolidateResult([existing], 0, existing.stat().st_size, already=True, notes=notes)

    # A checkpoint with a manifest must still match it (cheap size check: catches truncated or missing shards).
    if (ckpt_dir / MANIFEST).exists():
        problems = [p for p in mf.verify_manifest(ckpt_dir, rehash=False) if p.kind != "extra"]
        if problems:
            raise UserError(f"{ckpt_dir} does not match its manifest: " + "; ".join(map(str, problems[:5])))

    if fsdp:
        state = migrate_training_state(json.loads((ckpt_dir / TRAINING_STATE).read_text()))
        source, world, step, raw = "fsdp", state["world_size"], state["step"], model_entries(ckpt_dir, ema=kind == "ema")
    else:
        ckpt = read_zero_checkpoint(ckpt_dir, ema=kind == "ema")
        source, world, step, raw = str(ckpt.zero_stage), ckpt.world_size, ckpt.step, ckpt.entries
    entries = [_cast(e, DTYPES[dtype]) for e in raw]
    total = sum(e.nbytes for e in entries)
    _check_writable(ckpt_dir if output is None else writable_parent(Path(output)), total)

    metadata = {"format": "pt", "producer": f"opentau {CONSOLIDATE_COMMAND}", "zero_stage": source,
                "world_size": str(world), "step": str(step), "weights": kind}
    shards = _split_shards(entries, max_bytes)
    if output is None:
        # Into the checkpoint: every file written and synced under a hidden name, vouched for by the manifest, then
        # renamed into place, so the checkpoint is sound at every instant (vouch_and_rename).
        staged = _write_weights(single, shards, metadata, ckpt_dir, progress, total, rename=False)
        written = [final for _, final in staged]
        stale = _stale_layout(single, written)
        if mf.read_manifest(ckpt_dir) is not None:
            vouch_and_rename(ckpt_dir, staged, stale)
        else:  # a checkpoint without a manifest (DeepSpeed's own): nothing vouches, the renames are the commit
            for temp, final in staged:
                os.replace(temp, final)
            for path in stale:
                path.unlink()
    elif single == Path(output):
        # A FILE.safetensors target: each file written to a hidden sibling and renamed (write_safetensors), shards
        # before the index that makes them a model.
        made = make_parents(single.parent)
        try:
            written = _write_weights(single, shards, metadata, ckpt_dir, progress, total)
        except BaseException:
            remove_made(made)
            raise
        for path in _stale_layout(single, written):
            path.unlink()
    else:  # a directory target: written whole into a hidden sibling, renamed into place
        from opentau_cli.tools.remote import remote_origin

        origin = remote_origin(ckpt_dir)  # a cached copy of a checkpoint in remote storage is named by its URL
        with publishing(Path(output), force=force, source=ckpt_dir, command=CONSOLIDATE_COMMAND,
                        recorded=origin["address"] if origin else None) as staging:
            staging.mkdir()
            staged = _write_weights(staging / MODEL_WEIGHTS, shards, metadata, ckpt_dir, progress, total, shown=Path(output))
            written = [Path(output) / p.name for p in staged]
    return ConsolidateResult(written, len(entries), total, notes=notes)


def _vouched(ckpt_dir: Path, single: Path) -> bool:
    """Whether the checkpoint's manifest lists the consolidated output (a checkpoint without one has nothing to
    vouch: DeepSpeed's own)."""
    manifest = mf.read_manifest(ckpt_dir)
    if manifest is None:
        return True
    names = [single.name] if single.is_file() else [weights_index_path(single).name]
    if not single.is_file():
        try:
            names += sorted(set(json.loads(weights_index_path(single).read_text()).get("weight_map", {}).values()))
        except (OSError, ValueError, AttributeError):
            return False
    return all(name in manifest["files"] for name in names)


def vouch_and_rename(ckpt_dir: Path, staged: list[tuple[Path, Path]], stale: list[Path]) -> None:
    """Replace files at the top of a checkpoint so that it is sound at every instant (docs/ARCHITECTURE.md,
    "Checkpoint contract"): `staged` (temp sibling, final path) pairs are complete and synced; `stale` are files the
    new ones supersede. The stale files go aside to hidden siblings, the manifest then vouches for the new files (by
    their temps' bytes) and forgets the stale ones, and only then are the temps renamed into place and the stale
    copies deleted. A kill anywhere leaves what every reader puts back (store/manifest.py put_back: a listed file
    under its sibling name) or a leftover the next run of this command removes; never a file under a listed name
    that the manifest does not vouch for."""
    manifest = mf.read_manifest(ckpt_dir)
    if manifest is None:
        raise FileNotFoundError(f"{ckpt_dir / MANIFEST} is missing or unreadable")
    aside = []
    for path in stale:
        os.replace(path, mf.old_sibling(path))
        aside.append(mf.old_sibling(path))
    for path in stale:
        manifest["files"].pop(path.name, None)
    for temp, final in staged:
        manifest["files"][final.name] = {"size": temp.stat().st_size, "hash": mf.hash_file(temp)}
    mf.write_json_atomic(ckpt_dir / MANIFEST, manifest)
    fault_point("vouched", ckpt_dir)
    for temp, final in staged:
        try:
            os.replace(temp, final)
        except FileNotFoundError:  # a reader's put_back renamed it first
            if not final.is_file():
                raise
    fsync_dir(ckpt_dir)
    for path in aside:
        path.unlink(missing_ok=True)


def _write_weights(single: Path, shards: list[list[TensorEntry]], metadata: dict, ckpt_dir: Path, progress,
                   total: int, shown: Path | None = None, rename: bool = True) -> list:
    """`single`, or above the shard size its shards and then the index; on failure nothing is left. Messages name
    `shown` (the user's --output) rather than the hidden sibling being written. With rename=False each file stays
    under its synced temp name: returns (temp, final) pairs, for vouch_and_rename."""
    out_dir = shown or single.parent
    written: list[Path] = []
    done = [0]

    def wrote(entry: TensorEntry) -> None:
        fault_point("tensor_written", single)
        if progress is not None:
            done[0] += entry.nbytes
            progress(done[0], total)

    def place(path: Path, write) -> None:
        out = write(path)
        written.append(out)
        if rename:
            return
        staged.append((out, path))

    staged: list[tuple[Path, Path]] = []
    try:
        if len(shards) == 1:
            place(single, lambda p: write_safetensors(p, shards[0], metadata, wrote, rename=rename))
        else:
            # Shards first, the index last: the index is what makes the sharded output exist.
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                path = weights_shard_path(single, i, len(shards))
                place(path, lambda p, shard=shard: write_safetensors(p, shard, metadata, wrote, rename=rename))
                weight_map.update({e.name: path.name for e in shard})
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            index_path = weights_index_path(single)
            place(index_path, lambda p: mf.write_json_atomic(mf.temp_sibling(p) if not rename else p, index))
    except OSError as e:
        for p in written:
            p.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC or e.errno == errno.EFBIG or e.errno == errno.EDQUOT:
            raise RunError(f"Disk full while writing the consolidated weights to {out_dir}; nothing was left behind. "
                           f"Free {total / 1e9:.2f} GB there or pass --output on another disk.") from None
        raise RunError(f"Writing the consolidated weights to {out_dir} failed ({e.strerror or e}); nothing was left behind.") from None
    except ShardFormatError as e:  # a tensor that reads as truncated or corrupt only when its turn to be written comes
        for p in written:
            p.unlink(missing_ok=True)
        raise UserError(f"{ckpt_dir}: {e}; nothing was written.") from None
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    return written if rename else staged


def _check_writable(out_dir: Path, total: int) -> None:
    if not out_dir.is_dir():
        raise UserError(f"Output directory {out_dir} does not exist.")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise UserError(f"Output directory {out_dir} is not writable.")
    free = shutil.disk_usage(out_dir).free
    if free < total:
        raise UserError(f"Not enough disk space in {out_dir}: the consolidated weights need {total / 1e9:.2f} GB, "
                        f"{free / 1e9:.2f} GB are free.")


def _stale_layout(single: Path, written: list[Path]) -> list[Path]:
    """The previous output's files that the new layout does not write over (single <-> sharded, fewer shards)."""
    index, stale = weights_index_path(single), []
    if single not in written and single.is_file():
        stale.append(single)
    if index not in written and index.is_file():
        try:
            old = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError):
            old = set()
        for name in sorted(old):
            p = single.with_name(name)
            if p not in written and p.name.startswith(single.stem + "-") and p.is_file():
                stale.append(p)
        stale.append(index)
    return stale
