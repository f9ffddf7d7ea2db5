"""A run's history: the checkpoint each checkpoint continues, the branch `checkpoints/last` is on, and rollbacks.

docs/ARCHITECTURE.md, "Run history". Every checkpoint's training_state.json carries a `lineage` record: its parent
(the checkpoint the launch that wrote it started from or saved before it: step, directory name and the xxh3-128 of
the parent's manifest.json) and the launch (run id) that wrote it. Following parents from `last` gives the current
branch. A resume from a checkpoint older than the run's newest would overwrite or mix histories, so it is refused
unless the user asks for a rollback, which moves the newer checkpoints and their metrics records into
`rolled_back/<time>/` (moved, never deleted). Imports nothing heavy: the launcher and `checkpoint list` use it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from opentau_cli.store.layout import (CHECKPOINTS, MANIFEST, METRICS, ROLLED_BACK, TRAINING_STATE, is_run_dir,
                                           point_last, read_last, step_of)
from opentau_cli.store import evals
from opentau_cli.store.manifest import hash_file, is_complete

LINEAGE = "lineage"


def _published(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in root.iterdir() if step_of(p.name) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found)


def parent_record(ckpt_dir: Path) -> dict:
    """What a child checkpoint records of its parent: enough to tell the same directory from a replaced one."""
    ckpt_dir = Path(ckpt_dir)
    manifest = ckpt_dir / MANIFEST
    return {"step": step_of(ckpt_dir.name), "name": ckpt_dir.name,
            "manifest_xxh3": hash_file(manifest) if manifest.is_file() else None}


def lineage_record(parent: Path | None, launch: str) -> dict:
    return {"parent": parent_record(parent) if parent is not None else None, "launch": launch}


def lineage_of(ckpt_dir: Path) -> dict | None:
    """The checkpoint's lineage record; None for a checkpoint written before opentau recorded one."""
    try:
        state = json.loads((Path(ckpt_dir) / TRAINING_STATE).read_text())
    except (OSError, ValueError):
        return None
    return lineage_in(state)


def lineage_in(state) -> dict | None:
    """The lineage record of a training_state.json already read; None when it holds none."""
    record = state.get(LINEAGE) if isinstance(state, dict) else None
    return record if isinstance(record, dict) else None


def last_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint directory `checkpoints/last` designates, if it exists."""
    root = Path(run_dir) / CHECKPOINTS
    name = read_last(root)
    path = root / name if name else None
    return path if path is not None and path.is_dir() else None


class _Walk:
    """One walk of a run's checkpoints/: the published checkpoints, listed once, and each one's lineage record and
    manifest hash, read at most once however often the walk asks (nothing is written while it walks)."""

    def __init__(self, root: Path):
        self.root = root
        self.published = _published(root)
        self._lineages: dict[Path, dict | None] = {}
        self._digests: dict[Path, str | None] = {}

    def lineage(self, ckpt_dir: Path) -> dict | None:
        if ckpt_dir not in self._lineages:
            self._lineages[ckpt_dir] = lineage_of(ckpt_dir)
        return self._lineages[ckpt_dir]

    def digest(self, ckpt_dir: Path) -> str | None:
        """The xxh3-128 of the checkpoint's manifest.json; None without one."""
        if ckpt_dir not in self._digests:
            manifest = ckpt_dir / MANIFEST
            self._digests[ckpt_dir] = hash_file(manifest) if manifest.is_file() else None
        return self._digests[ckpt_dir]


def _parent_dir(walk: _Walk, ckpt_dir: Path) -> tuple[bool, Path | None]:
    """(recorded, the checkpoint that continues the branch below `ckpt_dir`): its parent when it is still the very
    checkpoint recorded; when retention deleted the parent, the newest older checkpoint (only branch checkpoints stay
    in checkpoints/: a rollback moves the others); None when the parent was replaced or the branch starts here."""
    record = walk.lineage(ckpt_dir)
    if record is None:
        return False, None
    parent = record.get("parent")
    if not parent:
        return True, None
    path = ckpt_dir.parent / parent["name"]
    if not path.is_dir():
        older = [p for step, p in walk.published if step < int(parent["step"])]
        return True, older[-1] if older else None
    digest = walk.digest(path)
    if digest is not None and parent.get("manifest_xxh3") not in (None, digest):
        return True, None
    return True, path


def _newest_child(walk: _Walk, parent: Path) -> Path | None:
    """The newest published checkpoint that records `parent` (the very one: name and manifest hash) as its parent."""
    digest = walk.digest(parent)
    for _, path in reversed(walk.published):
        recorded = (walk.lineage(path) or {}).get("parent") or {}
        if path != parent and recorded.get("name") == parent.name and recorded.get("manifest_xxh3") == digest:
            return path
    return None


def current_branch(run_dir: Path) -> list[Path]:
    """The checkpoints on `last`'s branch, oldest first: `last`, its ancestors still in checkpoints/ and, after a
    kill between a save's publication and the repointing of `last`, the descendants `last` did not reach yet.

    Checkpoints written before lineage was recorded form one linear history: every older published one counts."""
    walk = _Walk(Path(run_dir) / CHECKPOINTS)
    start = last_checkpoint(run_dir)
    if start is None:
        if not walk.published:
            return []
        start = walk.published[-1][1]
    descendants = []
    while (child := _newest_child(walk, start)) is not None and child not in descendants:
        descendants.append(child)
        start = child
    chain, seen = [start], {start.name}
    current = start
    while True:
        recorded, parent = _parent_dir(walk, current)
        if not recorded:
            chain.extend(p for step, p in reversed(walk.published) if step < (step_of(current.name) or 0))
            break
        if parent is None or parent.name in seen:
            break
        chain.append(parent)
        seen.add(parent.name)
        current = parent
    return list(reversed(chain))


def resume_point(run_dir: Path) -> Path | None:
    """What `opentau resume RUN` continues: `last` when it is complete, else its newest complete ancestor."""
    return newest_complete(current_branch(run_dir))


def newest_complete(branch: list[Path]) -> Path | None:
    """The newest complete checkpoint of `branch` (oldest first, as current_branch gives it)."""
    return next((path for path in reversed(branch) if is_complete(path)), None)


def newer_checkpoints(run_dir: Path, ckpt_dir: Path) -> list[Path]:
    """Published checkpoints past `ckpt_dir`'s step: a resume from it would overwrite them or mix its history with
    theirs."""
    step = step_of(Path(ckpt_dir).name)
    if step is None:
        return []
    return [p for s, p in _published(Path(run_dir) / CHECKPOINTS) if s > step]


def rolled_back(run_dir: Path) -> list[tuple[str, Path]]:
    """(rollback time, checkpoint dir) of every checkpoint a rollback moved aside, oldest rollback first."""
    base = Path(run_dir) / ROLLED_BACK
    if not base.is_dir():
        return []
    return [(stamp.name, path) for stamp in sorted(p for p in base.iterdir() if p.is_dir())
            for _, path in _published(stamp / CHECKPOINTS)]


def archive_of(path: Path) -> Path | None:
    """The run whose `rolled_back/` holds `path` (a rolled-back checkpoint, or anything else in the archive), or None.
    A folder merely named rolled_back is no archive: its parent must be a run directory."""
    path = Path(os.path.abspath(path))
    for at in (path, *path.parents):
        if at.name == ROLLED_BACK and is_run_dir(at.parent):
            return at.parent
    return None


def span(paths: list[Path]) -> str:
    """'000060, 000080' or '000060 ... 000100 (5 checkpoints)' for a message."""
    names = [p.name for p in paths]
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)} checkpoints)"


@dataclass
class Rollback:
    """What a rollback moved."""

    to: Path  # the checkpoint the run continues from
    moved: list[Path]  # their new places
    records: int  # metrics.jsonl records moved
    into: Path

    def line(self) -> str:
        return (f"Rolled back to {self.to.name}: moved {len(self.moved)} newer checkpoint(s) "
                f"({span(self.moved)}) and {self.records} metrics record(s) into {self.into}.")


def roll_back(run_dir: Path, ckpt_dir: Path, stamp: str | None = None) -> Rollback:
    """Move every checkpoint newer than `ckpt_dir` and the metrics records past its step into
    `rolled_back/<stamp>/`, and point `last` at `ckpt_dir`. Renames only: nothing is deleted; a kill midway leaves
    the rest to a second rollback."""
    run_dir, ckpt_dir = Path(run_dir), Path(ckpt_dir)
    step = step_of(ckpt_dir.name)
    newer = newer_checkpoints(run_dir, ckpt_dir)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    into = run_dir / ROLLED_BACK / stamp
    n = 1
    while into.exists():
        into, n = run_dir / ROLLED_BACK / f"{stamp}-{n}", n + 1
    (into / CHECKPOINTS).mkdir(parents=True)
    moved = []
    for path in reversed(newer):  # newest first: a kill midway leaves a prefix of the history in place
        target = into / CHECKPOINTS / path.name
        os.replace(path, target)
        moved.append(target)
    point_last(run_dir / CHECKPOINTS, ckpt_dir.name)
    for path in newer:  # their evaluations' records (store/evals.py) go with them: a new save of that step is owed one
        record = evals.record_path(run_dir, path.name)
        if record.is_file():
            evals.record_path(into, path.name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(record, evals.record_path(into, path.name))
    records = _move_metrics(run_dir / METRICS, into / METRICS, step)
    return Rollback(to=ckpt_dir, moved=sorted(moved), records=records, into=into)


def _move_metrics(path: Path, into: Path, step: int) -> int:
    """Records past `step` go to `into` (appended), the rest stay; the file is replaced atomically."""
    if not path.is_file():
        return 0
    kept, moved = [], []
    for line in path.read_text().splitlines():
        try:
            past = json.loads(line).get("step", 0) > step
        except ValueError:
            continue  # a line cut short by a kill
        (moved if past else kept).append(line)
    if moved:
        with into.open("a") as f:
            f.write("".join(m + "\n" for m in moved))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)
    return len(moved)

