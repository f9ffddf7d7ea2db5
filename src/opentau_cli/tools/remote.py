"""The offline tools on a run in remote storage (`URL`, `URL:STEP`, `URL:best`): what is committed there, and a
verified local copy of one checkpoint in a cache for consolidate, export, eval, serve and inspect
(docs/ARCHITECTURE.md, "Remote checkpoints").

The cache of a run (`$OPENTAU_CACHE_DIR/remote/<hash of the URL>/`) holds `checkpoints/<name>/` and `verified.json`:
the URL, for each checkpoint the version (ETag) of every object it was verified from, and what the store held when
last seen. A copy whose objects have not changed in the store since is not downloaded again, and while the store
cannot be reached the tools use the copies verified earlier (and say so). Tools record where a cached copy came from
(`remote_origin`: the URL and step), never the cache's path.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from opentau_cli.errors import UserError
from opentau_cli.store.layout import BEST, CHECKPOINTS, LAST, step_of
from opentau_cli.store.remote_run import Damaged, Found, RemoteRun, choose, split_target
from opentau_cli.store.storage import check_storage, open_storage

VERIFIED = "verified.json"  # in a remote run's cache


def open_run(url: str, options: dict | None = None) -> RemoteRun:
    problem = check_storage(url, options)
    if problem:
        raise UserError(problem)
    return RemoteRun(open_storage(url, options))


def cache_run(url: str) -> Path:
    """Where copies of `url`'s checkpoints are kept on this machine (OPENTAU_CACHE_DIR, else ~/.cache/opentau)."""
    root = Path(os.environ.get("OPENTAU_CACHE_DIR") or Path.home() / ".cache" / "opentau")
    return root / "remote" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def read_record(run: Path) -> dict:
    try:
        record = json.loads((run / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(run: Path, record: dict) -> None:
    from opentau_cli.store.manifest import write_json_atomic

    run.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run / VERIFIED, record)


def _seen(run: Path, url: str, found: Found) -> dict:
    """Note what the store holds now (for the tools while it cannot be reached); returns the record."""
    record = read_record(run)
    record.update(url=url, seen={"committed": found.committed, "best": found.best, "time": _now()})
    record.setdefault("checkpoints", {})
    _write_record(run, record)
    return record


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def remote_origin(ckpt: Path) -> dict | None:
    """{"url", "checkpoint", "step", "address"} when `ckpt` is a cached copy of a checkpoint in remote storage (what
    eval, serve, export and the model card record instead of the cache's path); None for any other checkpoint."""
    ckpt = Path(ckpt).resolve()
    run = ckpt.parent.parent
    url = read_record(run).get("url")
    if ckpt.parent.name != CHECKPOINTS or not url or cache_run(url).resolve() != run:
        return None
    return {"url": url, "checkpoint": ckpt.name, "step": step_of(ckpt.name),
            "address": f"{url}/{CHECKPOINTS}/{ckpt.name}"}


def local_checkpoint(text: str, echo: Callable[[str], None] = lambda line: None) -> Path:
    """A verified local copy of the checkpoint `text` (`URL[:STEP|:best]`) names: from the cache when the store
    still holds the very objects it was verified from (nothing downloaded), else downloaded and verified. While the
    store cannot be reached, the copy verified earlier (said on `echo`); UserError when there is none, or when the
    checkpoint is damaged in the store (naming the newest intact one)."""
    url, what = split_target(text)
    problem = check_storage(url)
    if problem:
        return _offline(url, what, problem, echo)
    remote = RemoteRun(open_storage(url))
    run = cache_run(remote.url)
    found = remote.survey()
    _seen(run, remote.url, found)
    try:
        return _copy(remote, choose(remote, what, found), run, echo)
    except Damaged as e:
        raise UserError(e.sentence(resume=False)) from None


def _copy(remote: RemoteRun, name: str, run: Path, echo: Callable[[str], None]) -> Path:
    """Checkpoint `name` in the cache `run`, verified: kept when the store's objects are those it was verified from
    and the copy still hashes to its manifest, else downloaded (every file checked against the manifest)."""
    from opentau_cli.store.manifest import verify_manifest

    objects = {key: info["etag"] for key, info in remote.storage.objects(f"{CHECKPOINTS}/{name}").items()}
    have = run / CHECKPOINTS / name
    unchanged = read_record(run).get("checkpoints", {}).get(name, {}).get("objects") == objects
    if unchanged and have.is_dir() and not verify_manifest(have):
        return have
    size = sum(e["size"] for e in remote.manifest(name)["files"].values())
    echo(f"Downloading checkpoint {name} of {remote.url} ({size / 1e9:.2f} GB) into {run} ...")
    # Only files whose objects are those verified before may be kept: another version is downloaded and checked.
    ckpt = remote.fetch(name, run, history=False, reuse=unchanged)
    record = read_record(run)
    record.setdefault("checkpoints", {})[name] = {"objects": objects, "time": _now()}
    record["url"] = remote.url
    _write_record(run, record)
    return ckpt


def _offline(url: str, what: str | None, problem: str, echo: Callable[[str], None]) -> Path:
    """The copy of `what` verified earlier, while the store at `url` cannot be used (`problem`)."""
    from opentau_cli.store.manifest import verify_manifest

    run = cache_run(url)
    record = read_record(run)
    seen = record.get("seen") or {}
    verified = [n for n in record.get("checkpoints", {}) if (run / CHECKPOINTS / n).is_dir()]
    if what is None:
        name = max((n for n in seen.get("committed", []) if n in verified), key=step_of, default=None)
    elif what == BEST:
        name = seen.get("best") if seen.get("best") in verified else None
    else:
        name = next((n for n in verified if step_of(n) == int(what)), None)
    if name is None or verify_manifest(run / CHECKPOINTS / name):
        raise UserError(f"{problem.rstrip('.')}; and this machine's cache holds no verified copy of "
                        f"{url}{'' if what is None else ':' + what}.")
    when = record["checkpoints"][name]["time"]
    echo(f"{problem.rstrip('.')}: using checkpoint {name} as verified from it on {when}.")
    return run / CHECKPOINTS / name


@dataclass
class RemoteCheckpoint:
    name: str
    step: int
    size: int
    state: str  # committed | damaged | partial
    marks: list[str]
    problem: str | None = None  # what is wrong with a damaged one

    @property
    def committed(self) -> bool:
        return self.state == "committed"

    def to_dict(self) -> dict:
        return {"name": self.name, "step": self.step, "size": self.size, "committed": self.committed,
                "state": self.state, "marks": self.marks, "problem": self.problem}


def list_remote(url: str) -> tuple[list[RemoteCheckpoint], Found]:
    """Every checkpoint folder at `url` (committed: its manifest and every file at its size; damaged; uploads that
    never committed), with what the store says of `last` and `best`."""
    remote = open_run(url)
    found = remote.survey()
    sizes = remote.storage.sizes(CHECKPOINTS)
    out = []
    for name in [*found.with_manifest(), *found.partial]:
        size = sum(n for key, n in sizes.items() if key.startswith(f"{CHECKPOINTS}/{name}/"))
        marks = [m for m, n in ((LAST, found.last), (BEST, found.best)) if n == name]
        state = "committed" if name in found.committed else "damaged" if name in found.damaged else "partial"
        problem = " ".join(found.damaged[name]) if name in found.damaged else None
        out.append(RemoteCheckpoint(name, step_of(name), size, state, marks, problem))
    return sorted(out, key=lambda c: c.step), found


def verify_remote(url: str, echo: Callable[[str], None] = lambda line: None):
    """Every committed checkpoint at `url` verified into the cache (each file checked against its manifest as it
    lands; a copy verified from the same objects before is re-hashed, not downloaded again); damaged checkpoints,
    uploads that never committed and a broken `last` are problems. While the store cannot be reached, the copies
    verified from it earlier are re-hashed (and the report says so)."""
    from opentau_cli.store.manifest import verify_manifest
    from opentau_cli.tools.info import VerifyReport

    report = VerifyReport()
    problem = check_storage(url)
    if problem:
        return _verify_offline(url, problem, report)
    remote = RemoteRun(open_storage(url))
    run = cache_run(remote.url)
    found = remote.survey()
    _seen(run, remote.url, found)
    where = f"{remote.url}/{CHECKPOINTS}"
    for name in found.committed:
        try:
            report.checkpoints[f"{where}/{name}"] = [str(p) for p in verify_manifest(_copy(remote, name, run, echo))]
        except Damaged as e:
            report.checkpoints[f"{where}/{name}"] = [f"{e.rel} {e.what}"]
    for name, (rel, what) in found.damaged.items():
        report.checkpoints[f"{where}/{name}"] = [f"{rel} {what}"]
    for name in found.partial:
        report.checkpoints[f"{where}/{name}"] = ["no manifest: an upload under way, interrupted, or whose manifest was "
                                                 "deleted (readers ignore it; the next commit removes it)"]
    if found.last_problem:
        report.problems.append(f"{remote.url}: {found.last_problem} (`opentau resume {remote.url}` repairs it).")
    if not found.with_manifest():
        report.problems.append(f"{remote.url} holds no committed checkpoint.")
    return report


def _verify_offline(url: str, problem: str, report):
    from opentau_cli.store.manifest import verify_manifest

    run = cache_run(url)
    record = read_record(run)
    names = [n for n in (record.get("seen") or {}).get("committed", []) if n in record.get("checkpoints", {})]
    if not names:
        report.problems.append(f"{problem.rstrip('.')}; and this machine's cache holds no verified copy of {url}.")
        return report
    for name in names:
        problems = verify_manifest(run / CHECKPOINTS / name)
        report.checkpoints[f"{url.rstrip('/')}/{CHECKPOINTS}/{name}"] = [str(p) for p in problems]
    missing = [n for n in record["seen"]["committed"] if n not in names]
    report.notes.append(f"{problem.rstrip('.')}: re-hashed the copies in this machine's cache, verified from the store "
                        f"on {', '.join(sorted({record['checkpoints'][n]['time'] for n in names}))}; the store then "
                        f"held {', '.join(record['seen']['committed'])}"
                        + (f" ({', '.join(missing)} never verified here)." if missing else "."))
    return report
