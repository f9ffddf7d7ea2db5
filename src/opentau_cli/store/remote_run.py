"""A run's checkpoints in a second place (`checkpoint.remote`): what is written there, in which order, and what a
reader trusts (docs/ARCHITECTURE.md, "Remote checkpoints").

The remote holds the run directory's own relative paths: `checkpoints/<name>/...` (every file of a published
checkpoint), `checkpoints/last` and `checkpoints/best` (small objects holding a checkpoint's name), the run's history
as of the newest commit (`metrics.jsonl`, `logs/restarts.jsonl`, TensorBoard's events) and `run.json` (which run
this is). An object store has no rename: a checkpoint is committed by objects written last. Every file of its
manifest is uploaded and checked from the store's side, then the history, then `checkpoints/<name>/manifest.json`,
then `checkpoints/last`. A checkpoint counts only once its manifest is there; readers follow `last` and never take a
folder without a manifest (an interrupted upload), which a later commit removes.

Everything here goes through a `store.storage.Storage`, so a directory and an object store obey the same code.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from opentau_cli.errors import RunError, UserError
from opentau_cli.store.layout import (
    BEST, CHECKPOINTS, EVALS, LAST, LAUNCH_FILE, LOGS, MANIFEST, METRICS, ROLLED_BACK, TENSORBOARD, step_of,
)
from opentau_cli.store.manifest import hash_file
from opentau_cli.store.storage import Storage

RUN_RECORD = "run.json"  # at the remote's root: the run it holds
RESTARTS_FILE = f"{LOGS}/restarts.jsonl"  # process/restarts.py's history


def pointer(data: bytes) -> str | None:
    """The checkpoint name a `last` / `best` object holds (None when it holds none)."""
    name = data.decode("utf-8", "replace").strip()
    return name if step_of(name) is not None else None


@dataclass
class RemoteRun:
    """One run's remote copy."""

    storage: Storage

    @property
    def url(self) -> str:
        return self.storage.url

    # Reading.

    def committed(self) -> list[str]:
        """Names of the committed checkpoints (their manifest is there), oldest first."""
        names = {key.split("/")[1] for key in self.storage.list(CHECKPOINTS)
                 if key.count("/") == 2 and key.endswith("/" + MANIFEST)}
        return sorted((n for n in names if step_of(n) is not None), key=step_of)

    def partial(self) -> list[str]:
        """Checkpoint folders with objects but no manifest: uploads that never committed."""
        keys = self.storage.list(CHECKPOINTS)
        folders = {key.split("/")[1] for key in keys if key.count("/") >= 2}
        return sorted(n for n in folders - set(self.committed()) if step_of(n) is not None)

    def last(self) -> str | None:
        """The checkpoint `checkpoints/last` names, if it is committed (a reader's only way in)."""
        name = self._pointer(LAST)
        return name if name is not None and self.storage.size(f"{CHECKPOINTS}/{name}/{MANIFEST}") is not None else None

    def best(self) -> str | None:
        name = self._pointer(BEST)
        return name if name is not None and self.storage.size(f"{CHECKPOINTS}/{name}/{MANIFEST}") is not None else None

    def manifest(self, name: str) -> dict:
        return json.loads(self.storage.read_bytes(f"{CHECKPOINTS}/{name}/{MANIFEST}"))

    def read_json(self, name: str, rel: str) -> dict:
        return json.loads(self.storage.read_bytes(f"{CHECKPOINTS}/{name}/{rel}"))

    def run_record(self) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(RUN_RECORD))
        except FileNotFoundError:
            return None

    def is_empty(self) -> bool:
        return not self.storage.list("")

    def _pointer(self, link: str) -> str | None:
        try:
            return pointer(self.storage.read_bytes(f"{CHECKPOINTS}/{link}"))
        except FileNotFoundError:
            return None

    # Writing: upload, commit, retain.

    def claim(self, record: dict) -> None:
        """Say which run this remote holds: written before its first checkpoint, and again by a run that starts
        over a remote where nothing was ever committed."""
        if self.run_record() is None or not self.committed():
            self.storage.write_bytes(RUN_RECORD, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())

    def upload(self, name: str, files: dict[str, Path], manifest: dict, *, cancelled: Callable[[], bool] = lambda: False,
               progress: Callable[[int], None] = lambda n: None, done: dict[str, str] | None = None) -> bool:
        """Put every file of checkpoint `name` (relative path -> local file), each checked against the manifest's
        hash before it is sent and from the store's side once stored. `done` (relative path -> checksum) carries
        what an earlier attempt stored and checked: a file the store still holds with that checksum is not sent
        again. Files go in batches of about UPLOAD_BATCH bytes through the client's transfer pool. Returns False
        when `cancelled` said stop (what is there stays, uncommitted). Raises RunError when a local file no longer
        matches the manifest (the checkpoint changed on disk: it is not uploaded)."""
        done = {} if done is None else done
        todo = []
        for rel, local in sorted(files.items()):
            entry = manifest["files"][rel]
            key = f"{CHECKPOINTS}/{name}/{rel}"
            if rel in done and self.storage.checksum(key) == done[rel]:
                progress(entry["size"])
                continue
            if local.stat().st_size != entry["size"] or hash_file(local) != entry["hash"]:
                raise RunError(f"{local} no longer matches its checkpoint's manifest; checkpoint {name} is not uploaded.")
            todo.append((rel, local, key, entry["size"]))
        for batch in _batches(todo):
            if cancelled():
                return False
            sent = self.storage.put_files([(local, key) for _, local, key, _ in batch])
            for rel, _, key, size in batch:
                if self.storage.checksum(key) != sent[key] or self.storage.size(key) != size:
                    raise RunError(f"{self.url}/{key} does not hold what was sent (the store's checksum differs).")
                done[rel] = sent[key]
                progress(size)
        return not cancelled()

    def commit(self, name: str, manifest_file: Path, history: dict[str, Path], *, best: str | None = None) -> None:
        """Make checkpoint `name` count: the run's history as of now, its manifest, then `last` (and `best`)."""
        for rel, local in sorted(history.items()):
            if local.is_file():
                self.storage.write_bytes(rel, local.read_bytes())
        self.storage.put_file(manifest_file, f"{CHECKPOINTS}/{name}/{MANIFEST}")
        self.storage.write_bytes(f"{CHECKPOINTS}/{LAST}", f"{name}\n".encode())
        if best is not None:
            self.storage.write_bytes(f"{CHECKPOINTS}/{BEST}", f"{best}\n".encode())

    def retain(self, keep: set[str], *, force: bool = False) -> list[str]:
        """Delete every committed checkpoint not in `keep`, never `last` or `best` (unless `force`: a checkpoint of
        the same name is about to replace it): its manifest first (readers stop trusting it), then its files.
        Returns the names deleted."""
        keep = set(keep) | (set() if force else {n for n in (self.last(), self.best()) if n})
        doomed = [n for n in self.committed() if n not in keep]
        for name in doomed:
            self.storage.delete([f"{CHECKPOINTS}/{name}/{MANIFEST}"])
            self.storage.delete(self.storage.list(f"{CHECKPOINTS}/{name}"))
        return doomed

    def remove_partial(self, busy: set[str] = frozenset()) -> list[str]:
        """Remove what interrupted uploads left (folders without a manifest), except those `busy` uploading."""
        gone = [n for n in self.partial() if n not in busy]
        for name in gone:
            self.storage.delete(self.storage.list(f"{CHECKPOINTS}/{name}"))
        return gone

    def set_aside(self, names: list[str], stamp: str) -> None:
        """A rollback's remote half: move committed checkpoints to `rolled_back/<stamp>/` (copy, then delete), as the
        local rollback moves them aside (store/lineage.py)."""
        for name in names:
            prefix = f"{CHECKPOINTS}/{name}"
            keys = self.storage.list(prefix)
            manifest_key = f"{prefix}/{MANIFEST}"
            ordered = [k for k in keys if k != manifest_key] + ([manifest_key] if manifest_key in keys else [])
            for key in ordered:
                self.storage.copy(key, f"{ROLLED_BACK}/{stamp}/{key}")
            self.storage.delete([manifest_key])
            self.storage.delete([k for k in keys if k != manifest_key])

    # Fetching: what a resume or an offline tool needs, verified.

    def fetch(self, name: str, run_dir: Path, *, only: Callable[[str], bool] = lambda rel: True,
              history: bool = True, reuse: bool = True) -> Path:
        """Download committed checkpoint `name` into `run_dir/checkpoints/<name>` (its files that `only` accepts, each
        checked against the manifest's hash before it lands), the run's history with it, and point the local `last`
        at it. Returns the checkpoint directory. With `reuse`, files already there with the manifest's hash are kept
        rather than downloaded again."""
        from opentau_cli.store.layout import old_dir, point_last, tmp_dir

        run_dir = Path(run_dir)
        manifest = self.manifest(name)
        root = run_dir / CHECKPOINTS
        final = root / name
        staging = tmp_dir(root, name, f"fetch{os.getpid()}")  # a leftover the next launch removes, as a save's
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        wanted = []
        for rel, entry in sorted(manifest["files"].items()):
            if not only(rel):
                continue
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            have = final / rel
            if reuse and have.is_file() and have.stat().st_size == entry["size"] and hash_file(have) == entry["hash"]:
                _link_or_copy(have, target)
            else:
                wanted.append((rel, target))
        try:
            self.storage.get_files([(f"{CHECKPOINTS}/{name}/{rel}", target) for rel, target in wanted])
            for rel, target in wanted:
                entry = manifest["files"][rel]
                if target.stat().st_size != entry["size"] or hash_file(target) != entry["hash"]:
                    raise RunError(f"{self.url}/{CHECKPOINTS}/{name}/{rel} does not match its manifest after download; "
                                   "nothing was loaded.")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if history:
            self.fetch_history(run_dir)
        if final.exists():
            old = old_dir(root, name, f"fetch{os.getpid()}")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(staging, final)
        point_last(root, name)
        return final

    def fetch_history(self, run_dir: Path) -> None:
        """metrics.jsonl, logs/restarts.jsonl and TensorBoard's events as the newest commit left them."""
        launches = [k for k in self.storage.list(LOGS) if k.endswith("/" + LAUNCH_FILE)]
        wanted = [METRICS, RESTARTS_FILE, *launches, *self.storage.list(TENSORBOARD)]
        for key in wanted:
            try:
                data = self.storage.read_bytes(key)
            except FileNotFoundError:
                continue
            target = Path(run_dir) / key
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def split_target(text: str) -> tuple[str, str | None]:
    """`URL[:STEP|:best|:last]` -> (URL, what): the step's digits, "best", or None for `last`."""
    head, sep, tail = text.rpartition(":")
    if sep and "://" in head and (tail.isdigit() or tail in (BEST, LAST)):
        return head, None if tail == LAST else tail
    return text, None


def choose(remote: RemoteRun, what: str | None) -> str:
    """The committed checkpoint `what` names (None: `last`)."""
    committed = remote.committed()
    if what is None:
        name = remote.last()
    elif what == BEST:
        name = remote.best()
        if name is None:
            raise UserError(f"{remote.url} keeps no best checkpoint (checkpoint.keep_best): pass URL:STEP.")
    else:
        name = next((n for n in committed if step_of(n) == int(what)), None)
        if name is None:
            raise UserError(f"{remote.url} holds no committed checkpoint of step {int(what)} (committed: "
                            f"{', '.join(committed) or 'none'}).")
    if name is None:
        raise UserError(f"{remote.url} holds no committed checkpoint.")
    return name


UPLOAD_BATCH = 512 << 20  # bytes of files sent together: large enough to fill the pool, small enough to show progress


def _batches(items: list) -> list[list]:
    """(rel, local, key, size) items in batches of about UPLOAD_BATCH bytes, in order."""
    out, current, size = [], [], 0
    for item in items:
        current.append(item)
        size += item[3]
        if size >= UPLOAD_BATCH:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def files_for(manifest: dict, ranks: set[int] | None) -> Callable[[str], bool]:
    """Which files of a checkpoint the ranks `ranks` load when it continues on the same world: every file that is no
    rank's own, and those ranks' own (the manifest's rank_files); None: every file (another world reads them all)."""
    if ranks is None:
        return lambda rel: True
    owned = {rel: int(rank) for rank, rels in (manifest.get("rank_files") or {}).items() for rel in rels}
    return lambda rel: rel not in owned or owned[rel] in ranks


def history_files(run_dir: Path) -> dict[str, Path]:
    """The run's history a commit carries: relative path -> local file (those that exist)."""
    run_dir = Path(run_dir)
    found = {METRICS: run_dir / METRICS, RESTARTS_FILE: run_dir / RESTARTS_FILE}
    # Each launch's launch.json: a resume reads the dataset branches its checkpoint's launch recorded.
    found.update({p.relative_to(run_dir).as_posix(): p for p in sorted((run_dir / LOGS).glob(f"*/{LAUNCH_FILE}"))})
    # The evaluations' records (store/evals.py): those present at the commit; a later one goes with the next commit.
    found.update({p.relative_to(run_dir).as_posix(): p for p in sorted((run_dir / EVALS).glob("*.json"))})
    tb = run_dir / TENSORBOARD
    if tb.is_dir():
        found.update({p.relative_to(run_dir).as_posix(): p for p in sorted(tb.rglob("*")) if p.is_file()})
    return {rel: p for rel, p in found.items() if p.is_file()}


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
