"""The GPU self-check's restored-state check (benchmarks/gpu_check.py): every rank of a launch builds the trainer the
way `opentau resume` does, restores a checkpoint, and saves again at once, before any step. The new checkpoint's
tensors must equal the restored one's to the bit (`differences`): weights, optimizer state, schedule, per-rank random
states and EMA come back exactly as they were saved.

    accelerate launch --config_file A.yaml benchmarks/gpu_check_restore.py --config CFG.json --launch LAUNCH.json

LAUNCH.json is the launcher's (accelerate setup, log dir, run id) plus `restore_from`, the checkpoint; CFG.json's
output_dir is where the new checkpoint goes. gpu_check.Checker.restored_state writes both and compares.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# What a checkpoint holds besides tensors: records (step, time, lineage, hashes) and DeepSpeed's scripts. An FSDP2
# checkpoint's DCP shards are compared tensor by tensor (`differences`).
TENSOR_FILES = (".safetensors", ".bin", ".pt", ".pth", ".pkl")


def restore_and_save(cfg, setup, launch: dict, console) -> int:
    from opentau_cli.train.manager import CheckpointManager
    from opentau_cli.train.trainer import build_trainer

    trainer = build_trainer(cfg, setup, console=console)
    manager = CheckpointManager(trainer.accelerator, Path(cfg.output_dir), total_steps=cfg.steps,
                                run_id=launch["run_id"], save_kwargs=trainer.save_state_kwargs,
                                load_kwargs=trainer.load_state_kwargs, extra_files=trainer.checkpoint_files)
    trainer.restore(manager, Path(launch["restore_from"]))
    manager.save(trainer.step, config=cfg.to_json_dict(), state=trainer.state_dict())
    return 0


def tensor_files(ckpt: Path) -> list[str]:
    return sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.suffix in TENSOR_FILES)


def differences(saved: Path, again: Path) -> tuple[list[str], int]:
    """(what differs between two checkpoints' tensor files, how many tensors were compared)."""
    names = tensor_files(saved)
    if names != tensor_files(again):
        return [f"files {names} != {tensor_files(again)}"], 0
    found, count = [], [0]
    for name in names:
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            a, b = load_file(str(saved / name)), load_file(str(again / name))
        else:
            a = torch.load(saved / name, map_location="cpu", weights_only=False)
            b = torch.load(again / name, map_location="cpu", weights_only=False)
        _compare(a, b, name, found, count)
    from opentau_cli.store.dcp import saved_entries
    from opentau_cli.store.layout import DCP_DIR, is_dcp_checkpoint

    if is_dcp_checkpoint(saved) or is_dcp_checkpoint(again):  # FSDP2: the model, optimizer and EMA shards, by name
        if not (is_dcp_checkpoint(saved) and is_dcp_checkpoint(again)):
            return found + [f"{DCP_DIR}: in one checkpoint only"], count[0]
        a, b = saved_entries(saved, ""), saved_entries(again, "")
        if sorted(a) != sorted(b):
            return found + [f"{DCP_DIR}: entries {sorted(set(a) ^ set(b))[:5]} in one checkpoint only"], count[0]
        for key in sorted(a):  # each tensor assembled from its rank chunks, one at a time
            _compare(a[key].produce(), b[key].produce(), f"{DCP_DIR}/{key}", found, count)
    return found, count[0]


def _compare(a, b, where: str, found: list[str], count: list[int]) -> None:
    if type(a) is not type(b):
        found.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
    elif isinstance(a, torch.Tensor):
        count[0] += 1
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            found.append(f"{where}: tensors differ")
    elif isinstance(a, np.ndarray):
        if not np.array_equal(a, b):
            found.append(f"{where}: arrays differ")
    elif isinstance(a, dict):
        if list(a) != list(b):
            found.append(f"{where}: keys {list(a)[:5]} != {list(b)[:5]}")
        for k in a:
            if k in b:
                _compare(a[k], b[k], f"{where}/{k}", found, count)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            found.append(f"{where}: {len(a)} items != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{where}/{i}", found, count)
    elif a != b:
        found.append(f"{where}: {a!r} != {b!r}")


if __name__ == "__main__":
    from opentau_cli.process.runtime import run_rank

    run_rank(restore_and_save, description=__doc__)
