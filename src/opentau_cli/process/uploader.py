"""This machine's copies of the run's published checkpoints to `checkpoint.remote`, made by a thread of the launcher
(docs/ARCHITECTURE.md, "Remote checkpoints").

The launcher outlives its ranks (automatic restarts included), so training never waits on the network and an upload
in flight survives a rank's death. The thread follows `checkpoints/last`: it uploads the newest published checkpoint
that the remote lacks, commits it (store/remote_run.py), then applies retention remotely. One upload at a time: a
checkpoint published while another is uploading waits, and only the newest waiting one is uploaded next (those saved
in between stay local only). A checkpoint is hard-linked aside while it uploads, so local retention may delete it
meanwhile. A failure (the store unreachable, throttling beyond the client's own retries) is retried with backoff,
and what is already stored and checked is not sent again. `<run>/logs/remote.json` says what is local only,
uploading and remote, for the progress line and `checkpoint inspect`.

The launch holds the store's lease (process/lease.py) and every write goes through its check: once it is lost, or
the store holds a committed checkpoint of the same name with other content (the run went on elsewhere), the thread
stops for good, says why, and the checkpoints stay local (`stopped`). A committed checkpoint is never written over.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from opentau_cli.store.layout import (
    BEST, CHECKPOINTS, LAST, LOGS, MANIFEST, TRAINING_STATE, UPLOADING, read_last, step_of,
)
from opentau_cli.store.manifest import read_manifest, write_json_atomic
from opentau_cli.store.remote_run import Fenced, RemoteRun, history_files

STATUS = "remote.json"  # <run>/logs/remote.json
UPLOADS_LOG = "uploads.log"  # <run>/logs/<launch>/uploads.log: what the uploader and the storage clients said
BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # seconds between retries of a failed upload step
UPLOAD_RETRY_SECONDS = 10  # how long one request of an upload retries before the thread's backoff takes over
UPLOAD_NICE = 10  # the upload thread's priority below the launcher's (and so the ranks')


def status_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOGS / STATUS


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads(status_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


class Uploader:
    """Copies published checkpoints of `run_dir` to `remote` from a background thread (see the module doc)."""

    def __init__(self, run_dir: Path, remote: RemoteRun, *, keep_last: int | None, protect: str | None = None,
                 record: dict | None = None, echo: Callable[[str], None] = print, poll_seconds: float = 0.5,
                 commits: bool = True):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.remote = remote
        self.keep_last = keep_last
        self.protect = protect  # the checkpoint this launch resumed from: never deleted remotely by this launch
        self.record = record or {}
        self.echo = echo
        self.poll_seconds = poll_seconds
        self.commits = commits  # machine 0 commits whole checkpoints; a split one, the machine of its records
        self._handled: set[str] = set()  # another machine's: checkpoints whose part it sent (or had none to send)
        self.backoff = BACKOFF
        self.uploading: str | None = None
        self.committed: list[str] = []
        self.error: str | None = None
        self.done_bytes = self.total_bytes = 0
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="opentau-uploader", daemon=True)
        self._failures = 0
        self.rollback_to: str | None = None  # a rolled-back launch's resume point: newer remote checkpoints go aside
        self._compared: dict[str, dict] = {}  # name -> its files, when the remote's manifest of that name matches
        self._stored: dict[str, dict[str, str]] = {}  # name -> {file: checksum} its failed attempts stored
        self.stopped: str | None = None  # why this launch writes nothing more to the store (see the module doc)
        self.loud: Callable[[str], None] | None = None  # the console too, while the end of the launch waits
        self._status_written = 0.0

    # The launcher's side.

    def start(self) -> "Uploader":
        shutil.rmtree(self.run_dir / UPLOADING, ignore_errors=True)  # a killed launcher's staging
        self._thread.start()
        return self

    def drain(self, seconds: float) -> list[str]:
        """Wait up to `seconds` for the newest published checkpoint to be committed; stop the thread. Returns the
        published checkpoints newer than the newest remote one (local only), oldest first."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.stopped is None and self.pending() is not None:
            self._idle.clear()
            self._idle.wait(min(0.5, max(deadline - time.monotonic(), 0.01)))
        self._stop.set()
        # An upload in flight stops at its next batch; one that does not in a second has its transfers cancelled (the
        # client's pool would keep the process alive sending them) and is left to die with the process (a daemon
        # thread): what it stored is uncommitted, ignored by readers, removed by the next commit.
        self._thread.join(timeout=1)
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.remote.storage.cancel()
        if not self.commits:  # another machine: whether its part of the newest checkpoint went
            pending = self.pending()
            return [pending] if pending else []
        newest = max((step_of(n) for n in self.committed), default=-1)
        local_only = [p.name for p in self._published() if step_of(p.name) > newest]
        self._write_status()
        return local_only

    # The thread.

    def remote_last(self) -> str | None:
        return max(self.committed, key=step_of, default=None)

    def _loop(self) -> None:
        # Below the ranks' priority, as the asynchronous save's writer (train/async_save.py): on a machine whose
        # cores are all busy training, the upload takes what they leave. Linux sets it per thread, and the client's
        # own transfer threads, started from this one, inherit it.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOAD_NICE)
        while not self._stop.is_set():
            try:
                self.committed = self.remote.committed()
                if self.rollback_to is not None:
                    self._roll_back(self.rollback_to)
                break
            except Fenced as e:
                return self.give_up(str(e))
            except Exception as e:  # noqa: BLE001 - any client error: the store is not there yet; retried
                self._failed(e)
        while not self._stop.is_set():
            name = self.pending()
            if name is None:
                self._idle.set()
                self._stop.wait(self.poll_seconds)
                continue
            try:
                if self._upload(name):
                    self._failures = 0
                    self.error = None
            except Fenced as e:
                return self.give_up(str(e))
            except Exception as e:  # noqa: BLE001 - retried with backoff: the store may come back
                if self._stop.is_set():  # cancelled by the drain: the launch is ending, nothing to retry or say
                    break
                self._failed(e)
            finally:
                self.uploading = None
                self._write_status()

    def give_up(self, why: str) -> None:
        """Write nothing more to the store (the lease is lost, or the run went on elsewhere): say so (uploads.log, the
        status file the progress line shows) once."""
        if self.stopped is not None:
            return
        self.stopped = why
        self.uploading = None
        self._write_status()
        self.echo(why)

    def _roll_back(self, to: str) -> None:
        """Set the remote's checkpoints newer than `to` aside (rolled_back/<time>/), as the launch did locally."""
        from opentau_cli.store.remote_run import stamp

        newer = [n for n in self.committed if step_of(n) > step_of(to)]
        if newer:
            self.remote.set_aside(newer, stamp())
            if to in self.committed:
                self.remote.set_pointer(LAST, to)
            self.committed = self.remote.committed()
        self.rollback_to = None

    def pending(self) -> str | None:
        """The checkpoint to upload next: `last`, when the remote lacks it. A remote checkpoint of the same name but
        other content (a rollback's older branch, a save that replaced a stale one) does not count."""
        name = read_last(self.root)
        if name is None or not (self.root / name / MANIFEST).is_file():
            return None
        if name in self.committed and self._same_as_remote(name):
            return None
        return None if name in self._handled else name

    def _same_as_remote(self, name: str) -> bool:
        local = (read_manifest(self.root / name) or {}).get("files")
        if self._compared.get(name) != local:
            try:
                self._compared = {name: local} if self.remote.manifest(name).get("files") == local else {}
            except Exception:  # noqa: BLE001 - unreadable now: decided when the store answers
                return True
        return name in self._compared

    def _published(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if step_of(p.name) is not None and (p / MANIFEST).is_file()),
                      key=lambda p: step_of(p.name))

    def _upload(self, name: str) -> bool:
        """Upload and commit `name`; False when stopped before its commit."""
        staged = self._stage(name)
        if staged is None:
            return True  # deleted locally before its upload began (a newer one is published): nothing to send
        try:
            manifest = read_manifest(staged)
            # A machine that keeps its own run directory holds its ranks' part of the checkpoint; where every file is
            # here (one machine, or an output_dir the machines share) machine 0 sends them all.
            files = {rel: staged / rel for rel in manifest["files"] if (staged / rel).is_file()}
            whole = len(files) == len(manifest["files"])
            # Whole here (one machine, or an output_dir the machines share): machine 0 commits. Split over machines:
            # the machine whose part holds the records (rank 0's: training_state.json, the metrics beside them).
            commits = self.commits if whole else TRAINING_STATE in files
            if not commits and whole:
                self._handled.add(name)
                return True
            self.uploading, self.done_bytes = name, 0
            self.total_bytes = sum(manifest["files"][rel]["size"] for rel in files)
            self._write_status()
            if commits and not self.committed:
                self.remote.claim(self.record)
            if name in self.committed:  # committed with other content (pending): never written over
                raise Fenced(f"{self.remote.url} holds another checkpoint {name} (the run went on elsewhere): this "
                             f"launch changes nothing in the store; its checkpoints stay local.")

            checked, sending = [0], [0]  # bytes stored and checked; bytes sent so far (the client's count)

            def sent(n: int) -> None:
                checked[0] += n
                shown(0)

            def shown(n: int) -> None:  # the progress line's percentage, as the bytes go
                sending[0] += n
                self.done_bytes = min(self.total_bytes, max(checked[0], sending[0]))
                if time.monotonic() - self._status_written > 0.5:
                    self._write_status()

            done = self._stored.setdefault(name, {})  # what earlier attempts stored and checked
            if not self.remote.upload(name, files, manifest, cancelled=self._stop.is_set, progress=sent, done=done,
                                      sending=shown):
                return False
            if not commits:  # the records' machine commits once every machine's part is in the store
                self._handled.add(name)
                self._stored.pop(name, None)
                self.echo(f"This machine's part of checkpoint {name} is stored in {self.remote.url}.")
                return True
            if not whole and not self._others_stored(name, manifest, set(files)):
                return False
            best = read_last(self.root, BEST)
            self.remote.commit(name, staged / MANIFEST, history_files(self.run_dir),
                               best=best if best is not None and best in set(self.committed) | {name} else None)
            self.committed = sorted(set(self.committed) | {name}, key=step_of)
            self._stored.pop(name, None)
            self.uploading = None
            self._write_status()
            self.echo(f"Checkpoint {name} is stored in {self.remote.url}.")
            try:
                self._retain(name)
            except Exception as e:  # noqa: BLE001 - the commit stands; what retention leaves goes at the next one
                self.echo(f"Remote retention after {name} did not finish ({type(e).__name__}); the next commit retries it.")
            return True
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def _others_stored(self, name: str, manifest: dict, here: set[str]) -> bool:
        """Wait until the other machines' parts of `name` are in the store (every file at its manifest size; the
        store checked each one's checksum as it was sent). False when a newer checkpoint is published meanwhile (the
        other parts may never come: a machine was lost) or the launch ends."""
        others = {rel: e["size"] for rel, e in manifest["files"].items() if rel not in here}
        while not self._stop.is_set():
            stored = self.remote.storage.sizes(f"{CHECKPOINTS}/{name}")
            if all(stored.get(f"{CHECKPOINTS}/{name}/{rel}") == size for rel, size in others.items()):
                return True
            if read_last(self.root) != name:
                return False
            self._stop.wait(1.0)
        return False

    def _stage(self, name: str) -> Path | None:
        """Hard links to the checkpoint's files (copies where links are not possible), so that local retention may
        delete it while it uploads; None when it is gone already."""
        src = self.root / name
        staged = self.run_dir / UPLOADING / name
        shutil.rmtree(staged, ignore_errors=True)
        try:
            for path in sorted(src.rglob("*")):
                if path.is_file():
                    target = staged / path.relative_to(src)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        os.link(path, target)
                    except OSError:
                        shutil.copyfile(path, target)
        except FileNotFoundError:
            shutil.rmtree(staged, ignore_errors=True)
            return None
        return staged if (staged / MANIFEST).is_file() else None

    def _retain(self, newest: str) -> None:
        """Remote retention as local (checkpoint.keep_last newest, checkpoints/best), never `last`, this launch's
        source, or a checkpoint still uploading; then what interrupted uploads left."""
        if self.keep_last:
            keep = set(self.committed[-self.keep_last:]) | {newest}
            if self.protect:
                keep.add(self.protect)
            self.remote.retain(keep)
        self.remote.remove_partial(busy={newest})
        self.committed = self.remote.committed()

    def _failed(self, e: Exception) -> None:
        wait = self.backoff[min(self._failures, len(self.backoff) - 1)]
        self._failures += 1
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        self.error = f"{type(e).__name__}: {text[:200]}"
        self._write_status()
        line = (f"Upload to {self.remote.url} failed ({self.error}); retrying in {wait:g} s "
                f"(attempt {self._failures}).")
        if self._failures in (1, 4) or self._failures % 10 == 0:
            self.echo(line + " Training goes on.")
        if self.loud is not None:  # the end of the launch waits on it: every retry is said
            self.loud(line)
        self._stop.wait(wait)

    def _write_status(self) -> None:
        self._status_written = time.monotonic()
        newest_remote = self.remote_last()
        states = {}
        for path in self._published():
            name = path.name
            states[name] = ("remote" if name in self.committed else "uploading" if name == self.uploading else "local")
        status = {"url": self.remote.url, "checkpoints": states, "remote_last": newest_remote,
                  "uploading": ({"name": self.uploading, "bytes": self.done_bytes, "total": self.total_bytes}
                                if self.uploading else None),
                  "error": self.error, "stopped": self.stopped, "time": time.time()}
        try:
            (self.run_dir / LOGS).mkdir(parents=True, exist_ok=True)
            write_json_atomic(status_path(self.run_dir), status)
        except OSError:
            pass  # the status is advisory; the upload itself goes on


class StatusView:
    """What rank 0's progress line shows of the launcher's uploads: a short state ("remote 000004", "uploading
    000006 45%") and one line for each checkpoint newly stored and each new failure, read from the status file."""

    def __init__(self, run_dir: Path):
        self.path = status_path(run_dir)
        self._mtime = None
        self._status: dict = {}
        self._said_last = (read_status(run_dir) or {}).get("remote_last")
        self._said_error = None
        self._said_stopped = None

    def poll(self) -> tuple[str, list[str]]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return "", []
        news = []
        if mtime != self._mtime:
            self._mtime = mtime
            self._status = read_status(self.path.parent.parent) or {}
            last, error = self._status.get("remote_last"), self._status.get("error")
            if last and last != self._said_last:
                news.append(f"Checkpoint {last} is stored in {self._status.get('url')}.")
                self._said_last = last
            if error and error != self._said_error:
                news.append(f"Upload to {self._status.get('url')} failed ({error}); retrying. Training goes on.")
            self._said_error = error
            stopped = self._status.get("stopped")
            if stopped and stopped != self._said_stopped:
                news.append(stopped)
                self._said_stopped = stopped
        return self.short(), news

    def short(self) -> str:
        s = self._status
        if s.get("stopped"):
            return "uploads stopped"
        if s.get("error"):  # until an attempt succeeds, even while the next one is under way
            return f"upload retrying ({s['uploading']['name']})" if s.get("uploading") else "upload retrying"
        if s.get("uploading"):
            up = s["uploading"]
            pct = f" {100 * up['bytes'] / up['total']:.0f}%" if up.get("total") else ""
            return f"uploading {up['name']}{pct}"
        return f"remote {s['remote_last']}" if s.get("remote_last") else ""


def push(run_dir: Path, checkpoint: dict | None = None, *, break_lock: bool = False,
         echo: Callable[[str], None] = print, say_up_to_date: bool = True) -> list[str]:
    """`opentau checkpoint push RUN` (and a resume with nothing left to train): upload and commit, oldest first, the
    run's published checkpoints newer than the store's newest committed one, holding the store's lease and the run
    directory's lock as a launch does. `checkpoint`: the run's checkpoint settings (default: those its `last`
    checkpoint was trained with). `say_up_to_date`: say so when every checkpoint is in the store already (off for a
    second push in one command). Returns the names committed."""
    from opentau_cli.errors import RunError, UserError
    from opentau_cli.process import lease as remote_lease
    from opentau_cli.process import runlock
    from opentau_cli.store.remote import RemoteError
    from opentau_cli.store.storage import open_storage

    run_dir = Path(run_dir)
    if checkpoint is None:
        last = read_last(run_dir / CHECKPOINTS)
        try:
            saved = json.loads((run_dir / CHECKPOINTS / str(last) / "train_config.json").read_text())
        except (OSError, ValueError):
            saved = {}
        checkpoint = saved.get("checkpoint") or {}
    url = checkpoint.get("remote") or (read_status(run_dir) or {}).get("url")
    if not url:
        raise UserError(f"{run_dir} has no checkpoint.remote: nothing to push.")
    options = {**(checkpoint.get("remote_options") or {}), "retry_seconds": UPLOAD_RETRY_SECONDS}
    seconds = float(checkpoint.get("remote_lease_seconds") or remote_lease.DEFAULT_SECONDS)
    try:
        storage = open_storage(url, options)
        with runlock.held(run_dir, break_lock=break_lock):
            held = remote_lease.acquire(storage, remote_lease.identity(run_dir.absolute(), seconds),
                                        break_lock=break_lock, echo=echo)
            with held.heartbeat(on_lost=echo):
                remote = RemoteRun(storage, fence=held.check)
                up = Uploader(run_dir, remote, keep_last=checkpoint.get("keep_last"), echo=echo,
                              record={"run_dir": str(run_dir.absolute())})
                up.committed = remote.committed()
                newest = max((step_of(n) for n in up.committed), default=-1)
                todo = [p.name for p in up._published() if step_of(p.name) > newest]
                if not todo and say_up_to_date:
                    echo(f"Every checkpoint of {run_dir} is in {remote.url} already"
                         + (f" (newest: {up.remote_last()})." if up.committed else "."))
                if not todo and up.committed:  # what the run recorded since its last commit (evaluations) goes up still
                    remote.store_history(history_files(run_dir))
                for name in todo:
                    echo(f"Uploading checkpoint {name} to {remote.url} ...")
                    up._upload(name)
                return todo
    except RemoteError as e:
        raise RunError(f"{e} Nothing more was pushed; run `opentau checkpoint push {run_dir}` again once the store "
                       f"answers.") from None
