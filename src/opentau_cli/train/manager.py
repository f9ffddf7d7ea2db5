"""The live run's checkpoint saver: atomic publish, `last` link, retention (docs/ARCHITECTURE.md, "Checkpoint contract";
file names: store/layout.py).

A save goes to a hidden temp sibling of its step directory, every rank finishes, rank 0 writes the manifest and
renames the temp dir into place, then repoints `checkpoints/last`. A kill at any instant leaves either the old set of
checkpoints or the new one. With async_save the same steps run in a background thread of every rank, from a copy of
the state in host memory (async_save.py). Finding and reading checkpoints is store/runs.py's.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from opentau_cli.config.paths import record_paths
from opentau_cli.errors import RunError
from opentau_cli.store import evals
from opentau_cli.store.faults import fault_point
from opentau_cli.store.format import skip_zip_crcs, stamp
from opentau_cli.store.layout import (
    BEST, CHECKPOINTS, LOGS, MANIFEST, TRAIN_CONFIG, TRAINING_STATE, old_dir, point_last, read_last, step_dir_name, step_of, tmp_dir,
)
from opentau_cli.store.lineage import LINEAGE, current_branch, lineage_record
from opentau_cli.store.manifest import (
    MissingRankState, hash_files, is_complete, manifest_record, rank_layout, read_manifest, write_json_atomic, write_manifest,
)
from opentau_cli.store.runs import latest, read_training_state
from opentau_cli.store.storage import fsync_dir
from opentau_cli.units import format_size


FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DISK_FULL = "the disk is full"


def is_disk_full(e: BaseException) -> bool:
    """A write that failed for want of space: the OSError itself, or torch's / safetensors' wrapping of a short write."""
    if isinstance(e, OSError):
        return e.errno in FULL_DISK
    text = str(e)
    return "unexpected pos" in text or "No space" in text or "File too large" in text


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path` (which exists): the disk a full-disk message names."""
    p = Path(os.path.abspath(path))
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def describe_write_error(e: BaseException) -> str:
    """Why a write failed, for a failure other than a full disk."""
    if isinstance(e, OSError):
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"the output directory is not writable ({e.strerror or e})"
        return e.strerror or str(e)
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"writing failed ({type(e).__name__}: {text[:200]})"


class CheckpointManager:
    """Saves checkpoints for one run. Every rank calls `save`; rank 0 publishes; retention runs after publishing.

    `accelerator` needs save_state / load_state / wait_for_everyone / is_main_process / reduce. `save_kwargs` /
    `load_kwargs` go to save_state / load_state (a LoRA run's: write and read only what trains, policies/lora.py).
    `extra_files` gives the safetensors files this rank adds to each save beside save_state's ({name: tensors}; the
    EMA, train/ema.py).
    With `async_save`, `save` returns once the state is copied to host memory; every rank then calls `poll` after
    each step and `wait` before leaving. `report` receives "Saved checkpoint ..." when one is published.
    """

    def __init__(self, accelerator, run_dir: Path, *, total_steps: int, run_id: str, keep_last: int | None = None,
                 protect: Path | None = None, parent: Path | None = None, save_kwargs: dict | None = None, load_kwargs: dict | None = None,
                 async_save: bool = False, report: Callable[[str], None] | None = None,
                 extra_files: Callable[[], dict] | None = None, best: "BestCheckpoints | None" = None,
                 machine_local: bool = False):
        self.accelerator = accelerator
        # Each machine keeps its own ranks' part of every checkpoint in its own run directory; the whole checkpoint
        # is only in checkpoint.remote (machine_local_disks; docs/ARCHITECTURE.md, "Remote checkpoints").
        self.machine_local = machine_local
        self.extra_files = extra_files or dict
        self.save_kwargs, self.load_kwargs = dict(save_kwargs or {}), dict(load_kwargs or {})
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.total_steps = total_steps
        self.run_id = run_id
        self.keep_last = keep_last
        self.best = best or BestCheckpoints()
        self.protect = Path(protect).resolve() if protect else None
        self.parent = Path(parent) if parent else None  # what the next save continues (lineage.py)
        self.async_save = async_save
        self.report = report or (lambda text: None)
        self._staging = None  # async_save's host copy of the state, made by the first save
        self._in_flight = None  # async_save's BackgroundSave
        skip_zip_crcs()

    def save(self, step: int, *, config: dict, state: dict) -> Path:
        """Write checkpoint `step` atomically. Raises RunError (on every rank) when it cannot be written.

        With async_save it returns the directory the checkpoint will be published as, once the state is in host
        memory; a failure of the write is raised by a later `poll`, `wait` or `save`."""
        if self.async_save:
            self.wait()  # at most one save in flight: the parent is published before its child is recorded
        if self.accelerator.is_main_process:
            state = dict(state, **{LINEAGE: lineage_record(self.parent, self.run_id)})
        if self.async_save:
            self.parent = self._save_async(step, config, state)  # a failed write stops the run (poll raises)
            return self.parent
        acc = self.accelerator
        name = step_dir_name(step, self.total_steps)
        tmp = tmp_dir(self.root, name, self.run_id)
        final = self.root / name
        # Every rank makes the same collective calls whatever fails where: each stage ends with the ranks agreeing on
        # whether any of them failed, and no stage holds a barrier a failed rank would skip (docs/ARCHITECTURE.md,
        # "Checkpoint contract").
        error = self._all_ranks(lambda: self._prepare(tmp), tmp)
        if not error:
            error = self._all_ranks(lambda: self._write(tmp, config, state, final), tmp)
        if not error and self.machine_local:
            error = self._publish_parts(tmp, final, name)
        elif not error:
            error = self._all_ranks(lambda: self._publish(tmp, final, name) if acc.is_main_process else None, tmp)
        if error:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(step, error)
        if acc.is_main_process:
            self._retain()
        elif self.machine_local and acc.local_process_index == 0:
            self._retain_part()
        self.parent = final
        self.report(f"Saved checkpoint {final}")
        return final

    def poll(self, *, wait: bool = False) -> None:
        """Move the save in flight on (async_save; nothing to do otherwise). A collective: every rank calls it at the
        same points, after each step and through `wait`. Once every rank's part is written, rank 0's thread
        publishes; a failure on any rank raises RunError on every rank, the previous checkpoint left as it was."""
        import torch

        job = self._in_flight
        while job is not None:
            if wait:
                job.wait_for_milestone()
            error = self._all_ranks(job.raise_error, job.tmp)
            if error:
                self._in_flight = None
                job.abandon()
                self.accelerator.wait_for_everyone()  # every thread is done with the temp dir before it goes
                if self.accelerator.is_main_process:
                    shutil.rmtree(job.tmp, ignore_errors=True)
                raise self._failed(job.step, error)
            done = self.accelerator.reduce(torch.tensor(job.progress(), device=self.accelerator.device), reduction="sum")
            written, published = done.tolist()
            if published:
                self._in_flight = None
                self.report(f"Saved checkpoint {job.final}")
                return
            if not job.publishing and written == self.accelerator.num_processes:
                job.start_publishing()
            if not wait:
                return
            job = self._in_flight

    def wait(self) -> None:
        """Block until the save in flight is published (async_save); raises RunError on every rank if it failed."""
        self.poll(wait=True)

    @property
    def snapshot_bytes(self) -> int:
        """Host memory async_save's copy of the state holds on this rank (0 before the first save)."""
        return self._staging.nbytes if self._staging is not None else 0

    def load(self, ckpt_dir: Path) -> dict:
        """Restore model, optimizer, scheduler and RNG (every rank); returns the checkpoint's training state."""
        self.accelerator.load_state(str(ckpt_dir), **self.load_kwargs)
        return read_training_state(Path(ckpt_dir))

    # Internals.

    def _save_async(self, step: int, config: dict, state: dict) -> Path:
        """Copy the state to host memory (all ranks, main thread), then write and publish it in the background."""
        from opentau_cli.train.async_save import BackgroundSave, HostStaging, snapshot

        self.wait()  # at most one save in flight: the next one waits for it
        acc = self.accelerator
        name = step_dir_name(step, self.total_steps)
        tmp = tmp_dir(self.root, name, self.run_id)
        final = self.root / name
        config, state = json.loads(json.dumps(config)), json.loads(json.dumps(state))  # as they are now
        first = self._staging is None
        self._staging = self._staging or HostStaging()
        writes = []

        def copy_state() -> None:
            writes.extend(snapshot(acc, tmp, self._staging, self.save_kwargs, extra=self.extra_files()))

        error = self._all_ranks(lambda: self._prepare(tmp), tmp)
        if not error:
            error = self._all_ranks(copy_state, tmp)
        if error:
            acc.wait_for_everyone()
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(step, error)
        if first:
            self.report(f"Asynchronous saves: rank {acc.process_index} copies the state into "
                        f"{self._staging.describe()}, kept for the next saves.")

        hashed = {}  # relative path -> (size, hash) of the files this rank's writer wrote, synced

        def write_part() -> None:
            for write in writes:
                path, size, digest = write()
                hashed[path.relative_to(tmp).as_posix()] = (size, digest)
            fault_point("state_saved", tmp)
            if acc.is_main_process:
                self._write_records(tmp, config, state, final)

        def publish() -> None:
            self._publish(tmp, final, name, hashed)
            self._retain()

        self._in_flight = BackgroundSave(step, tmp, final, write_part, publish if acc.is_main_process else None)
        if acc.num_processes == 1:
            self._in_flight.start_publishing()  # no other rank to wait for: publish as soon as it is written
        return final

    def _failed(self, step: int, error: str) -> RunError:
        previous = latest(self.run_dir)
        kept = (f"the previous checkpoint {previous} is intact and stays `last`" if previous
                else "no earlier checkpoint exists")
        then = ""
        if error.startswith(DISK_FULL):
            again = f"continue with `opentau resume {self.run_dir}`" if previous else "run the same command again"
            then = f"; free space on that disk (or move the run to a larger one), then {again}"
        return RunError(f"Could not save the checkpoint of step {step} under {self.root}: {error}; {kept}{then}.")

    def _all_ranks(self, fn, tmp: Path) -> str | None:
        """Run fn on this rank; every rank learns whether any rank failed, and the same sentence for why (the first
        failed rank's): no rank is left waiting in a collective the others skipped. `tmp` is the save's temp dir."""
        import torch
        from safetensors import SafetensorError

        message = None
        try:
            fn()
        except MissingRankState as e:  # publish refused: a rank's files are not in the save
            message = str(e)
        except (OSError, RuntimeError, SafetensorError) as e:  # torch.save / safetensors wrap a failed write in their own types
            message = self._full_disk(tmp) if is_disk_full(e) else describe_write_error(e)
        failed = torch.tensor([1.0 if message else 0.0], device=self.accelerator.device)
        failed = self.accelerator.reduce(failed, reduction="sum")
        if not failed.item():
            return None
        return self._first_message(message)

    def _first_message(self, message: str | None) -> str:
        """The lowest failed rank's sentence, on every rank (a collective: every rank calls it once a rank failed)."""
        import torch.distributed as dist

        if self.accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized():
            everyone = [None] * self.accelerator.num_processes
            dist.all_gather_object(everyone, message)
            message = next((m for m in everyone if m), message)
        return message or "another rank could not write its part"

    def _full_disk(self, tmp: Path) -> str:
        """The disk, the space it has (counting this save's partial files, which go) and what a save needs."""
        where = self.root if self.root.exists() else self.run_dir
        try:
            free = shutil.disk_usage(where).free + dir_bytes(tmp)
        except OSError:
            return DISK_FULL
        previous = latest(self.run_dir)
        manifest = read_manifest(previous) if previous is not None else None
        if manifest is not None:
            needed = sum(int(f.get("size", 0)) for f in manifest["files"].values())
            basis = f"as much as checkpoint {previous.name}"
        else:
            needed, basis = self._state_bytes(), "its weights and optimizer state"
        return (f"{DISK_FULL}: {mount_point(where)} has {format_size(free)} free for it and a checkpoint needs "
                f"about {format_size(needed)} ({basis})")

    def _state_bytes(self) -> int:
        """About what this run's save writes: the weights, and AdamW's two fp32 moments per trained parameter."""
        total = 0
        for model in getattr(self.accelerator, "_models", []):
            for p in model.parameters():
                n = getattr(p, "ds_numel", None) or p.numel()
                total += n * p.element_size() + (8 * n if p.requires_grad else 0)
        return total

    def _prepare(self, tmp: Path) -> None:
        if self.accelerator.is_main_process or (self.machine_local and self.accelerator.local_process_index == 0):
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)

    def _write(self, tmp: Path, config: dict, state: dict, final: Path) -> None:
        from safetensors.torch import save_file

        acc = self.accelerator
        acc.save_state(str(tmp), safe_serialization=True, **self.save_kwargs)
        for name, tensors in self.extra_files().items():
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        fault_point("state_saved", tmp)
        if acc.is_main_process:
            self._write_records(tmp, config, state, final)

    def _write_records(self, tmp: Path, config: dict, state: dict, final: Path) -> None:
        # Paths inside the run directory relative to it, so a moved or copied run resumes (config/paths.py).
        cfg = record_paths(config, self.run_dir)
        cfg["config_path"] = (final / TRAIN_CONFIG).relative_to(self.run_dir).as_posix()  # itself, once published
        write_json_atomic(tmp / TRAIN_CONFIG, cfg)
        write_json_atomic(tmp / TRAINING_STATE, dict(stamp(state), time=time.strftime("%Y-%m-%dT%H:%M:%S%z")))

    def _publish(self, tmp: Path, final: Path, name: str, hashed: dict | None = None) -> None:
        # Last: its presence says every other file is complete and on disk (`hashed`: by async_save's writer).
        write_manifest(tmp, fsync=True, hashed=hashed)
        for sub in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
            fsync_dir(sub)
        old = None
        if final.exists():  # e.g. resumed from an earlier step: the new save replaces a stale one of the same step
            old = old_dir(self.root, name, self.run_id)
            os.replace(final, old)
        fault_point("publishing", tmp)
        os.replace(tmp, final)
        fsync_dir(self.root)
        fault_point("published", final)
        point_last(self.root, name)
        if old is not None:
            _delete_hidden(old)

    def _publish_parts(self, tmp: Path, final: Path, name: str) -> str | None:
        """Publish a checkpoint whose files lie on several machines' disks: each machine's first rank hashes its part,
        rank 0 makes the manifest of them all (refusing a save that misses a rank), and every machine's first rank
        writes that same manifest beside its part and publishes it under its run's `checkpoints/`. Returns the
        error every rank agrees on, or None."""
        import torch.distributed as dist

        acc = self.accelerator
        first_here = acc.local_process_index == 0
        part: dict = {}

        def hash_part() -> None:
            part.update(hash_files(tmp, fsync=True) if first_here and tmp.is_dir() else {})

        error = self._all_ranks(hash_part, tmp)
        if error:
            return error
        parts = [None] * acc.num_processes
        dist.all_gather_object(parts, part)
        decided = [None, None]  # the manifest, or why there is none
        if acc.is_main_process:
            merged = {rel: entry for p in parts for rel, entry in (p or {}).items()}
            try:
                decided[0] = manifest_record(merged, rank_layout(tmp), final)
            except MissingRankState as e:
                decided[1] = str(e)
        dist.broadcast_object_list(decided, src=0)
        manifest, error = decided
        if error:
            return error
        return self._all_ranks(lambda: self._publish_part(tmp, final, name, manifest) if first_here else None, tmp)

    def _publish_part(self, tmp: Path, final: Path, name: str, manifest: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(tmp / MANIFEST, manifest)
        for sub in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
            fsync_dir(sub)
        old = None
        if final.exists():
            old = old_dir(self.root, name, self.run_id)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.root)
        point_last(self.root, name)
        if old is not None:
            _delete_hidden(old)

    def _retain_part(self) -> None:
        """Another machine's retention of its parts: the newest keep_last by step, never `last` (its parts are never
        whole here: completeness is rank 0's and the store's business)."""
        if not self.keep_last:
            return
        parts = sorted((p for p in self.root.iterdir() if step_of(p.name) is not None and p.is_dir()),
                       key=lambda p: step_of(p.name))
        last = read_last(self.root)
        for path in parts[:-self.keep_last]:
            if path.name == last or (self.protect is not None and path.resolve() == self.protect):
                continue
            doomed = old_dir(self.root, path.name, self.run_id)
            os.replace(path, doomed)
            _delete_hidden(doomed)

    def _retain(self) -> None:
        """Keep the newest `keep_last` complete checkpoints of the current branch and the `keep_best` best by the
        validation metric; never the one this run resumed from, `last`, or a checkpoint on another branch. Points
        `checkpoints/best` at the best."""
        if not self.keep_last and not self.best.keep:
            return
        branch = [p for p in current_branch(self.run_dir) if is_complete(p)]
        best = self.best.choose(branch)
        if best:
            point_last(self.root, best[0].name, BEST)
        if not self.keep_last:
            return
        # The launcher's evaluation (eval.env) keeps the checkpoint it evaluates and those waiting for it.
        kept = (set(branch[-self.keep_last:]) | set(best) | {self.root / n for n in [read_last(self.root)] if n}
                | {self.root / n for n in evals.busy(self.run_dir)})
        for path in branch:
            if path in kept or (self.protect is not None and path.resolve() == self.protect):
                continue
            # Hide it first (atomic rename): a kill mid-deletion leaves a leftover the next run removes, never a
            # half-deleted step directory.
            doomed = old_dir(self.root, path.name, self.run_id)
            os.replace(path, doomed)
            _delete_hidden(doomed)


@dataclass(frozen=True)
class BestCheckpoints:
    """checkpoint.keep_best / best_metric / best_mode: which checkpoints are the best by their validation record
    (training_state.json "validation", the validation run at the checkpoint's step)."""

    keep: int = 0
    metric: str = "val_loss"
    mode: str = "min"

    def score(self, ckpt: Path) -> float | None:
        if self.metric == evals.SUCCESS_KEY:  # recorded by the launcher's evaluation, after the checkpoint's publish
            return evals.success_rate(ckpt.parent.parent, ckpt.name)
        try:
            value = json.loads((ckpt / TRAINING_STATE).read_text()).get("validation", {}).get(self.metric)
        except (OSError, ValueError, AttributeError):
            return None
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    def choose(self, checkpoints: list[Path]) -> list[Path]:
        """The `keep` best of `checkpoints`, best first (a tie goes to the later checkpoint)."""
        if not self.keep:
            return []
        scored = [(s, -i, p) for i, p in enumerate(checkpoints) if (s := self.score(p)) is not None]
        scored.sort(key=lambda t: (t[0] if self.mode == "min" else -t[0], t[1]))
        return [p for _, _, p in scored[: self.keep]]


def _delete_hidden(doomed: Path) -> None:
    """Delete a checkpoint already renamed to its deletion temp name."""
    fault_point("retiring", doomed)
    shutil.rmtree(doomed, ignore_errors=True)


DISKS = "disks.json"  # <run>/logs/disks.json: {"machine_local": bool}, as the run's first group of several machines found


def machine_local_disks(accelerator, run_dir: Path, run_id: str, machine: int, remote: str | None, machines: int) -> bool:
    """Whether each machine of the run keeps its own run directory (no output_dir they all share): possible only with
    checkpoint.remote, which then holds the whole checkpoints. A group of several machines finds out (each machine's
    first rank leaves a mark in its run directory; rank 0 sees them all or not) and records it on every machine; a
    group of one machine (elastic machines, after a loss) goes by that record. A collective."""
    import torch.distributed as dist

    if not remote or machines <= 1:
        return False
    record = Path(run_dir) / LOGS / DISKS
    first_here = accelerator.local_process_index == 0
    everyone = [machine]
    if accelerator.num_processes > 1:
        everyone = [None] * accelerator.num_processes
        dist.all_gather_object(everyone, machine if first_here else None)
    group = sorted(m for m in everyone if m is not None)
    if len(group) == 1:
        try:
            return bool(json.loads(record.read_text()).get("machine_local"))
        except (OSError, ValueError):
            return False
    mark = Path(run_dir) / LOGS / f".disk-{run_id}-machine{machine}"
    if first_here:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
    dist.barrier()
    seen = [all((Path(run_dir) / LOGS / f".disk-{run_id}-machine{m}").exists() for m in group)]
    dist.broadcast_object_list(seen, src=0)
    dist.barrier()
    if first_here:
        mark.unlink(missing_ok=True)
        write_json_atomic(record, {"machine_local": not seen[0]})
    return not seen[0]
