"""The memory plan against real training processes: `opentau train` launched on CPU under single process, DDP x2,
ZeRO-3 x2 (DeepSpeed's default sizes, and a deepspeed_config_file with Accelerate's "auto" bucket sizes and a small
stage3_max_live_parameters / stage3_max_reuse_distance, which ZeRO-3's buffers follow) and FSDP2 x2 (bf16), each
rank's peak resident memory read by the kernel (tests/hooks: VmHWM after the last step less VmRSS just before the
policy is built), and what the plan allocates for a CPU launch of the same run within 10% of every rank's. Under FSDP2
the build's own peak too (every rank builds the whole model, then shards it: VmHWM once sharded less the same VmRSS)
against the plan's build.

The launches run with glibc returning freed blocks to the kernel at once (real_peak.RETURNING), so that the peak
counts what tensors hold, as torch.cuda.max_memory_allocated does on a GPU; with glibc's defaults a rank also keeps
freed blocks in its heaps, which the CPU plan states as a separate allowance (plan.memory.CPU_RETENTION), as the CUDA
plan states the caching allocator's fragmentation. The CPU plan differs from the CUDA one only where the device does
(plan_memory(..., device="cpu")): AdamW's per-tensor step and DeepSpeed's buffers resident only where written.
benchmarks/bench_memory_plan.py runs the full matrix (ZeRO-2, gradient checkpointing, ema.decay, LoRA) at a larger
batch, with glibc's defaults too, and records it in BENCHMARKS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, REPO
from real_peak import launch, zero3_auto_yaml

pytestmark = [pytest.mark.full, pytest.mark.slow, pytest.mark.e2e]

CONFIG = REPO / "benchmarks" / "pi05_small_bench.json"  # pi05_small: weights and AdamW state about a GB
# Two steps (the second holds AdamW's state), 8 per device at 112x112: activations about half the peak.
ARGS = ["--steps=2", "--batch_size=8", "--policy.image_resolution=[112,112]", "--save_freq=1000", "--log_freq=1"]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """One cache (demo data, step measurements) and Hugging Face home for this module's launches and plans."""
    return tmp_path_factory.mktemp("memory_real")


@pytest.mark.parametrize("yaml, ranks, extra", [
    (None, 1, []),
    ("accelerate_cpu_ddp_config.yaml", 2, []),
    ("accelerate_cpu_deepspeed_zero3_config.yaml", 2, []),
    ("zero3 auto", 2, ["--batch_size=16"]),  # more activations: the engine's own ~0.1 GiB of host memory weighs less
    ("accelerate_cpu_fsdp2_config.yaml", 2, []),
], ids=["single", "ddp2", "zero3x2", "zero3x2_auto_buckets", "fsdp2x2"])
def test_what_the_cpu_plan_allocates_is_within_10_percent_of_every_rank_s_real_peak(yaml, ranks, extra, home, tmp_path,
                                                                                    monkeypatch):
    from opentau_cli.config import load_config, resolve_accelerate_config
    from opentau_cli.plan.memory import plan_memory

    env = {"OPENTAU_CACHE_DIR": str(home / "cache"), "HF_HOME": str(home / "hf_home")}
    yaml_path = zero3_auto_yaml(tmp_path) if yaml == "zero3 auto" else EXAMPLES / yaml if yaml else None
    accel = [f"--accelerate-config={yaml_path}"] if yaml_path else []
    records = launch(["--config_path", str(CONFIG), *accel, *ARGS, *extra], tmp_path / "run", env=env, returning=True)
    peaks = [rank["peak"] for rank in records]
    assert len(peaks) == ranks

    monkeypatch.setenv("OPENTAU_CACHE_DIR", env["OPENTAU_CACHE_DIR"])
    plan = plan_memory(load_config(CONFIG, [*ARGS, *extra], environ={}), resolve_accelerate_config(yaml_path), device="cpu")
    for peak in peaks:
        assert abs(plan.allocated - peak) <= 0.10 * peak, (plan.describe(), peaks)
    if plan.build:  # FSDP2: the whole model as built on every rank, then its shards
        built = sum(plan.build.values())
        for rank in records:
            assert abs(built - rank["build_peak"]) <= 0.10 * rank["build_peak"], (plan.build, records)


def test_the_memory_plan_benchmark_smoke_run_appends_a_real_row_and_every_launch_of_the_readme_table(home, tmp_path):
    import subprocess

    results = tmp_path / "BENCHMARKS.md"
    env = {**__import__("os").environ, "OPENTAU_CACHE_DIR": str(home / "cache"), "HF_HOME": str(home / "hf_home")}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_memory_plan.py"), "--smoke", "--glibc",
                           "returning", "--results", str(results)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = results.read_text()
    for row in ("CPU single process", "DDP, 8 x 1", "DDP, 4 x 2", "DDP, 2 x 4 (the example)", "ZeRO-2, 2 x 4",
                "ZeRO-3, 2 x 4", "DDP example: weights", "DDP example: gradients (DDP buckets)"):
        assert f"| {row} |" in text
