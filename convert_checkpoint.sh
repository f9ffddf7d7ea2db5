#!/usr/bin/env bash
# Upstream users ran this script to turn a DeepSpeed checkpoint into model.safetensors (zero_to_fp32.py, then a
# conversion, then deleting the pickled intermediate). It is now one streaming command:
#   ./convert_checkpoint.sh outputs/train/pi05/checkpoints/000040/ [--dtype bf16] [--max-shard-size 5GB] [--output PATH]
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: $0 CHECKPOINT_DIR [--dtype fp32|bf16] [--max-shard-size 5GB] [--output PATH] [--force]" >&2
  exit 2
fi
exec opentau checkpoint consolidate "$@"
