"""Drive elastic resume (opentau_cli.train.reshard) through real launches (run under `accelerate launch`).

A chain of phases in one set of processes, each with a fresh Accelerator over the same gloo process group:
`--phases ddp:save,zero2:load+save,...`. A phase (ddp, zero1/2/3, zero2bf16: bf16 weights over fp32 master weights) builds the tiny model (a frozen layer, buffers, a tied weight,
sizes that make ZeRO pad), AdamW and a LambdaLR schedule under its backend; `load` restores the previous phase's
checkpoint (or --load-from) through `load_resharded` and dumps the state the launch then holds to
OUT/<prev>_to_<name>.pt; `save` trains two steps, dumps the live state to OUT/<name>_ref.pt and saves the
checkpoint to OUT/<name>/ with the training_state.json fields reshard reads.

    python -m accelerate.commands.launch --num_processes 2 --use_deepspeed --zero_stage 2 \
        tests/reshard_driver.py OUT --phases ddp:save,zero2:load+save,zero3:load+save,ddp:load
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ds_ckpt_helper import TinyTied  # noqa: E402

VOCAB, WIDTH = 37, 13


class WithIdle(TinyTied):
    """TinyTied plus a trainable layer outside the forward: it never receives a gradient (--idle)."""

    def __init__(self, vocab: int, width: int):
        super().__init__(vocab, width)
        self.idle = nn.Linear(width, 3)


MODEL = TinyTied


def _accelerator(backend: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    AcceleratorState._reset_state(reset_partial_state=True)  # the process group itself stays
    GradientState._reset_state()
    if backend == "ddp":
        from accelerate.utils import DistributedDataParallelKwargs

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
        # DDP must be told of a parameter that gets no gradient (--idle), or its second step waits for one.
        return Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=MODEL is WithIdle)])
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    plugin = DeepSpeedPlugin(zero_stage=_stage(backend), gradient_accumulation_steps=1, zero3_init_flag=False)
    acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
                      mixed_precision="bf16" if backend.endswith("bf16") else "no")
    acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    return acc


def _stage(backend: str) -> int | None:
    """"zero2" -> 2, "zero2bf16" (bf16 weights, fp32 master weights) -> 2, "ddp" -> None."""
    return int(backend[4]) if backend.startswith("zero") else None


def _build(backend: str, seed: int):
    acc = _accelerator(backend)
    torch.manual_seed(seed)
    model = MODEL(VOCAB, WIDTH)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    return acc, model, optimizer, scheduler


def _dump(path: Path, acc, model, optimizer, scheduler) -> None:
    from opentau_cli.train.reshard import MOMENTS, live_parameters

    live = {"weight": {}, **{m: {} for m in MOMENTS}, "step": {}}
    for name, values in live_parameters(acc, model, optimizer):
        for key, value in values.items():
            live[key][name] = value.clone() if key != "step" and value is not None else value  # None: no AdamW state
    module = acc.unwrap_model(model)
    live["buffers"] = {n: b.detach().cpu().clone() for n, b in module.named_buffers()}
    live["frozen"] = {}
    for n, p in module.named_parameters():
        if not p.requires_grad:
            if hasattr(p, "ds_id"):  # ZeRO-3 partitions frozen parameters too
                import deepspeed

                with deepspeed.zero.GatheredParameters([p]):
                    live["frozen"][n] = p.detach().cpu().clone()
            else:
                live["frozen"][n] = p.detach().cpu().clone()
    inner = scheduler.scheduler
    live["scheduler"] = {"last_epoch": inner.last_epoch, "last_lr": inner.get_last_lr(),
                         "lr": [g["lr"] for g in inner.optimizer.param_groups]}
    if acc.is_main_process:
        torch.save(live, path)
    acc.wait_for_everyone()


def _train(acc, model, optimizer, scheduler, steps: int) -> None:
    gen = torch.Generator().manual_seed(1 + acc.process_index)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2, 5), generator=gen)
        loss = nn.functional.cross_entropy(model(tokens).float().reshape(-1, VOCAB), tokens.reshape(-1))
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def main() -> None:
    from opentau_cli.train.reshard import load_resharded

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--phases", required=True)
    parser.add_argument("--load-from", default=None, help="checkpoint the first phase loads: NAME=DIR")
    parser.add_argument("--idle", action="store_true", help="the model has a trainable layer that gets no gradient")
    args = parser.parse_args()
    global MODEL
    MODEL = WithIdle if args.idle else TinyTied
    out = Path(args.out)
    previous = tuple(args.load_from.split("=", 1)) if args.load_from else None
    for i, phase in enumerate(args.phases.split(",")):
        backend, actions = phase.split(":")
        name = f"{backend}r{int(os.environ.get('WORLD_SIZE', 1))}"
        acc, model, optimizer, scheduler = _build(backend, seed=100 + i)  # other initial weights than the saved ones
        if "load" in actions:
            prev_name, prev_dir = previous
            load_resharded(Path(prev_dir), acc, model, optimizer, scheduler, seed=0)
            _dump(out / f"{prev_name}_to_{name}.pt", acc, model, optimizer, scheduler)
        if "save" in actions:
            _train(acc, model, optimizer, scheduler, 2)
            _dump(out / f"{name}_ref.pt", acc, model, optimizer, scheduler)
            ckpt = out / name
            acc.save_state(str(ckpt), safe_serialization=True)
            if acc.is_main_process:
                stage = _stage(backend)
                state = {"step": 2 * (i + 1), "world_size": acc.num_processes,
                         "backend": "deepspeed" if stage else "ddp", "zero_stage": stage}
                (ckpt / "training_state.json").write_text(json.dumps(state))
            acc.wait_for_everyone()
            previous = (name, str(ckpt))
    from opentau_cli.process.runtime import exit_rank

    exit_rank(0)


def launch(out: Path, phases: str, *, num_processes: int, load_from: str | None = None, idle: bool = False,
           timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
           "--num_machines", "1", "--use_deepspeed", "--zero_stage", "2", "--mixed_precision", "no",
           "--main_process_port", str(29700 + os.getpid() % 2000 + num_processes),
           "--zero3_init_flag", "false", "--gradient_accumulation_steps", "1",
           __file__, str(out), "--phases", phases] + (["--load-from", load_from] if load_from else []) + (["--idle"] if idle else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"reshard driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


if __name__ == "__main__":
    main()
