"""Moments of a checkpoint save at which fault tests kill a run, and the patches that reach them.

Used in-process by tests/ckpt_save_driver.py (single process, kills itself) and by tests/kill_hook (a real
multi-rank `opentau train`, kills the whole launch). Patching is confined to the process that calls `arm`.
"""

from __future__ import annotations

import os

MOMENTS = {
    "mid_file": "this rank's optimizer state (optimizer.bin, or its ZeRO shard) half written",
    "before_metadata": "every rank's save_state done, train_config.json / training_state.json not yet written",
    "before_manifest_rename": "manifest fully written to its temp file, not yet renamed into place",
    "before_publish": "manifest in place, the .tmp- directory not yet renamed to its step",
    "before_last": "published, checkpoints/last not yet repointed",
    "mid_retention": "a newer checkpoint published, the oldest one half deleted by keep_last",
}


def arm(manager, moment: str, step: int, die) -> None:
    """Patch the save path of this process so that `die()` runs at `moment` of the save of `step`.

    `manager` is the imported opentau_cli.checkpoint.manager module."""
    import shutil
    from pathlib import Path

    import torch

    saving = {"step": None}
    real_save_ckpt = manager.CheckpointManager.save

    def save_ckpt(self, s, **kw):
        saving["step"] = s
        try:
            return real_save_ckpt(self, s, **kw)
        finally:
            saving["step"] = None

    manager.CheckpointManager.save = save_ckpt

    def now() -> bool:
        return saving["step"] == step

    if moment == "mid_file":
        real_torch_save = torch.save

        def torch_save(obj, f, *a, **k):
            real_torch_save(obj, f, *a, **k)
            if now() and ("optim_states" in str(f) or str(f).endswith("optimizer.bin")):
                with open(f, "r+b") as fh:
                    fh.truncate(os.path.getsize(f) // 2)
                die()

        torch.save = torch_save
    elif moment == "before_metadata":
        real_write_json = manager.write_json_atomic
        manager.write_json_atomic = lambda *a, **k: die() if now() else real_write_json(*a, **k)
    elif moment in ("before_manifest_rename", "before_publish"):
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            if now() and ((moment == "before_manifest_rename" and str(dst).endswith("manifest.json")) or
                          (moment == "before_publish" and Path(src).name.startswith(".tmp-"))):
                die()
            return real_replace(src, dst, *a, **k)

        os.replace = replace
    elif moment == "before_last":
        real_point_last = manager.point_last
        manager.point_last = lambda *a, **k: die() if now() else real_point_last(*a, **k)
    elif moment == "mid_retention":
        real_rmtree = shutil.rmtree

        def rmtree(path, *a, **k):
            if now() and Path(path).name.startswith(".old-"):
                files = sorted(f for f in Path(path).rglob("*") if f.is_file())
                for f in files[: len(files) // 2]:
                    f.unlink()
                die()
            return real_rmtree(path, *a, **k)

        shutil.rmtree = rmtree
    else:
        raise SystemExit(f"unknown moment {moment!r}; one of {', '.join(MOMENTS)}")
