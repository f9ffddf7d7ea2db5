"""Moments of a checkpoint save at which fault tests kill a run, each struck at one of the save's named fault points
(opentau_cli.store.faults), never by patching a function or matching a file name.

Used in-process by tests/ckpt_save_driver.py (single process, kills itself) and by tests/hooks' TEST_KILL_AT (a real
multi-rank `opentau train`, kills the whole launch).
"""

from __future__ import annotations

from pathlib import Path

from opentau_cli.store import faults
from opentau_cli.store.layout import MANIFEST, OPTIMIZER, ds_shard_glob, leftover_of

# moment -> (the fault point it strikes at, what the disk holds then)
MOMENTS = {
    "mid_file": ("state_saved", "this rank's save_state done, its optimizer state (optimizer.bin, or its ZeRO shard) "
                                "cut to half its size as by an interrupted write"),
    "before_metadata": ("state_saved", "this rank's save_state done, train_config.json / training_state.json not written"),
    "before_manifest_rename": ("json_synced", "the manifest fully written to its temp file, not yet renamed into place"),
    "before_publish": ("publishing", "the manifest in place, the save's temp dir not yet renamed to its step"),
    "before_last": ("published", "the step published, checkpoints/last not yet repointed"),
    "mid_retention": ("retiring", "the step published, an old checkpoint hidden and half deleted by keep_last"),
}


def arm(moment: str, step: int, die, rank: int = 0) -> None:
    """Make `die()` run at `moment` of the save of `step` in this process (which is rank `rank`)."""
    if moment not in MOMENTS:
        raise SystemExit(f"unknown moment {moment!r}; one of {', '.join(MOMENTS)}")
    point = MOMENTS[moment][0]
    assert point in faults.POINTS, f"{moment}: {point!r} is not a fault point of the save"
    saving = {"step": None}

    def strike(name: str, path: Path) -> None:
        if name == "state_saved":  # the first point of every save, on every rank: its temp dir names the step
            saving["step"] = int(leftover_of(path.name)[1])
        if name != point or saving["step"] != step:
            return
        if moment == "before_manifest_rename" and path.name != MANIFEST:
            return  # another JSON file of the save
        if moment == "mid_file":
            _cut_in_half(_optimizer_state(path, rank))
        elif moment == "mid_retention":
            files = sorted(f for f in path.rglob("*") if f.is_file())
            for f in files[: len(files) // 2]:
                f.unlink()
        die()

    faults.hooks.append(strike)


def _optimizer_state(save_dir: Path, rank: int) -> Path:
    found = sorted(save_dir.rglob(ds_shard_glob("optim", rank)))
    if not found and rank == 0 and (save_dir / OPTIMIZER).is_file():
        found = [save_dir / OPTIMIZER]
    # AssertionError, not an OSError or RuntimeError: the save must not report it as a failed write.
    assert len(found) == 1, f"rank {rank}'s optimizer state in {save_dir}: {found}"
    return found[0]


def _cut_in_half(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
