"""One run at a time in a run directory: a lock file that works on the shared filesystems clusters use.

`<run>/logs/run.lock` is created with O_CREAT | O_EXCL (atomic on local filesystems and NFSv3+), holds the host, pid
and start time of the launcher that holds it, and is refreshed (its mtime) every HEARTBEAT_S while that run lives.
A lock is stale, and is taken over, when its holder is dead: on the same host, its process is gone (or the pid now
belongs to a younger process); from another host, its heartbeat stopped for STALE_S (a SIGKILLed job, a lost
node). `--break-lock` takes over another host's lock at once. Only machine 0 of a multi-machine run takes it.

Every rank of the run also registers itself (`logs/run.lock.ranks/<host>-<pid>.json`): on the lock's host, the run
counts as live while its launcher or any registered rank lives, so a lock is never taken over from ranks that outlived
their launcher for a moment (they die with it: runtime.die_with_parent).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from opentau_cli.errors import UserError
from opentau_cli.store.layout import LOGS, RUN_LOCK

HEARTBEAT_S = 30.0
STALE_S = 300.0  # ten missed heartbeats: generous for clock skew between hosts and slow shared filesystems


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOGS / RUN_LOCK


def identity() -> dict:
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": psutil.Process().create_time(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def holder_alive(holder: dict, mtime: float, *, now: float | None = None) -> bool:
    """Whether the run that wrote `holder` (a lock's content, last refreshed at `mtime`) still lives."""
    if holder.get("host") == socket.gethostname():
        import psutil

        try:
            proc = psutil.Process(int(holder.get("pid", -1)))
            # A pid reused by a younger process is not the holder.
            return abs(proc.create_time() - float(holder.get("pid_started", 0))) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, ValueError, TypeError):
            return False
    return (now if now is not None else time.time()) - mtime < STALE_S


def ranks_dir(run_dir: Path) -> Path:
    return Path(run_dir) / LOGS / (RUN_LOCK + ".ranks")


def register_rank(run_dir: Path) -> None:
    """Record this rank process as part of the live run (see the module doc)."""
    me = identity()
    folder = ranks_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{me['host']}-{me['pid']}.tmp"
    tmp.write_text(json.dumps(me))
    os.replace(tmp, folder / f"{me['host']}-{me['pid']}.json")


def live_rank(run_dir: Path) -> dict | None:
    """A registered rank of the run that still lives on this host, or None."""
    for path in sorted(ranks_dir(run_dir).glob("*.json")) if ranks_dir(run_dir).is_dir() else ():
        rank = _read(path)
        if rank and rank.get("host") == socket.gethostname() and holder_alive(rank, 0.0):
            return rank
    return None


def forget_dead_ranks(run_dir: Path) -> None:
    """Drop the registrations of this host's ranks that are gone, and their folder once empty (a launch that ended
    leaves none; one that was killed, its own until the next launch)."""
    folder = ranks_dir(run_dir)
    for path in folder.glob("*.json") if folder.is_dir() else ():
        rank = _read(path)
        if rank is None or (rank.get("host") == socket.gethostname() and not holder_alive(rank, 0.0)):
            path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # absent, or a live rank's registration is still in it
        pass


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def _blocking_holder(path: Path, break_lock: bool) -> dict | None:
    """The content of the lock at `path` when a live run holds it and `break_lock` does not take it over, else None
    (no lock, or a stale one). Raises FileNotFoundError when the lock went away while being read."""
    holder = _read(path)
    mtime = path.stat().st_mtime
    if holder is None:  # being written right now, or torn: judge it by its age alone
        holder = {}
    same_host = holder.get("host") == socket.gethostname()
    if holder_alive(holder, mtime) and not (break_lock and not same_host and holder):
        return holder
    return live_rank(path.parent.parent)


def in_use_error(run_dir: Path, holder: dict) -> UserError:
    hint = ("" if holder.get("host") == socket.gethostname() else
            f"; if that run is dead (its node lost), pass --break-lock, or wait {int(STALE_S)} s after its last heartbeat")
    return UserError(f"Run directory '{run_dir}' is in use by a live run ({_describe(holder)}); wait for it to finish "
                     f"or stop it{hint}.")


def check_free(run_dir: Path, *, break_lock: bool = False) -> None:
    """UserError (the one `acquire` raises) when a live run holds the run directory's lock; takes nothing. For the
    plan: a live run explains what it sees in the directory (e.g. a checkpoint being published) better than any
    other refusal would."""
    path = lock_path(run_dir)
    try:
        holder = _blocking_holder(path, break_lock)
    except FileNotFoundError:  # no lock: still, a rank of a run whose launcher just died may live on for a moment
        holder = live_rank(run_dir)
    except OSError:  # no logs/ to hold one
        return
    if holder is not None:
        raise in_use_error(run_dir, holder)


def acquire(run_dir: Path, *, break_lock: bool = False) -> dict:
    """Take the run directory's lock (creating logs/); UserError when a live run holds it. Returns what was written."""
    path = lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = identity()
    rank = live_rank(run_dir)
    if rank is not None:
        raise in_use_error(run_dir, rank)
    forget_dead_ranks(run_dir)
    for _ in range(3):  # a stale lock removed, then one more try (another launcher may win the race: that is fine)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = _blocking_holder(path, break_lock)
            except FileNotFoundError:
                continue
            if holder is not None:
                raise in_use_error(run_dir, holder)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
            f.flush()
            os.fsync(f.fileno())
        return mine
    raise UserError(f"Run directory '{run_dir}' is being taken by another launch at this moment; try again.")


def release(run_dir: Path, mine: dict) -> None:
    """Remove the lock if it is still ours (a --break-lock from elsewhere may have taken it over)."""
    path = lock_path(run_dir)
    holder = _read(path)
    if holder is not None and all(holder.get(k) == mine[k] for k in ("host", "pid", "pid_started")):
        forget_dead_ranks(run_dir)  # the launch is over: its ranks have exited
        path.unlink(missing_ok=True)


@contextmanager
def held(run_dir: Path, *, break_lock: bool = False) -> Iterator[None]:
    """Hold the run directory's lock, refreshing its heartbeat, for the duration of a launch."""
    mine = acquire(run_dir, break_lock=break_lock)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                os.utime(lock_path(run_dir))
            except OSError:
                pass

    thread = threading.Thread(target=beat, name="opentau-run-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        release(run_dir, mine)
