"""Save and find checkpoints: atomic publish, `last` link, retention, and the checks made before a resume.

docs/ARCHITECTURE.md, "Checkpoint contract" (names: `layout`). A save goes to a hidden temp sibling of its step
directory, every rank finishes, rank 0 writes the manifest and renames the temp dir into place, then repoints
`checkpoints/last`. A kill at any instant leaves either the old set of checkpoints or the new one. With async_save
the same steps run in a background thread of every rank, from a copy of the state in host memory (async_save.py).
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

from opentau_cli.checkpoint.faults import fault_point
from opentau_cli.checkpoint.format import check_readable, migrate_training_state, stamp
from opentau_cli.checkpoint.layout import (
    BEST, CHECKPOINTS, LAST, MANIFEST, TRAIN_CONFIG, TRAINING_STATE, leftover_of, old_dir, point_last, read_last,
    step_dir_name, step_of, tmp_dir,
)
from opentau_cli.checkpoint.lineage import LINEAGE, archive_of, current_branch, lineage_record, resume_point
from opentau_cli.checkpoint.manifest import MissingRankState, is_complete, verify_manifest, write_json_atomic, write_manifest
from opentau_cli.checkpoint.pickle_scan import scan_checkpoint_pickles
from opentau_cli.config.paths import record_paths
from opentau_cli.errors import RunError, UserError

# Policy fields that change the shape of the weights: a checkpoint only resumes into the same values.
ARCHITECTURE_FIELDS = (
    "type", "preset", "chunk_size", "max_state_dim", "max_action_dim", "image_resolution",
    "tokenizer_max_length", "discrete_action_loss", "discrete_action_bins",
)


def checkpoint_steps(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every published (numeric, non-hidden) checkpoint dir, oldest first; completeness not checked."""
    if not ckpt_root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in ckpt_root.iterdir()
             if step_of(p.name) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found)


def latest(run_dir: Path) -> Path | None:
    """The checkpoint a run continues from: `checkpoints/last` when complete, else its newest complete ancestor
    (checkpoint/lineage.py), or None."""
    return resume_point(Path(run_dir))


def is_checkpoint_dir(path: Path) -> bool:
    return (path / TRAINING_STATE).is_file() or (path / MANIFEST).is_file()


def find_checkpoint(target: Path) -> Path:
    """A checkpoint dir given a run dir (what `last` designates, or its newest complete ancestor), its checkpoints/
    dir, a checkpoint dir, or `RUN:best` (`checkpoints/best`, kept by checkpoint.keep_best)."""
    text = str(target)
    if text.endswith(f":{BEST}"):
        run = Path(text[: -len(BEST) - 1])
        if not (run / CHECKPOINTS / BEST).is_dir():
            raise UserError(f"'{text}': {run / CHECKPOINTS / BEST} does not exist: {_why_no_best(run)}")
        return (run / CHECKPOINTS / BEST).resolve()
    target = Path(target)
    if not target.exists():
        raise UserError(f"'{target}' does not exist: pass a run directory (e.g. outputs/train/pi05) or one of its checkpoints.")
    if not target.is_dir():
        raise UserError(f"'{target}' is not a directory: pass a run directory or a checkpoint directory.")
    if is_checkpoint_dir(target):
        return target.resolve()
    run_dir = target.parent if target.name == CHECKPOINTS else target
    found = latest(run_dir)
    if found is None:
        if checkpoint_steps(run_dir / CHECKPOINTS):
            raise UserError(
                f"No complete checkpoint on the branch `{run_dir / CHECKPOINTS / LAST}` designates (each fails its "
                f"manifest); see `opentau checkpoint list {run_dir} --verify`, and resume one of them by its directory."
            )
        raise UserError(
            f"No checkpoint found in '{target}': expected {run_dir / CHECKPOINTS}/<step>/; "
            "start a new run with `opentau train` instead."
        )
    return found.resolve()


def _why_no_best(run: Path) -> str:
    """Why a run has no checkpoints/best, from what its newest checkpoint's train_config.json asked for."""
    newest = latest(run)
    try:
        checkpoint = json.loads((newest / TRAIN_CONFIG).read_text()).get("checkpoint", {}) if newest else {}
    except (OSError, ValueError):
        checkpoint = {}
    if not checkpoint.get("keep_best"):
        return ("this run keeps no best checkpoint (set checkpoint.keep_best and validation.val_freq); pass a "
                "checkpoint directory instead.")
    return (f"no checkpoint of this run was saved at a validation step with {checkpoint.get('best_metric') or 'its best_metric'} "
            "(make save_freq a multiple of validation.val_freq); pass a checkpoint directory instead.")


def run_dir_of(ckpt_dir: Path) -> Path:
    """<run>/checkpoints/<step> -> <run>."""
    return ckpt_dir.parent.parent if ckpt_dir.parent.name == CHECKPOINTS else ckpt_dir.parent


def read_training_state(ckpt_dir: Path) -> dict:
    """The checkpoint's training state in the current format (checkpoint/format.py); refuses a newer format."""
    check_readable(ckpt_dir)
    try:
        return migrate_training_state(json.loads((ckpt_dir / TRAINING_STATE).read_text()))
    except (OSError, ValueError):
        raise UserError(f"Checkpoint '{ckpt_dir}' has no readable {TRAINING_STATE}; it was not written by opentau train.") from None


RESHARD_FLAG = "--reshard=true"


def _check_same_topology(ckpt_dir: Path, state: dict, setup) -> None:
    """A plain resume continues bit for bit only under the backend, ZeRO stage and world size it was saved by."""
    saved_backend, saved_stage = state.get("backend"), state.get("zero_stage")
    saved_ds = saved_backend == "deepspeed"
    if (saved_backend == "fsdp") != (setup.backend == "fsdp"):
        raise UserError(
            f"Checkpoint '{ckpt_dir}' was saved by {'FSDP2' if saved_backend == 'fsdp' else saved_backend} training and "
            f"this launch is {setup.label}: resume with the same backend, or pass {RESHARD_FLAG} to continue it under "
            "this launch."
        )
    if saved_ds and setup.backend != "deepspeed":
        raise UserError(
            f"Checkpoint '{ckpt_dir}' holds DeepSpeed ZeRO-{saved_stage} shards and this launch is {setup.label}: resume "
            f"with the same DeepSpeed accelerate config, pass {RESHARD_FLAG} to continue it under this launch, or run "
            "`opentau checkpoint consolidate` on it to start a new run from its weights."
        )
    if not saved_ds and setup.backend == "deepspeed":
        raise UserError(
            f"Checkpoint '{ckpt_dir}' was saved by {saved_backend} training and this launch is {setup.label}: resume with "
            f"the same backend, or pass {RESHARD_FLAG} to continue it under this launch."
        )
    if saved_ds and saved_stage != setup.zero_stage:
        raise UserError(
            f"Checkpoint '{ckpt_dir}' was saved under ZeRO-{saved_stage} and this launch is ZeRO-{setup.zero_stage}: "
            f"resume with the same ZeRO stage, or pass {RESHARD_FLAG} to continue it under this launch."
        )
    if state.get("world_size") != setup.world_size:
        raise UserError(
            f"Checkpoint '{ckpt_dir}' was saved by {state.get('world_size')} processes and this launch has "
            f"{setup.world_size}: resume with {state.get('world_size')} processes, or pass {RESHARD_FLAG} to continue it "
            "on these (the global batch is kept; losses then match the uninterrupted run within noise, not bit for bit)."
        )


def check_in_run(ckpt_dir: Path) -> None:
    """Refuse to resume a checkpoint that is not in its run's `checkpoints/` folder: a resume writes its checkpoints
    and metrics beside its source, so one from a rollback's archive (`rolled_back/<time>/checkpoints/`) would train
    inside the archive, and one copied elsewhere would make a run of whatever folder holds it (docs/ARCHITECTURE.md,
    "Run history": rolled-back checkpoints are never resumed). Exporting, evaluating and serving them is fine."""
    ckpt_dir = Path(ckpt_dir)
    copy = f"mkdir -p NEW_RUN/{CHECKPOINTS} && cp -r {ckpt_dir} NEW_RUN/{CHECKPOINTS}/ && opentau resume NEW_RUN"
    run = archive_of(ckpt_dir)
    if run is not None:
        raise UserError(f"Checkpoint {ckpt_dir} was moved aside by a rollback of {run}, and an archive is never resumed "
                        f"or written; to continue it, copy it into a new run and resume that: `{copy}`.")
    if ckpt_dir.parent.name != CHECKPOINTS:
        raise UserError(f"Checkpoint {ckpt_dir} is not in a run's {CHECKPOINTS}/ folder, so a resume would turn "
                        f"{ckpt_dir.parent} into a run; copy it into a new run and resume that: `{copy}`.")


def check_resumable(ckpt_dir: Path, cfg, setup, *, reshard: bool = False) -> dict:
    """Refuse (UserError, nothing loaded) a checkpoint that is damaged, lies outside its run's checkpoints/ (an
    archive: check_in_run) or does not fit this launch; returns its state. With `reshard` another backend, ZeRO stage
    or world size is allowed (checkpoint/reshard.py).

    The manifest is checked first, so library loaders that unpickle (Accelerate's RNG .pkl, optimizer.bin,
    DeepSpeed's .pt) only ever see files it vouches for.
    """
    check_in_run(ckpt_dir)
    problems = verify_manifest(ckpt_dir)
    if problems:
        shown = "; ".join(str(p) for p in problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise UserError(
            f"Checkpoint '{ckpt_dir}' fails its manifest ({shown}); nothing was loaded. Resume from an earlier "
            f"checkpoint (see `opentau checkpoint list {run_dir_of(ckpt_dir)} --verify`, which re-hashes as resume does)."
        )
    # A forged manifest would vouch for anything: also vet every pickle the loaders will open (constructs nothing).
    unsafe = scan_checkpoint_pickles(ckpt_dir)
    if unsafe:
        raise UserError(f"Refusing to resume from '{ckpt_dir}': {unsafe[0]}; nothing was loaded.")
    state = read_training_state(ckpt_dir)
    if not reshard:
        _check_same_topology(ckpt_dir, state, setup)
    try:
        saved_cfg = json.loads((ckpt_dir / TRAIN_CONFIG).read_text())
    except (OSError, ValueError):
        raise UserError(f"Checkpoint '{ckpt_dir}' has no readable {TRAIN_CONFIG}.") from None
    saved_policy = saved_cfg.get("policy", {})
    now_policy = cfg.policy.model_dump(mode="json")
    diffs = [f"policy.{k}: checkpoint {saved_policy.get(k)!r}, now {now_policy.get(k)!r}"
             for k in ARCHITECTURE_FIELDS if saved_policy.get(k) != now_policy.get(k)]
    if diffs:
        raise UserError(
            f"Checkpoint '{ckpt_dir}' does not fit this config ({'; '.join(diffs)}); resume with the checkpoint's own "
            f"{TRAIN_CONFIG}, or start a new run with --policy.pretrained_path."
        )
    return state


def clean_leftovers(run_dir: Path) -> list[Path]:
    """Remove the temp dirs of interrupted saves and deletions (they never passed as checkpoints)."""
    root = Path(run_dir) / CHECKPOINTS
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if leftover_of(p.name):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def describe_os_error(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "the disk is full (or a file size limit was hit)"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "the output directory is not writable"
    return e.strerror or str(e)


def describe_write_error(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "unexpected pos" in text or "No space" in text or "File too large" in text:  # torch's short-write check
        return "the disk is full (or a file size limit was hit): a write came up short"
    return f"writing failed ({type(e).__name__}: {text[:200]})"


def skip_zip_crcs() -> None:
    """torch.save of this process writes its zip records without CRC-32s: computing them took about half the CPU time
    of writing an optimizer state, and no loader checks them (torch.load does not); a checkpoint's integrity is the
    manifest's hash of every file, checked by verify and before resume (docs/ARCHITECTURE.md, "Checkpoint contract")."""
    import torch.utils.serialization.config as serialization

    serialization.save.compute_crc32 = False


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
                 extra_files: Callable[[], dict] | None = None, best: "BestCheckpoints | None" = None):
        self.accelerator = accelerator
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
        error = self._all_ranks(lambda: self._write(tmp, config, state, final))
        if not error:
            error = self._all_ranks(lambda: self._publish(tmp, final, name) if acc.is_main_process else None)
        if error:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(step, error)
        if acc.is_main_process:
            self._retain()
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
            error = self._all_ranks(job.raise_error)
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
        from opentau_cli.checkpoint.async_save import BackgroundSave, HostStaging, snapshot

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
            if acc.is_main_process:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
            acc.wait_for_everyone()
            writes.extend(snapshot(acc, tmp, self._staging, self.save_kwargs, extra=self.extra_files()))

        error = self._all_ranks(copy_state)
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
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        return RunError(f"Could not save the checkpoint of step {step} under {self.root}: {error}; {kept}.")

    def _all_ranks(self, fn) -> str | None:
        """Run fn on this rank; every rank learns whether any rank failed (no rank is left waiting in a barrier)."""
        import torch
        from safetensors import SafetensorError

        message = None
        try:
            fn()
        except MissingRankState as e:  # publish refused: a rank's files are not in the save
            message = str(e)
        except OSError as e:
            message = describe_os_error(e)
        except (RuntimeError, SafetensorError) as e:  # torch.save / safetensors wrap a failed write in their own types
            message = describe_write_error(e)
        failed = torch.tensor([1.0 if message else 0.0], device=self.accelerator.device)
        failed = self.accelerator.reduce(failed, reduction="sum")
        if failed.item() and message is None:
            message = "another rank could not write its part"
        return message

    def _write(self, tmp: Path, config: dict, state: dict, final: Path) -> None:
        from safetensors.torch import save_file

        acc = self.accelerator
        if acc.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp), safe_serialization=True, **self.save_kwargs)
        for name, tensors in self.extra_files().items():
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        fault_point("state_saved", tmp)
        if acc.is_main_process:
            self._write_records(tmp, config, state, final)
        acc.wait_for_everyone()

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
            _fsync_dir(sub)
        old = None
        if final.exists():  # e.g. resumed from an earlier step: the new save replaces a stale one of the same step
            old = old_dir(self.root, name, self.run_id)
            os.replace(final, old)
        fault_point("publishing", tmp)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        fault_point("published", final)
        point_last(self.root, name)
        if old is not None:
            _delete_hidden(old)

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
        kept = set(branch[-self.keep_last:]) | set(best) | {self.root / n for n in [read_last(self.root)] if n}
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
