"""checkpoint.remote before a launch: whether the store is there and holds this run (or nothing), and, for
`opentau resume URL`, the local copy of the run a launch continues from (docs/ARCHITECTURE.md, "Remote checkpoints")."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable

from opentau_cli.config.rules import secret_options
from opentau_cli.errors import UserError
from opentau_cli.process import lease
from opentau_cli.process.uploader import read_status, status_path
from opentau_cli.store.layout import CHECKPOINTS, step_of
from opentau_cli.store.manifest import is_complete, read_manifest, write_json_atomic
from opentau_cli.store.outputs import make_parents, remove_leftovers, remove_made
from opentau_cli.store.remote_run import RemoteRun, choose, split_target
from opentau_cli.store.runs import latest
from opentau_cli.store.storage import check_storage, is_url, open_storage  # noqa: F401 (is_url: the CLI's)


def check_remote(cfg) -> list[str]:
    """The store answers (bucket, credentials, endpoint), and holds nothing or this run: a fresh run never writes
    into another run's remote, as it never writes into another run's directory."""
    url, options = cfg.checkpoint.remote, cfg.checkpoint.remote_options
    if not url or secret_options(options):  # a credential among the options: said by the config rules, once
        return []
    problem = check_storage(url, options)
    if problem:
        return [problem]
    remote = RemoteRun(open_storage(url, options))
    if not remote.committed():  # empty, or what interrupted uploads left: nobody trusts it, the first commit removes it
        return []
    bound = (read_status(Path(cfg.output_dir)) or {}).get("url") == remote.url
    if cfg.resume and bound:
        return []
    holder = (remote.run_record() or {}).get("run_dir", "another run")
    return [f"checkpoint.remote {url} already holds a run (from {holder}): pick another prefix, or continue that run "
            f"with `opentau resume {url}`."]


def check_writer(url: str | None, options: dict, break_lock: bool = False) -> None:
    """Another launch holds the store's lease (process/lease.py): refused by the plan, before anything is written or
    printed, in the words the launch's own `acquire` would use (that is the atomic step)."""
    if url and check_storage(url, options) is None:
        lease.check_free(open_storage(url, options), break_lock=break_lock)


def remote_last(url: str, options: dict) -> tuple[str, dict] | None:
    """The remote's newest committed checkpoint (found from the manifests: `last` is only a hint) and its
    train_config.json, or None when nothing is committed there (an empty store, or uploads that never finished);
    UserError when the store does not answer."""
    from opentau_cli.store.layout import TRAIN_CONFIG

    problem = check_storage(url, options)
    if problem:
        raise UserError(problem)
    remote = RemoteRun(open_storage(url, options))
    name = remote.newest_committed()
    if name is None:
        return None
    try:
        return name, remote.read_json(name, TRAIN_CONFIG)
    except (FileNotFoundError, ValueError):
        raise UserError(f"{url}: checkpoint {name} has no readable {TRAIN_CONFIG}.") from None


def local_copy(target: str, output_dir: str | None, options: dict, echo: Callable[[str], None], *,
               rollback: bool = False) -> Path:
    """The local checkpoint `opentau resume URL[:STEP]` continues: the remote's newest committed checkpoint (or STEP;
    found from the manifests, `last` being only a hint), fetched (every file verified against its manifest) into the
    run's directory (`output_dir`, else where the run lived) unless a complete copy of it or of a newer checkpoint of
    the same run is there already. A damaged checkpoint is refused (Damaged) before anything is created here: a new
    run directory is assembled beside its place and renamed into it only once every file is verified."""
    url, what = split_target(target)
    problem = check_storage(url, options)
    if problem:
        raise UserError(problem)
    remote = RemoteRun(open_storage(url, options))
    found = remote.survey()
    if found.newest is None:
        why = "is empty" if remote.is_empty() else "holds no committed checkpoint (an upload that never finished)"
        raise UserError(f"{url} {why}: nothing to resume; start the run with `opentau train ... "
                        f"--checkpoint.remote={url}`.")
    name = choose(remote, what, found)
    newer = [n for n in found.with_manifest() if step_of(n) > step_of(name)]
    if newer and not rollback:  # said before anything is downloaded (the plan says it again for a local target)
        raise UserError(f"{url} holds newer checkpoints than {name} ({', '.join(newer)}): continue from the newest "
                        f"with `opentau resume {url}`, or pass --rollback=true to move them into "
                        f"{url}/rolled_back/<time>/ and continue from step {step_of(name)}.")
    record = remote.run_record() or {}
    run_dir = Path(output_dir or record.get("run_dir") or "")
    if not str(run_dir) or str(run_dir) == ".":
        raise UserError(f"{url} does not say where its run lived: pass --output_dir=DIR for the local copy.")
    bound = (read_status(run_dir) or {}).get("url")
    fresh = not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir()))
    if not fresh and bound != remote.url:
        raise UserError(f"{run_dir} already holds {'a run of ' + bound if bound else 'files of another run'}: pass "
                        f"--output_dir=DIR (a new or empty directory) for the local copy of {url}.")
    have = latest(run_dir) if (run_dir / CHECKPOINTS).is_dir() else None
    if what is None and have is not None and step_of(have.name) >= step_of(name) and is_complete(have):
        echo(f"{run_dir} holds checkpoint {have.name} of this run already: nothing to download.")
        return have
    size = sum(e["size"] for e in remote.manifest(name)["files"].values())
    echo(f"Downloading checkpoint {name} of {url} ({size / 1e9:.2f} GB) into {run_dir} ...")
    started = time.perf_counter()
    if fresh:
        assemble_run(remote, name, run_dir)
    else:
        remote.fetch(name, run_dir)
    echo(f"Downloaded and verified in {time.perf_counter() - started:.1f} s.")
    return run_dir / CHECKPOINTS / name


def assemble_run(remote: RemoteRun, name: str, run_dir: Path) -> None:
    """A new local copy of the run at `remote` holding checkpoint `name`: written into a hidden sibling of `run_dir`
    (`.<name>.tmp-<pid>`, which the next try removes if this process dies) and renamed into place once every file is
    verified, so that a failure leaves nothing here (not even `run_dir`'s parents)."""
    remove_leftovers(run_dir)
    made = make_parents(run_dir.parent)
    staging = run_dir.with_name(f".{run_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        remote.fetch(name, staging)
        bind(staging, remote.url)
        if run_dir.is_dir():
            run_dir.rmdir()  # empty (checked by the caller)
        os.replace(staging, run_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_made(made)
        raise


def bind(run_dir: Path, url: str) -> None:
    """Record that `run_dir` is a copy of the run at `url` (the uploader's status file, which it then keeps)."""
    if (read_status(run_dir) or {}).get("url") == url:
        return
    status_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(status_path(run_dir), {"url": url, "checkpoints": {}, "remote_last": None, "uploading": None,
                                             "error": None, "time": time.time()})


def check_remote_history(cfg, ckpt: Path, rollback: bool) -> list[str]:
    """A resume's checkpoints go after `ckpt`'s step in the remote too: committed ones newer than it (another
    machine continued the run from the remote, or this is a rollback) are refused unless `rollback`, which sets them
    aside (rolled_back/<time>/ in the remote) before the first upload. Returns the note to print."""
    if not cfg.checkpoint.remote:
        return []
    remote = RemoteRun(open_storage(cfg.checkpoint.remote, cfg.checkpoint.remote_options))
    committed = remote.committed()
    if ckpt.name in committed and (read_manifest(ckpt) or {}).get("files") != remote.manifest(ckpt.name).get("files"):
        # The run went on elsewhere (a rollback there) from before this checkpoint: never written over.
        raise UserError(f"{remote.url} holds another checkpoint {ckpt.name} than {ckpt} (the run went on from the "
                        f"store elsewhere): continue it with `opentau resume {remote.url} --output_dir=DIR`.")
    newer = [n for n in committed if step_of(n) > step_of(ckpt.name)]
    if not newer:
        return []
    if not rollback:
        raise UserError(f"{remote.url} holds newer checkpoints than {ckpt} ({', '.join(newer)}): continue from the "
                        f"newest with `opentau resume {remote.url}`, or pass --rollback=true to move them into "
                        f"{remote.url}/rolled_back/<time>/ and continue from step {step_of(ckpt.name)}.")
    return [f"Rollback: {', '.join(newer)} in {remote.url} will move into rolled_back/<time>/ there (nothing is "
            "deleted)."]
