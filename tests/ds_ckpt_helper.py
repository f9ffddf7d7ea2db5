"""Make a real DeepSpeed checkpoint with `accelerator.save_state` (run under `accelerate launch`; used by tests).

The model has what consolidation must get right: a frozen submodule (kept in the model-states files, not the
optimizer partitions), float and integer buffers, a tied weight, and odd sizes so that ZeRO pads partitions.

    python -m accelerate.commands.launch --num_processes 2 --use_deepspeed --zero_stage 3 \
        tests/ds_ckpt_helper.py OUT_DIR [--width 13] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
from torch import nn

from opentau_cli.store.layout import ZERO_TO_FP32

ZERO_TO_FP32_OUTPUT = "pytorch_model.bin"  # what DeepSpeed's zero_to_fp32.py writes into its output directory


class TinyTied(nn.Module):
    def __init__(self, vocab: int, width: int, stack: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width)  # like a frozen vision encoder
        if stack:  # a deep stack of width x width layers: a large model made of many mid-sized tensors (benchmarks)
            self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(stack)])
        else:
            self.body = nn.Sequential(nn.Linear(width, 3 * width + 1), nn.GELU(), nn.Linear(3 * width + 1, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen.requires_grad_(False)
        self.register_buffer("state_mean", torch.linspace(-1.0, 1.0, width))
        self.register_buffer("seen", torch.arange(5, dtype=torch.int64))

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.frozen(h) + self.body(h) + self.state_mean.to(h.dtype)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--width", type=int, default=13)
    parser.add_argument("--vocab", type=int, default=37)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stack", type=int, default=0, help="use a stack of N width x width linear layers as the body")
    parser.add_argument("--then-one-more-step-to", dest="extra_out", default=None,
                        help="after saving, train one more step and save again here (a later save of the same run)")
    parser.add_argument("--also-zero3-to", dest="zero3_out", default=None,
                        help="then, in the same processes, train and save a ZeRO-3 run here (saves a launch in tests)")
    args = parser.parse_args()
    # The later save (--then-one-more-step-to) belongs to the last run of this process.
    _train_and_save(args, args.out_dir, None if args.zero3_out else args.extra_out, zero_stage=None)
    if args.zero3_out:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state()  # keep the process group; build a fresh Accelerator for ZeRO-3
        GradientState._reset_state()
        _train_and_save(args, args.zero3_out, args.extra_out, zero_stage=3)
    # Leave the way opentau's workers do: a rank that exits with gloo's and the store's native threads still up
    # sometimes aborts in teardown ("terminate called without an active exception") after its work is done.
    from opentau_cli.process.runtime import exit_rank

    exit_rank(0)


def _train_and_save(args, out_dir, extra_out, zero_stage) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    kwargs = {}
    if zero_stage is not None:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=zero_stage, gradient_accumulation_steps=1, zero3_init_flag=False)
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")], **kwargs)
    # No DataLoader is prepared, so DeepSpeed needs the micro batch size spelled out.
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    torch.manual_seed(0)
    model = TinyTied(args.vocab, args.width, args.stack)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    gen = torch.Generator().manual_seed(1 + accelerator.process_index)

    def step():
        tokens = torch.randint(0, args.vocab, (2, 5), generator=gen)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), tokens.reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.steps):
        step()
    accelerator.save_state(out_dir)
    accelerator.wait_for_everyone()
    if extra_out:
        step()
        accelerator.save_state(extra_out)
        accelerator.wait_for_everyone()


def launch(out_dir, *, zero_stage: int, num_processes: int, width: int = 13, steps: int = 2, mixed_precision="no",
           extra_out=None, zero3_out=None, vocab: int = 37, stack: int = 0, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run this script under `accelerate launch` with DeepSpeed on CPU; returns the finished process."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "false"}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--num_processes", str(num_processes), "--num_machines", "1", "--use_deepspeed",
        "--zero_stage", str(zero_stage), "--mixed_precision", mixed_precision,
        "--main_process_port", str(29500 + (os.getpid() % 2000) + zero_stage * 7 + num_processes),
        "--zero3_init_flag", "false", "--gradient_accumulation_steps", "1",
        __file__, str(out_dir), "--width", str(width), "--steps", str(steps),
        "--vocab", str(vocab), "--stack", str(stack),
    ] + (["--then-one-more-step-to", str(extra_out)] if extra_out else []) + (
        ["--also-zero3-to", str(zero3_out)] if zero3_out else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"DeepSpeed checkpoint helper failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_zero_to_fp32(pairs, timeout: float = 600) -> None:
    """Run DeepSpeed's own zero_to_fp32.py (the copy each checkpoint carries) on (ckpt_dir, out_dir) pairs, in one
    subprocess so that deepspeed is imported once."""
    code = (
        "import runpy, sys\n"
        f"for ckpt, out in {[(str(a), str(b)) for a, b in pairs]!r}:\n"
        f"    sys.argv = [ckpt + '/{ZERO_TO_FP32}', ckpt, out]\n"
        f"    runpy.run_path(ckpt + '/{ZERO_TO_FP32}', run_name='__main__')\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{ZERO_TO_FP32} failed:\n{proc.stderr[-5000:]}")


def zero_to_fp32_output(out_dir) -> dict[str, torch.Tensor]:
    """The state dict run_zero_to_fp32 wrote into out_dir."""
    return torch.load(os.path.join(out_dir, ZERO_TO_FP32_OUTPUT), weights_only=True)


if __name__ == "__main__":
    main()
