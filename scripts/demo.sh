#!/usr/bin/env bash
# Set up (if needed) and train the tiny pi05 preset on the bundled demo data: 2 CPU processes, DDP over gloo.
# The demo dataset is generated once into $OPENTAU_CACHE_DIR (default ~/.cache/opentau). Extra arguments are
# passed to `opentau train` (e.g. --steps 40).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/opentau train \
  --config_path=configs/examples/pi05_tiny_config.json \
  --accelerate-config=configs/examples/accelerate_cpu_ddp_config.yaml \
  --output_dir=outputs/train/pi05_tiny_demo --overwrite=true "$@"
echo "Checkpoints: outputs/train/pi05_tiny_demo/checkpoints/  metrics: outputs/train/pi05_tiny_demo/metrics.jsonl"
