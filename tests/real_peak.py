"""Launch a real `opentau train` with tests/hooks' TEST_MEMORY_RECORD and read each rank's peak resident memory.

Shared by tests/test_memory_plan_real.py and benchmarks/bench_memory_plan.py: the peak a rank's steps reached above
what it held just before the policy was built (its VmHWM after the last step less its VmRSS at that moment), read by
the kernel, not by any tracker of the product; and the ZeRO-3 config with non-default sizes both launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HOOKS = Path(__file__).resolve().parent / "hooks"
# glibc hands every freed block above 128 KiB back to the kernel at once (a fixed mmap threshold: its dynamic one
# rises to 32 MiB and keeps freed blocks under it in its heaps). The peak then counts what tensors hold, as
# torch.cuda.max_memory_allocated does on a GPU without the caching allocator's reserve.
RETURNING = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def launch(args: list[str], run_dir: Path, *, env: dict | None = None, returning: bool = False,
           timeout: float = 1800) -> list[dict]:
    """`opentau train ARGS --output_dir RUN_DIR` with the hook; returns each rank's record (rank order), each with
    `peak`: its training steps' high-water mark above its resident bytes just before the policy was built, and
    `build_peak`: its high-water mark once the policy was built (and sharded, FSDP2) above the same.
    `returning`: glibc returns freed blocks to the kernel at once (RETURNING)."""
    record = Path(run_dir).parent / (Path(run_dir).name + "_memory")
    record.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {}), **(RETURNING if returning else {}), "PYTHONPATH": str(HOOKS),
                "TEST_MEMORY_RECORD": str(record)}
    full_env.pop("OPENTAU_DEBUG", None)
    opentau = Path(sys.executable).parent / "opentau"
    proc = subprocess.run([str(opentau), "train", *args, f"--output_dir={run_dir}"], env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"opentau train failed ({proc.returncode}): {proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    ranks = []
    for path in sorted(record.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        rank = json.loads(path.read_text())
        rank["peak"] = rank["hwm_steps"][-1] - rank["rss_before_policy"]
        rank["build_peak"] = rank["hwm_built"] - rank["rss_before_policy"]
        ranks.append(rank)
    return ranks


# A deepspeed_config_file as Hugging Face's examples write them ("auto": Accelerate's sizes from the model's width,
# 640 for pi05_small: a 409,600-element reduce bucket instead of 5e8), with ZeRO-3 keeping at most 2e7 parameters
# gathered and none for reuse: about 80 MiB gathered instead of the whole model, as the run's memory shows.
ZERO3_AUTO = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 20_000_000,
                                    "stage3_max_reuse_distance": 0}}


def zero3_auto_yaml(directory: Path) -> Path:
    """A 2-process CPU ZeRO-3 Accelerate config whose settings are ZERO3_AUTO (a deepspeed_config_file next to it)."""
    (directory / "ds_zero3_auto.json").write_text(json.dumps(ZERO3_AUTO))
    yaml = directory / "accelerate_zero3_auto.yaml"
    yaml.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds_zero3_auto.json\n"
                    "  zero3_init_flag: true\nnum_machines: 1\nnum_processes: 2\nmixed_precision: \"no\"\n")
    return yaml
