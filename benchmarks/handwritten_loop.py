"""The anchor for benchmark 1: a minimal hand-written Accelerate training loop.

Same model (POLICY's build_policy), same batches (DATA's build_data), same optimizer, clipping and a scheduler step,
and nothing else: no metrics, no checkpoints, no progress display. Prints one JSON line with its steps/s over the
measured steps (the first --warmup steps are not timed) and, with --windows, over the first N measured steps for each
N given (one run measures several run lengths, as bench_overhead.py times opentau between its progress lines).

With --phases, each phase of a step (data, forward, backward, optimizer, zero-grad + scheduler, the loss read) is
timed the way `opentau profile` times opentau's step (perf_counter, a device sync at both ends of every phase), and
the JSON line also holds their statistics (opentau's phase_stats), comparable phase for phase with `profile --json`.
With --turns, it takes turns with another process, one step each (benchmarks/turns.py), and the JSON line
also holds when it held each turn (`spans`).

    python benchmarks/handwritten_loop.py --config benchmarks/pi05_small_bench.json --steps 20 --warmup 3 [--phases]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from opentau_cli.config import load_config
from opentau_cli.data import build_data
from opentau_cli.policies import build_policy
from opentau_cli.profiling.stats import phase_stats


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class Phases:
    """Seconds per named phase of each step, a device sync at both ends of each (as opentau's profiler does);
    disabled, a phase is just its body."""

    def __init__(self, enabled: bool):
        self.enabled, self.steps, self._current = enabled, [], {}
        self._sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
        self._step_start = None

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        self._step_start = self._step_start or start
        yield
        self._sync()
        self._current[name] = time.perf_counter() - start

    def end_step(self) -> None:
        if self.enabled:
            now = time.perf_counter()
            self.steps.append({**self._current, "total": now - self._step_start})
            self._current, self._step_start = {}, now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--phases", action="store_true", help="Time each phase of a step, as `opentau profile` does.")
    parser.add_argument("--windows", default="", help="Comma-separated N: also report steps/s over the first N measured steps.")
    parser.add_argument("--turns", default="", help="DIR:ME:OTHER: take turns with another process, one step each "
                                                     "(turns.py); report when it held each.")
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

    turns = None
    if args.turns:
        from turns import Turns  # this script's folder is on sys.path

        turns = Turns(*args.turns.split(":"))
    timer = Phases(False)
    start = None
    ends = []  # when each measured step ended
    for step in range(args.warmup + args.steps):
        if turns is not None:
            turns.next()
        if step == args.warmup:
            timer = Phases(args.phases)  # warm-up steps are not recorded
            start = time.perf_counter()
        with timer.phase("data"):
            batch = to_device(next(data.stream), accelerator.device)
        with timer.phase("forward"):
            loss = policy(batch)["loss"]
        with timer.phase("backward"):
            accelerator.backward(loss)
        with timer.phase("optimizer"):
            if o.grad_clip_norm > 0:
                accelerator.clip_grad_norm_(policy.parameters(), o.grad_clip_norm)
            optimizer.step()
        with timer.phase("zero_grad_sched"):
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        with timer.phase("sync"):
            loss.item()  # what a real loop reads for logging; also waits for the device
        timer.end_step()
        if start is not None:
            ends.append(time.perf_counter())
    elapsed = time.perf_counter() - start
    if turns is not None:
        turns.done()
    if accelerator.is_main_process:
        result = {"steps": args.steps, "seconds": elapsed, "steps_per_s": args.steps / elapsed, "loss": loss.item()}
        windows = [int(n) for n in args.windows.split(",") if n.strip()]
        result["windows"] = {str(n): n / (ends[n - 1] - start) for n in windows if 0 < n <= len(ends)}
        if turns is not None:
            result["spans"] = turns.spans
        if args.phases:
            result["phases"] = phase_stats(timer.steps)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
