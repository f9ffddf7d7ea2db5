"""A run's checkpoints in a second place (`checkpoint.remote`): what is written there, in which order, and what a
reader trusts (docs/ARCHITECTURE.md, "Remote checkpoints").

The remote holds the run directory's own relative paths: `checkpoints/<name>/...` (every file of a published
checkpoint), `checkpoints/last` and `checkpoints/best` (small objects holding a checkpoint's name), the run's history
as of the newest commit (`metrics.jsonl`, `logs/restarts.jsonl`, TensorBoard's events) and `run.json` (which run
this is). An object store has no rename: a checkpoint is committed by objects written last. Every file of its
manifest is uploaded and checked from the store's side, then the history, then `checkpoints/<name>/manifest.json`,
then `checkpoints/last`. A checkpoint counts only once its manifest is there and every file it lists is there at its
size; readers find them from the manifests (`survey`), take `last` only as a hint (a missing or garbled one strands
nothing, and a resume repairs it: `repair_last`), and never take a folder without a manifest (an interrupted upload),
which a later commit removes. A checkpoint whose manifest is there but whose files are not (missing, shorter, other
bytes on download) is damaged: said once, with the way on (`Damaged`).

Everything here goes through a `store.storage.Storage`, so a directory and an object store obey the same code.
Every write calls `fence` first: the writer's lease check (process/lease.py), which raises once another launch holds
the store, so that a writer that lost it changes nothing there.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from opentau_cli.errors import RunError, UserError
from opentau_cli.store.layout import (
    BEST, CHECKPOINTS, EMA_WEIGHTS, EVALS, LAST, LAUNCH_FILE, LOGS, MANIFEST, METRICS, ROLLED_BACK, TENSORBOARD,
    step_of,
)
from opentau_cli.store.manifest import hash_file
from opentau_cli.store.storage import Storage

RUN_RECORD = "run.json"  # at the remote's root: the run it holds
RESTARTS_FILE = f"{LOGS}/restarts.jsonl"  # process/restarts.py's history


class Fenced(RunError):
    """This writer may change nothing more in the store: its lease is lost (process/lease.py), or the store holds a
    committed checkpoint it would write over."""


def pointer(data: bytes) -> str | None:
    """The checkpoint name a `last` / `best` object holds (None when it holds none)."""
    name = data.decode("utf-8", "replace").strip()
    return name if step_of(name) is not None else None


@dataclass
class Found:
    """What a reader finds in a remote: its checkpoint folders by state, and what `last` and `best` say."""

    url: str
    committed: list[str]  # its manifest is there and every file it lists is there at its size; oldest first
    damaged: dict[str, tuple[str, str]]  # its manifest is there, a file is not: name -> (file, what is wrong)
    partial: list[str]  # objects without a manifest: an upload under way, interrupted, or whose manifest went
    last: str | None  # the checkpoint `checkpoints/last` names (None: missing or garbled)
    last_problem: str | None  # why `last` is not to be followed, in words; None when it names the newest committed
    best: str | None  # the checkpoint `checkpoints/best` names, when it has a manifest

    @property
    def newest(self) -> str | None:
        """The checkpoint a reader continues: the newest with a manifest (a damaged one is said, never skipped)."""
        return max([*self.committed, *self.damaged], key=step_of, default=None)

    def with_manifest(self) -> list[str]:
        return sorted([*self.committed, *self.damaged], key=step_of)

    def damage(self, name: str, rel: str | None = None, what: str | None = None) -> "Damaged":
        """The error for damaged checkpoint `name` (its file `rel` and what is wrong with it, else as found)."""
        rel, what = (rel, what) if rel is not None else self.damaged[name]
        earlier = [n for n in self.committed if step_of(n) < step_of(name)]
        return Damaged(self.url, name, rel, what, earlier[-1] if earlier else None)


class Damaged(UserError):
    """A checkpoint whose manifest is in the store but one of whose files is missing, at another size or holds other
    bytes: one sentence naming the checkpoint, the file and the way on (the newest intact checkpoint before it)."""

    def __init__(self, url: str, name: str, rel: str, what: str, earlier: str | None):
        self.url, self.name, self.rel, self.what, self.earlier = url, name, rel, what, earlier
        super().__init__(self.sentence(resume=True))

    def sentence(self, *, resume: bool) -> str:
        head = (f"Checkpoint {self.name} in {self.url} is damaged ({CHECKPOINTS}/{self.name}/{self.rel} {self.what}) "
                "and nothing was written locally")
        if self.earlier is None:
            return (f"{head}: no earlier checkpoint there is intact; restore the file, or start the run again with "
                    "`opentau train`.")
        at = f"{self.url}:{step_of(self.earlier)}"
        if resume:
            return (f"{head}: continue from the newest intact one with `opentau resume {at} --rollback=true` (the "
                    f"newer ones move into {self.url}/{ROLLED_BACK}/<time>/; nothing is deleted).")
        return f"{head}: the newest intact checkpoint before it is {at}."


@dataclass
class RemoteRun:
    """One run's remote copy. `fence`: called before every write (the lease's check; readers need none)."""

    storage: Storage
    fence: Callable[[], None] = field(default=lambda: None, repr=False)

    @property
    def url(self) -> str:
        return self.storage.url

    # Reading.

    def survey(self) -> Found:
        """Every checkpoint folder, from one listing and each manifest: committed (every file it lists at its size),
        damaged or partial; and whether `last` names the newest committed one."""
        folders: dict[str, dict[str, int]] = {}
        for key, size in self.storage.sizes(CHECKPOINTS).items():
            parts = key.split("/")
            if len(parts) >= 3 and step_of(parts[1]) is not None:
                folders.setdefault(parts[1], {})["/".join(parts[2:])] = size
        committed, damaged, partial = [], {}, []
        for name in sorted(folders, key=step_of):
            have = folders[name]
            if MANIFEST not in have:
                partial.append(name)
                continue
            try:
                files = json.loads(self.storage.read_bytes(f"{CHECKPOINTS}/{name}/{MANIFEST}"))["files"]
                wrong = next(((rel, "is missing" if rel not in have else
                               f"holds {have[rel]} bytes where its manifest says {entry['size']}")
                              for rel, entry in sorted(files.items()) if have.get(rel) != entry["size"]), None)
            except FileNotFoundError:  # deleted since the listing (retention): no longer trusted
                partial.append(name)
                continue
            except (ValueError, KeyError, TypeError, AttributeError):
                wrong = (MANIFEST, "is not a readable manifest")
            if wrong is None:
                committed.append(name)
            else:
                damaged[name] = wrong
        found = Found(self.url, committed, damaged, partial, self._pointer(LAST), None, self._pointer(BEST))
        if found.best not in found.with_manifest():
            found.best = None
        found.last_problem = _last_problem(found)
        return found

    def newest_committed(self) -> str | None:
        """The newest committed checkpoint (every file at its size): where a re-formed group continues."""
        committed = self.survey().committed
        return committed[-1] if committed else None

    def committed(self) -> list[str]:
        """Names of the checkpoints whose manifest is there (what the writer committed; `survey` also checks each
        file's size), oldest first."""
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

    def repair_last(self, name: str | None = None) -> str | None:
        """Point `last` at `name` (the checkpoint a resume continues; when it is not committed, the newest committed
        one) where `last` is missing, garbled, names no committed checkpoint or an older one than that. Returns the
        name written, or None when `last` was sound. `last` is a hint (readers go by the manifests): this keeps it
        true for other tools and for older opentau releases."""
        found = self.survey()
        target = name if name in found.committed else (found.committed[-1] if found.committed else None)
        if target is None or (found.last in found.committed and step_of(found.last) >= step_of(target)):
            return None
        self.set_pointer(LAST, target)
        return target

    # Writing: upload, commit, retain.

    def claim(self, record: dict) -> None:
        """Say which run this remote holds: written before its first checkpoint, and again by a run that starts
        over a remote where nothing was ever committed."""
        if self.run_record() is None or not self.committed():
            self.fence()
            self.storage.write_bytes(RUN_RECORD, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())

    def upload(self, name: str, files: dict[str, Path], manifest: dict, *, cancelled: Callable[[], bool] = lambda: False,
               progress: Callable[[int], None] = lambda n: None, done: dict[str, str] | None = None,
               sending: Callable[[int], None] | None = None) -> bool:
        """Put every file of checkpoint `name` (relative path -> local file), each checked against the manifest's
        hash before it is sent and from the store's side once stored. `done` (relative path -> checksum) carries
        what an earlier attempt stored and checked: a file the store still holds with that checksum is not sent
        again. `progress(size)` after each file is stored and checked; `sending(n)` as bytes go (a display's).
        Files go in batches of about UPLOAD_BATCH bytes through the client's transfer pool. Returns False when
        `cancelled` said stop (what is there stays, uncommitted). Raises RunError when a local file no longer matches
        the manifest (the checkpoint changed on disk: it is not uploaded), Fenced when the store holds a committed
        checkpoint of that name (never written over) or `fence` refuses."""
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
            if self.storage.size(f"{CHECKPOINTS}/{name}/{MANIFEST}") is not None:
                raise Fenced(f"{self.url} holds another committed checkpoint {name} (the run went on elsewhere): "
                             f"this launch changes nothing in the store; its checkpoints stay local.")
            self.fence()
            sent = self.storage.put_files([(local, key) for _, local, key, _ in batch], sending)
            for rel, _, key, size in batch:
                if self.storage.checksum(key) != sent[key] or self.storage.size(key) != size:
                    raise RunError(f"{self.url}/{key} does not hold what was sent (the store's checksum differs).")
                done[rel] = sent[key]
                progress(size)
        return not cancelled()

    def commit(self, name: str, manifest_file: Path, history: dict[str, Path], *, best: str | None = None) -> None:
        """Make checkpoint `name` count: the run's history as of now, its manifest, then `last` (and `best`)."""
        self.store_history(history)
        self.fence()
        key = f"{CHECKPOINTS}/{name}/{MANIFEST}"
        if self.storage.size(key) is None:
            self.storage.put_file(manifest_file, key)
        elif self.storage.read_bytes(key) != Path(manifest_file).read_bytes():  # not this commit's, retried
            raise Fenced(f"{self.url} holds another committed checkpoint {name} (the run went on elsewhere): this "
                         f"launch changes nothing in the store; its checkpoints stay local.")
        self.set_pointer(LAST, name)
        if best is not None:
            self.set_pointer(BEST, best)

    def store_history(self, history: dict[str, Path]) -> None:
        """The run's history as of now (history_files), fenced: with each commit, and once more after the run's last
        evaluations (process/launch.py)."""
        self.fence()
        for rel, local in sorted(history.items()):
            if local.is_file():
                self.storage.write_bytes(rel, local.read_bytes())

    def set_pointer(self, link: str, name: str) -> None:
        """Point `checkpoints/<link>` (`last`, `best`) at `name`, fenced: every write of a pointer goes here."""
        self.fence()
        self.storage.write_bytes(f"{CHECKPOINTS}/{link}", f"{name}\n".encode())

    def retain(self, keep: set[str]) -> list[str]:
        """Delete every committed checkpoint not in `keep`, never `last` or `best`: its manifest first (readers stop
        trusting it), then its files. Returns the names deleted."""
        keep = set(keep) | {n for n in (self.last(), self.best()) if n}
        doomed = [n for n in self.committed() if n not in keep]
        for name in doomed:
            self.fence()
            self.storage.delete([f"{CHECKPOINTS}/{name}/{MANIFEST}"])
            self.storage.delete(self.storage.list(f"{CHECKPOINTS}/{name}"))
        return doomed

    def remove_partial(self, busy: set[str] = frozenset()) -> list[str]:
        """Remove what interrupted uploads left (folders without a manifest), except those `busy` uploading."""
        gone = [n for n in self.partial() if n not in busy]
        for name in gone:
            self.fence()
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
            self.fence()
            for key in ordered:
                self.storage.copy(key, f"{ROLLED_BACK}/{stamp}/{key}")
            self.fence()
            self.storage.delete([manifest_key])
            self.storage.delete([k for k in keys if k != manifest_key])

    # Fetching: what a resume or an offline tool needs, verified.

    def fetch(self, name: str, run_dir: Path, *, only: Callable[[str], bool] = lambda rel: True,
              history: bool = True, reuse: bool = True) -> Path:
        """Download committed checkpoint `name` into `run_dir/checkpoints/<name>` (its files that `only` accepts, each
        checked against the manifest's hash before it lands: Damaged, nothing kept, when one does not match), the
        run's history with it, and point the local `last` at it. Returns the checkpoint directory. With `reuse`, files
        already there with the manifest's hash are kept rather than downloaded again."""
        from opentau_cli.store.layout import old_dir, point_last, tmp_dir
        from opentau_cli.store.outputs import make_parents, remove_made

        run_dir = Path(run_dir)
        manifest = self.manifest(name)
        root = run_dir / CHECKPOINTS
        final = root / name
        staging = tmp_dir(root, name, f"fetch{os.getpid()}")  # a leftover the next launch removes, as a save's
        shutil.rmtree(staging, ignore_errors=True)
        made = make_parents(root)
        staging.mkdir()
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
                size = target.stat().st_size
                if size != entry["size"]:
                    raise self.survey().damage(name, rel, f"holds {size} bytes where its manifest says {entry['size']}")
                if hash_file(target) != entry["hash"]:
                    raise self.survey().damage(name, rel, "does not match its manifest's hash")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            remove_made(made)
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


def choose(remote: RemoteRun, what: str | None, found: Found | None = None) -> str:
    """The committed checkpoint `what` names (None: the newest; `last` is only a hint). Raises Damaged when that
    checkpoint's manifest is there but a file is not at its size."""
    found = found or remote.survey()
    if what is None:
        name = found.newest
    elif what == BEST:
        name = found.best
        if name is None:
            raise UserError(f"{remote.url} keeps no best checkpoint (checkpoint.keep_best): pass URL:STEP.")
    else:
        name = next((n for n in found.with_manifest() if step_of(n) == int(what)), None)
        if name is None:
            raise UserError(f"{remote.url} holds no committed checkpoint of step {int(what)} (committed: "
                            f"{', '.join(found.committed) or 'none'}).")
    if name is None:
        raise UserError(f"{remote.url} holds no committed checkpoint.")
    if name in found.damaged:
        raise found.damage(name)
    return name


def _last_problem(found: Found) -> str | None:
    """Why `checkpoints/last` is not to be followed (None: it names the newest committed checkpoint)."""
    newest = found.committed[-1] if found.committed else None
    if found.last == newest:
        return None
    then = f"; readers continue from {newest}, the newest committed checkpoint" if newest else ""
    if found.last is None:
        return f"{CHECKPOINTS}/{LAST} is missing or holds no checkpoint name{then}"
    if found.last in found.damaged:
        return f"{CHECKPOINTS}/{LAST} names {found.last}, which is damaged{then}"
    if found.last not in found.committed:
        return f"{CHECKPOINTS}/{LAST} names {found.last}, which is not committed (no manifest){then}"
    return f"{CHECKPOINTS}/{LAST} names {found.last}, an older checkpoint{then}"


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
    rank's own, and those ranks' own (the manifest's rank_files); None: every file (another world reads them all).
    A single / DDP run's whole EMA is rank 0's file (rank 0 writes it) but every rank loads it (train/ema.py)."""
    if ranks is None:
        return lambda rel: True
    owned = {rel: int(rank) for rank, rels in (manifest.get("rank_files") or {}).items() for rel in rels
             if rel != EMA_WEIGHTS}
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
