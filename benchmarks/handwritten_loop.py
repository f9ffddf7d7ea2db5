"""The anchor for benchmark 1: a minimal hand-written Accelerate training loop.

Same model (POLICY's build_policy), same batches (DATA's build_data), same optimizer, clipping and a scheduler step,
and nothing else: no metrics, no checkpoints, no progress display. Prints one JSON line with its steps/s over the
measured steps (the first --warmup steps are not timed).

    python benchmarks/handwritten_loop.py --config benchmarks/pi05_small_bench.json --steps 20 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from opentau_cli.config import load_config
from opentau_cli.data import build_data
from opentau_cli.policies import build_policy


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(cfg.seed)
    data = build_data(cfg, accelerator.process_index, accelerator.num_processes)
    policy = build_policy(cfg.policy, data.stats)
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad], lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    policy.train()

    start = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        batch = to_device(next(data.stream), accelerator.device)
        loss = policy(batch)["loss"]
        accelerator.backward(loss)
        if o.grad_clip_norm > 0:
            accelerator.clip_grad_norm_(policy.parameters(), o.grad_clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # what a real loop reads for logging; also waits for the device
    elapsed = time.perf_counter() - start
    if accelerator.is_main_process:
        print(json.dumps({"steps": args.steps, "seconds": elapsed, "steps_per_s": args.steps / elapsed, "loss": loss.item()}))


if __name__ == "__main__":
    main()
