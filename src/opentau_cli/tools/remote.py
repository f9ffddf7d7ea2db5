"""The offline tools on a run in remote storage (`URL`, `URL:STEP`, `URL:best`): what is committed there, and a
verified local copy of one checkpoint in a cache for consolidate, export, eval, serve and inspect
(docs/ARCHITECTURE.md, "Remote checkpoints")."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from opentau_cli.errors import UserError
from opentau_cli.store.layout import BEST, CHECKPOINTS, LAST, step_of
from opentau_cli.store.remote_run import RemoteRun, choose, split_target
from opentau_cli.store.storage import check_storage, open_storage


def open_run(url: str, options: dict | None = None) -> RemoteRun:
    problem = check_storage(url, options)
    if problem:
        raise UserError(problem)
    return RemoteRun(open_storage(url, options))


def cache_run(url: str) -> Path:
    """Where copies of `url`'s checkpoints are kept on this machine (OPENTAU_CACHE_DIR, else ~/.cache/opentau)."""
    root = Path(os.environ.get("OPENTAU_CACHE_DIR") or Path.home() / ".cache" / "opentau")
    return root / "remote" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def local_checkpoint(text: str, echo: Callable[[str], None] = lambda line: None, *, fresh: bool = False) -> Path:
    """A verified local copy of the checkpoint `text` (`URL[:STEP|:best]`) names, from the cache when it holds it
    (`fresh`: every file downloaded again)."""
    url, what = split_target(text)
    remote = open_run(url)
    name = choose(remote, what)
    run = cache_run(remote.url)
    have = run / CHECKPOINTS / name
    from opentau_cli.store.manifest import verify_manifest

    if not fresh and have.is_dir() and not verify_manifest(have):
        return have
    size = sum(e["size"] for e in remote.manifest(name)["files"].values())
    echo(f"Downloading checkpoint {name} of {remote.url} ({size / 1e9:.2f} GB) into {run} ...")
    return remote.fetch(name, run, history=False, reuse=not fresh)


@dataclass
class RemoteCheckpoint:
    name: str
    step: int
    size: int
    committed: bool
    marks: list[str]

    def to_dict(self) -> dict:
        return {"name": self.name, "step": self.step, "size": self.size, "committed": self.committed, "marks": self.marks}


def list_remote(url: str) -> list[RemoteCheckpoint]:
    """Every checkpoint folder at `url`: committed ones with their size, and uploads that never committed."""
    remote = open_run(url)
    last, best = remote.last(), remote.best()
    out = []
    for name in remote.committed():
        size = sum(e["size"] for e in remote.manifest(name)["files"].values())
        marks = [m for m, n in ((LAST, last), (BEST, best)) if n == name]
        out.append(RemoteCheckpoint(name, step_of(name), size, True, marks))
    for name in remote.partial():
        size = sum(remote.storage.size(k) or 0 for k in remote.storage.list(f"{CHECKPOINTS}/{name}"))
        out.append(RemoteCheckpoint(name, step_of(name), size, False, []))
    return sorted(out, key=lambda c: c.step)


def verify_remote(url: str, echo: Callable[[str], None] = lambda line: None):
    """Every committed checkpoint at `url`, downloaded into the cache (each file checked as it lands) and re-hashed
    against its manifest; uploads that never committed are noted."""
    from opentau_cli.errors import RunError
    from opentau_cli.store.manifest import verify_manifest
    from opentau_cli.tools.info import VerifyReport

    remote = open_run(url)
    report = VerifyReport()
    for name in remote.committed():
        try:
            ckpt = local_checkpoint(f"{remote.url}:{step_of(name)}", echo, fresh=True)
            report.checkpoints[f"{remote.url}/{CHECKPOINTS}/{name}"] = [str(p) for p in verify_manifest(ckpt)]
        except RunError as e:
            report.checkpoints[f"{remote.url}/{CHECKPOINTS}/{name}"] = [str(e)]
    for name in remote.partial():
        report.notes.append(f"{remote.url}/{CHECKPOINTS}/{name}: an upload that never committed (ignored by readers).")
    if not report.checkpoints:
        report.problems.append(f"{remote.url} holds no committed checkpoint.")
    return report
