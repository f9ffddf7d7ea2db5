"""Drive opentau's real CheckpointManager with a real (single-process, CPU) Accelerator: SIGKILL a run at chosen
moments of a save, then resume each killed run through the functions `opentau resume` runs (save-path fault tests).

Imports and model setup happen once; each killed run and each resume is a forked child (single-threaded torch, so
forking is safe), which keeps a many-moment fault test within seconds.

    python tests/ckpt_save_driver.py ROOT --moments before_metadata,mid_file,... [--steps 4] [--async-save]

For each moment M: ROOT/M is a run that saved steps 1 and 2 (keep_last=2) and was SIGKILLed at moment M of the
save of step 3; it is copied to ROOT/M.killed, then resumed to --steps. ROOT/reference is the uninterrupted run.
With --async-save every save is checkpoint.async_save's (the moments then strike in the background writer).
Prints one JSON line per run: {"run", "killed", "resumed_from", "weights"}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from save_faults import MOMENTS, arm as arm_moment  # noqa: E402

# Not kills: from the save of step 3 on, no file may grow past N MB (EFBIG, as a full disk gives ENOSPC), so the
# write of the weights (21 MB, safetensors) or of the optimizer state (42 MB, torch.save) fails.
DISK_FULL = {"disk_full_model": 10, "disk_full_optimizer": 30}
KILL_AT_STEP = 3


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(moment: str) -> None:
    """In this child only: SIGKILL itself at `moment` of the save of KILL_AT_STEP, or cap file sizes (DISK_FULL)."""
    if moment in MOMENTS:
        arm_moment(moment, KILL_AT_STEP, _die)
    elif moment in DISK_FULL:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of dying
        limit = DISK_FULL[moment] * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    else:
        raise SystemExit(f"unknown moment {moment}")


def _train(acc, model, opt, run_dir: Path, steps: int, *, arm: str | None = None, resume: bool = False,
           async_save: bool = False) -> dict:
    from opentau_cli.config import AccelerateSetup, TrainConfig
    from opentau_cli.plan.resume import check_resumable
    from opentau_cli.store.runs import clean_leftovers, find_checkpoint
    from opentau_cli.train.manager import CheckpointManager

    # A default config and launch stand for the run's own: check_resumable compares the checkpoint with them.
    cfg, setup = TrainConfig(), AccelerateSetup()
    protect, start = None, 0
    if resume:  # what `opentau resume RUN` does: the launcher's checks and clean-up, then the worker's load
        protect = find_checkpoint(run_dir)
        check_resumable(protect, cfg, setup)
        clean_leftovers(run_dir)
    # As the worker does: the checkpoint resumed from is protected and is the parent of the next save (lineage).
    manager = CheckpointManager(acc, run_dir, total_steps=steps, run_id="drv", keep_last=2, protect=protect,
                                parent=protect, async_save=async_save)
    if protect is not None:
        start = manager.load(protect)["step"]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(8, 512, generator=gen)  # drawn every step: the data position is a function of the step
        if step <= start:
            continue
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        manager.poll()  # what the train loop does after each step
        if arm and step == KILL_AT_STEP:
            manager.wait()  # the disk fills up once the previous save is complete (async_save: it may be in flight)
            _arm(arm)
        manager.save(step, config=cfg.to_json_dict(),
                     state={"step": step, "world_size": setup.world_size, "backend": setup.backend})
    manager.wait()
    weights = sum(p.detach().double().sum().item() for p in model.parameters())
    return {"run": run_dir.name, "resumed_from": protect.name if protect else None, "weights": repr(weights)}


def _in_child(fn) -> tuple[int, dict | None]:
    """Run fn() in a forked child; returns (wait status, the JSON dict it wrote, if any)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            out = fn()
            os.write(w, json.dumps(out).encode())
        except BaseException as e:  # report, never fall back into the parent's loop
            os.write(w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    return status, (json.loads(data) if data else None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--moments", default=",".join(MOMENTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    train = partial(_train, async_save=args.async_save)

    torch.set_num_threads(1)  # no intra-op thread pool: forking below is safe
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(20)])  # ~21 MB of weights, ~42 MB of Adam state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)

    _, ref = _in_child(lambda: train(acc, model, opt, args.root / "reference", args.steps))
    print(json.dumps(ref), flush=True)
    for moment in args.moments.split(","):
        run = args.root / moment
        status, _ = _in_child(lambda: train(acc, model, opt, run, args.steps, arm=moment))
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        shutil.copytree(run, args.root / f"{moment}.killed", symlinks=True)
        _, res = _in_child(lambda: train(acc, model, opt, run, args.steps, resume=True))
        print(json.dumps({**(res or {}), "run": moment, "killed": killed}), flush=True)
    for variant in DISK_FULL:
        _, res = _in_child(lambda: train(acc, model, opt, args.root / variant, args.steps, arm=variant))
        print(json.dumps({**(res or {}), "run": variant}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
