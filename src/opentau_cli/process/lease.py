"""One writer per store prefix: the lease a launch takes on its `checkpoint.remote` before it starts
(docs/ARCHITECTURE.md, "Remote checkpoints").

`<remote>/lease.json` names the launch that may change the store's committed state: its run directory, a launch id,
host, pid, a generation (one more at each new holder) and its heartbeat time. It is created with a conditional write
that fails where one exists (`If-None-Match: *` on S3) and renewed, replaced or released only with one that fails
unless it is still the version this launch last wrote (`If-Match: <ETag>`), so two launches never both hold it. A
lease is free when released, when no heartbeat came for its `seconds` (the store's own clock: its Date against the
object's Last-Modified), when its holder was on this host and is gone, or when `--break-lock` takes it from a run on
another host. A lease whose holder missed two heartbeats is waited out rather than refused (a requeued job after its
node was lost). Machine 0 of a run holds it; the other machines commit nothing.

Fencing: `Lease.check` renews the lease with that same conditional write, so it succeeds only while nobody took the
lease over; every write of committed state (store/remote_run.py `RemoteRun.fence`) calls it first. A launch that lost
its lease (paused or cut off past its expiry, broken by another) raises `LeaseLost` from then on: it writes nothing
more to the store.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator

from opentau_cli.errors import UserError
from opentau_cli.process import runlock
from opentau_cli.store.remote_run import Fenced
from opentau_cli.store.storage import Storage

LEASE = "lease.json"  # at the remote's root, beside run.json
DEFAULT_SECONDS = 120.0  # checkpoint.remote_lease_seconds' default
RENEWALS = 4  # heartbeats per lease period: three may fail (the store away for a moment) before it can expire


class LeaseLost(Fenced):
    """This launch no longer holds the store's lease: it must write nothing more there."""


def identity(run_dir: str, seconds: float) -> dict:
    """What a launch's lease says of it."""
    return {**runlock.identity(), "run_dir": str(run_dir), "launch": uuid.uuid4().hex[:12], "seconds": float(seconds)}


def read_holder(storage: Storage) -> tuple[dict, str, float] | None:
    """The lease as stored (its record, version and age in seconds), or None where there is none."""
    found = storage.read_version(LEASE)
    if found is None:
        return None
    data, version, age = found
    try:
        record = json.loads(data)
    except ValueError:
        record = None
    return (record if isinstance(record, dict) else {}), version, age


def describe(holder: dict, age: float | None = None) -> str:
    ago = f" ({age:.0f} s ago)" if age is not None else ""
    return (f"run {holder.get('run_dir', '?')} (launch {holder.get('launch', '?')}, pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}, generation {holder.get('generation', '?')}), last heartbeat "
            f"{holder.get('heartbeat', '?')}{ago}")


def _state(holder: dict, age: float, break_lock: bool) -> str:
    """"free", "held", or "stale": its holder missed two heartbeats or more (a node lost without a word, most
    likely), so a new writer waits for the lease to expire rather than failing a requeued job."""
    seconds = float(holder.get("seconds", DEFAULT_SECONDS)) if holder else 0.0
    if not holder or holder.get("released") or age >= seconds:
        return "free"
    here = holder.get("host") == socket.gethostname()
    alive_here = here and runlock.holder_alive(holder, 0.0)
    if (here and not alive_here) or (break_lock and not alive_here):
        return "free"
    return "stale" if not here and age >= 2 * seconds / RENEWALS else "held"


def _encode(record: dict) -> bytes:
    return (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()


def _stamped(record: dict) -> dict:
    return {**record, "heartbeat": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "released": False}


class Lease:
    """This launch's hold on a store prefix (see the module doc)."""

    def __init__(self, storage: Storage, record: dict, version: str):
        self.storage, self.record, self.version = storage, record, version
        self.lost: str | None = None  # why this launch no longer holds it, once it does not
        self.on_lost: Callable[[str], None] = lambda why: None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.storage.url

    def check(self) -> None:
        """Fencing (see the module doc): renew the lease if it is still this launch's, else LeaseLost. A store that
        does not answer raises its own error: nothing is written, the caller retries."""
        with self._lock:
            if self.lost is not None:
                raise LeaseLost(self.lost)
            record = _stamped(self.record)
            version = self.storage.write_if(LEASE, _encode(record), self.version)
            if version is None:
                found = read_holder(self.storage)
                holder = describe(found[0], found[2]) if found else "nobody (it was removed)"
                self.lost = (f"This launch lost its lease on {self.url} (now held by {holder}): it changes nothing "
                             f"in the store from now on; its checkpoints stay local.")
                raise LeaseLost(self.lost)
            self.record, self.version = record, version

    renew = check

    def release(self) -> None:
        """Mark the lease free (a conditional write: a lease taken over since is left alone); never raises."""
        with self._lock:
            if self.lost is not None:
                return
            try:
                self.storage.write_if(LEASE, _encode({**_stamped(self.record), "released": True}), self.version)
            except Exception:  # noqa: BLE001 - the store away: the lease expires by itself
                pass
            self.lost = "released"

    @contextmanager
    def heartbeat(self, on_lost: Callable[[str], None]) -> Iterator["Lease"]:
        """Renew every `seconds / RENEWALS` while the block runs; `self.on_lost(message)` once, if it is lost (first
        `on_lost`; the launch hands it to its uploader once that runs); release at the end."""
        self.on_lost = on_lost
        stop = threading.Event()
        period = float(self.record.get("seconds", DEFAULT_SECONDS)) / RENEWALS

        def beat() -> None:
            while not stop.wait(period):
                try:
                    self.check()
                except LeaseLost as e:
                    self.on_lost(str(e))
                    return
                except Exception:  # noqa: BLE001 - the store away for now: the next beat tries again
                    continue

        thread = threading.Thread(target=beat, name="opentau-lease", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            self.release()


def _refusal(storage: Storage, holder: dict, age: float) -> UserError:
    seconds = float(holder.get("seconds", DEFAULT_SECONDS))
    return UserError(f"{storage.url} is being written by {describe(holder, age)}: wait for it to finish or stop it, or "
                     f"if it is dead wait until its lease expires ({seconds:g} s after its last heartbeat) or pass "
                     f"--break-lock.")


def check_free(storage: Storage, *, break_lock: bool = False) -> None:
    """The UserError `acquire` would raise now, taking nothing: for the plan, before anything is downloaded or
    written (the launch's `acquire` is the atomic step)."""
    found = read_holder(storage)
    if found is not None and _state(found[0], found[2], break_lock) == "held":
        raise _refusal(storage, found[0], found[2])


def acquire(storage: Storage, me: dict, *, break_lock: bool = False, echo: Callable[[str], None] = print) -> Lease:
    """Take the lease of `storage` for the launch `me` (`identity`); UserError naming the holder while another
    launch holds it. A stale lease (see `_state`) is waited out, saying so with `echo`."""
    for _ in range(4):  # another launch may win a race for a free lease: then it is that one's
        found = read_holder(storage)
        if found is None:
            record = _stamped({**me, "generation": 1})
            version = storage.write_new(LEASE, _encode(record))
        else:
            holder, current, age = found
            state = _state(holder, age, break_lock)
            if state == "held":
                raise _refusal(storage, holder, age)
            if state == "stale":
                left = float(holder.get("seconds", DEFAULT_SECONDS)) - age + 1.0
                echo(f"{storage.url} is held by {describe(holder, age)}, which missed its heartbeats: waiting "
                     f"{left:.0f} s for its lease to expire.")
                time.sleep(left)
                continue
            record = _stamped({**me, "generation": int(holder.get("generation", 0) or 0) + 1})
            version = storage.write_if(LEASE, _encode(record), current)
        if version is not None:
            return Lease(storage, record, version)
    raise UserError(f"{storage.url} is being taken by another launch at this moment; try again.")
