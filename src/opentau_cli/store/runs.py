"""Find and read a run's checkpoints: which one `last` designates, a checkpoint named by the user, its training
state (docs/ARCHITECTURE.md, "Checkpoint contract"). Imports nothing heavy: the launcher and the offline tools use it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from opentau_cli.errors import UserError
from opentau_cli.store.format import check_readable, migrate_training_state
from opentau_cli.store.layout import BEST, CHECKPOINTS, LAST, MANIFEST, TRAIN_CONFIG, TRAINING_STATE, leftover_of, step_of
from opentau_cli.store.lineage import resume_point


def checkpoint_steps(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every published (numeric, non-hidden) checkpoint dir, oldest first; completeness not checked."""
    if not ckpt_root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in ckpt_root.iterdir()
             if step_of(p.name) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found)


def latest(run_dir: Path) -> Path | None:
    """The checkpoint a run continues from: `checkpoints/last` when complete, else its newest complete ancestor
    (store/lineage.py), or None."""
    return resume_point(Path(run_dir))


def is_checkpoint_dir(path: Path) -> bool:
    return (path / TRAINING_STATE).is_file() or (path / MANIFEST).is_file()


STEP_SUFFIX = re.compile(r"(.+):(\d+)")  # RUN:STEP


def find_checkpoint(target: Path) -> Path:
    """A checkpoint dir given a run dir (what `last` designates, or its newest complete ancestor), its checkpoints/
    dir, a checkpoint dir, `RUN:STEP` (the run's checkpoint of that step) or `RUN:best` (`checkpoints/best`, kept by
    checkpoint.keep_best)."""
    text = str(target)
    by_step = STEP_SUFFIX.fullmatch(text)
    if by_step and not Path(text).exists():
        run, step = Path(by_step.group(1)), int(by_step.group(2))
        steps = dict(checkpoint_steps(run / CHECKPOINTS))
        if step not in steps:
            held = ", ".join(map(str, steps)) or "none"
            raise UserError(f"'{text}': {run} has no checkpoint of step {step} (its checkpoints' steps: {held}).")
        return steps[step].resolve()
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
    if checkpoint.get("best_metric") == "eval/success_rate":  # config/model.py EVAL_SUCCESS
        return ("no checkpoint of this run has a success rate in its simulator yet (its evaluations are in evals/; "
                "`opentau resume RUN` finishes those still owed); pass a checkpoint directory instead.")
    return (f"no checkpoint of this run was saved at a validation step with {checkpoint.get('best_metric') or 'its best_metric'} "
            "(make save_freq a multiple of validation.val_freq); pass a checkpoint directory instead.")


def run_dir_of(ckpt_dir: Path) -> Path:
    """<run>/checkpoints/<step> -> <run>."""
    return ckpt_dir.parent.parent if ckpt_dir.parent.name == CHECKPOINTS else ckpt_dir.parent


def read_training_state(ckpt_dir: Path) -> dict:
    """The checkpoint's training state in the current format (store/format.py); refuses a newer format."""
    check_readable(ckpt_dir)
    try:
        return migrate_training_state(json.loads((ckpt_dir / TRAINING_STATE).read_text()))
    except (OSError, ValueError):
        raise UserError(f"Checkpoint '{ckpt_dir}' has no readable {TRAINING_STATE}; it was not written by opentau train.") from None


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
