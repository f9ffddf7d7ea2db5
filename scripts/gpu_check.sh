#!/usr/bin/env bash
# GPU self-check: single-GPU bf16 training of pi05_small, two steps of the full pi05 (no checkpoint; skipped when the
# memory plan says the card is too small) with the plan next to the measured peak, DDP, ZeRO-2, ZeRO-3 and FSDP2 each with a
# checkpoint, an exact resume and the restored state compared bit for bit, gradient checkpointing, LoRA, async saves, elastic resumes of ZeRO-2 (into DDP on half the GPUs, into FSDP2), eval, pi05's inference latency (eager and torch.compile, next to the upstream 152.9 ms), the attention
# kernel, and `opentau profile` with MFU; prints one table and writes it as JSON and Markdown under outputs/gpu_check/. Arguments go to benchmarks/gpu_check.py (--help; --cpu-dry-run without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || python=python3
exec "$python" benchmarks/gpu_check.py "$@"
