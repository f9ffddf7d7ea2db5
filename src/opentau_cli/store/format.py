"""The checkpoint format's version: what each version means, the check every reader makes, and the migrations that
bring an older checkpoint's records up to the current format.

docs/ARCHITECTURE.md, "Checkpoint contract". A checkpoint records `format_version` in training_state.json and in
manifest.json. Readers accept every earlier version through the migrations below (each one tested against a real
checkpoint of that version kept under tests/fixtures/checkpoints/) and refuse a newer one in one line that names the
opentau release that wrote it.

Versions:
  1  checkpoints written before the field existed (no `format_version`): no `lineage` in training_state.json (a run's
     checkpoints form one linear branch), and relative paths in train_config.json are as the user typed them, relative
     to the working directory of the launch that wrote them.
  2  training_state.json holds `lineage` ({"parent": {...} or None, "launch": run id}; None when not recorded, as
     migrated from 1); train_config.json's paths are absolute, or relative to the run directory when they lie inside it.

Migrations only ever change the records as read into memory; nothing on disk is rewritten. training_state.json's are
below (migrate_training_state). train_config.json's one migration, 1 -> 2, is where every config file is read:
config/paths.py's `paths_base` resolves a version-1 checkpoint's relative paths against the working directory of the
command reading it (the launch's own was not recorded) and a version-2 one's against its run directory. Imports
nothing heavy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from opentau_cli.errors import UserError
from opentau_cli.store.layout import MANIFEST, TRAINING_STATE

FORMAT_VERSION = 2
FIRST_VERSION = 1  # what a checkpoint without `format_version` is
FIELD = "format_version"


def _version_of(record) -> int | None:
    """The format version a parsed record states (FIRST_VERSION when it states none); None when it is not a dict or
    the field is not a positive integer."""
    if not isinstance(record, dict):
        return None
    value = record.get(FIELD, FIRST_VERSION)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_version(ckpt_dir: Path) -> int:
    """The format version of a checkpoint: the highest one its training_state.json and manifest.json state (a record
    that is absent or unreadable says nothing; a checkpoint that says nothing is version 1)."""
    ckpt_dir = Path(ckpt_dir)
    found = [v for name in (TRAINING_STATE, MANIFEST) if (path := ckpt_dir / name).is_file()
             and (v := _version_of(_read_json(path))) is not None]
    return max(found, default=FIRST_VERSION)


def _writer_of(ckpt_dir: Path) -> str | None:
    """The opentau version that wrote the checkpoint, as it recorded it (manifest first, then training_state)."""
    manifest = _read_json(Path(ckpt_dir) / MANIFEST)
    if isinstance(manifest, dict) and isinstance(manifest.get("opentau_version"), str):
        return manifest["opentau_version"]
    state = _read_json(Path(ckpt_dir) / TRAINING_STATE)
    versions = state.get("versions") if isinstance(state, dict) else None
    written_by = versions.get("opentau") if isinstance(versions, dict) else None
    return written_by if isinstance(written_by, str) else None


def check_readable(ckpt_dir: Path) -> int:
    """The checkpoint's format version, when this opentau reads it; a UserError (one line) for a newer format."""
    version = read_version(ckpt_dir)
    if version > FORMAT_VERSION:
        from opentau_cli import __version__

        writer = _writer_of(ckpt_dir)
        needed = f"opentau {writer} or newer" if writer else "a newer opentau"
        raise UserError(
            f"Checkpoint '{ckpt_dir}' has checkpoint format {version} and this opentau ({__version__}) reads formats "
            f"up to {FORMAT_VERSION}: it needs {needed} (pip install -U opentau)."
        )
    return version


def stamp(record: dict) -> dict:
    """The record as this opentau writes it: with the current format version."""
    return {**record, FIELD: FORMAT_VERSION}


# Migrations of training_state.json: MIGRATIONS[v] turns a version-v record into a version-(v+1) one.

def _state_1_to_2(state: dict) -> dict:
    # No lineage was recorded: None says so, and the run's checkpoints then form one linear branch in step order
    # (store/lineage.py).
    return {**state, "lineage": None}


STATE_MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: _state_1_to_2}


def migrate_training_state(state: dict) -> dict:
    """A training_state.json record of any readable version, as the current format states it (a new dict)."""
    version = _version_of(state)
    if version is None:
        raise ValueError(f"not a training state record (its {FIELD} is {state.get(FIELD)!r})" if isinstance(state, dict)
                         else "not a training state record")
    if version > FORMAT_VERSION:
        raise ValueError(f"training state of format {version}; this opentau reads up to {FORMAT_VERSION}")
    while version < FORMAT_VERSION:
        state = STATE_MIGRATIONS[version](state)
        version += 1
    return stamp(state)


def skip_zip_crcs() -> None:
    """torch.save of this process writes its zip records without CRC-32s: computing them took about half the CPU time
    of writing an optimizer state, and no loader checks them (torch.load does not); a checkpoint's integrity is the
    manifest's hash of every file, checked by verify and before resume (docs/ARCHITECTURE.md, "Checkpoint contract")."""
    import torch.utils.serialization.config as serialization

    serialization.save.compute_crc32 = False
