"""The memory plan (opentau_cli/memory_plan.py): computed on fake tensors of the real model, it matches the same
tracker on real tensors of pi05_small within 10%, the example pi05 config fits an 80 GB card by it, and a run that
does not fit is refused before launch with settings that would."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from opentau_cli.cli.main import app
from opentau_cli.config import TrainConfig
from opentau_cli.config.accelerate import AccelerateSetup
from opentau_cli.errors import UserError
from opentau_cli.memory_plan import CUDA_OVERHEAD, policy_module, check_fits, fake_inputs, measure_step_peak, parse_size, plan_memory
from conftest import REPO, EXAMPLES


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest.one_thread says why)."""


def test_the_plan_of_pi05_small_is_within_10_percent_of_its_measured_peak_on_cpu():
    cfg = TrainConfig(policy={"preset": "pi05_small", "image_resolution": (224, 224)}, batch_size=2)
    setup = AccelerateSetup(backend="single")
    plan = plan_memory(cfg, setup)
    planned = plan.total - CUDA_OVERHEAD

    torch.manual_seed(0)
    policy = policy_module(cfg.policy, torch.float32)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    g = torch.Generator().manual_seed(0)
    inputs = fake_inputs(cfg.policy, 2, cfg.dataset.num_cameras)
    inputs["images"] = torch.rand(inputs["images"].shape, generator=g) * 2 - 1
    inputs["actions"] = torch.randn(inputs["actions"].shape, generator=g)
    measured = measure_step_peak(policy, inputs, optimizer, autocast=False)
    assert abs(planned - measured) <= 0.10 * measured, (plan.describe(), measured)


def test_the_example_pi05_config_fits_an_80gb_card_under_every_backend_with_the_margin_printed(tmp_path):
    for accel in ("accelerate_ddp_config.yaml", "accelerate_deepspeed_config.yaml", "accelerate_deepspeed_zero3_config.yaml"):
        result = CliRunner().invoke(app, [
            "config", "validate", str(EXAMPLES / "pi05_config.json"), "--accelerate-config", str(EXAMPLES / accel),
            "--gpus", "8", "--gpu-memory", "80GB", f"--output_dir={tmp_path / 'run'}",
            "--policy.pretrained_path=null", "--policy.tokenizer_path=null"])
        assert result.exit_code == 0, result.output
        row = next(line for line in result.stdout.splitlines() if line.strip().startswith("memory plan"))
        assert "fits a 80.0 GB card (margin" in row and "4 per device" in row, row


def test_a_run_that_does_not_fit_is_refused_naming_settings_that_would():
    cfg = TrainConfig(policy={"preset": "pi05_tiny"}, batch_size=8)
    setup = AccelerateSetup(backend="ddp", num_processes=2, mixed_precision="bf16")
    plan = plan_memory(cfg, setup)
    smaller = TrainConfig(policy={"preset": "pi05_tiny"}, batch_size=8, per_device_batch_size=4, gradient_accumulation_steps=2)
    card = plan_memory(smaller, setup).total
    assert card < plan.total
    with pytest.raises(UserError) as refused:
        check_fits(cfg, setup, card)
    message = str(refused.value)
    assert message.startswith(f"The run needs about {plan.total / 1e9:.1f} GB per GPU (DDP on 2 GPUs, 8 per device")
    assert "--per_device_batch_size=4 --gradient_accumulation_steps=2 (the same batch_size)" in message
    assert message.endswith("(--distributed.memory_check=false launches anyway).")
    check_fits(smaller, setup, card)  # the named setting does fit
    from opentau_cli.config import Machine
    from opentau_cli.memory_plan import check_memory, set_card_memory

    set_card_memory(card)
    try:
        with pytest.raises(UserError):
            check_memory(cfg, setup, Machine.with_gpus(2))
        cfg.distributed.memory_check = False
        check_memory(cfg, setup, Machine.with_gpus(2))  # asked to launch anyway
    finally:
        set_card_memory(None)


def test_the_card_size_is_read_in_plain_units_and_a_bad_one_is_one_sentence():
    assert parse_size("80GB") == 80 * 10**9 and parse_size("24GiB") == 24 * 2**30 and parse_size("141 GB") == 141 * 10**9
    with pytest.raises(UserError, match="--gpu-memory takes a size such as 80GB"):
        parse_size("lots")


def test_the_memory_plan_benchmark_smoke_run_appends_every_launch_of_the_readme_table(tmp_path):
    results = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_memory_plan.py"), "--smoke", "--results",
                           str(results)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = results.read_text()
    for row in ("DDP, 8 x 1", "DDP, 4 x 2 (the example)", "ZeRO-2, 4 x 2", "ZeRO-3, 4 x 2", "DDP example: weights"):
        assert f"| {row} |" in text


@pytest.mark.parametrize("launch, lora, ranks_share", [
    (dict(backend="single"), False, 1),
    (dict(backend="ddp", num_processes=4, mixed_precision="bf16"), False, 1),  # every rank keeps the whole EMA
    (dict(backend="deepspeed", zero_stage=2, num_processes=4, mixed_precision="bf16"), False, 4),  # its partition
    (dict(backend="deepspeed", zero_stage=3, num_processes=4, mixed_precision="bf16"), False, 4),
    (dict(backend="ddp", num_processes=2, mixed_precision="bf16"), True, 1),  # LoRA: the trainable tensors only
])
def test_with_ema_the_plan_has_a_line_for_the_fp32_copy_each_rank_keeps(launch, lora, ranks_share):
    from opentau_cli.policies import build_policy
    from opentau_cli.policies.lora import apply_lora

    policy = {"preset": "pi05_tiny", **({"lora": {"rank": 4}} if lora else {})}
    setup = AccelerateSetup(**launch)
    with_ema = plan_memory(TrainConfig(policy=policy, batch_size=2, ema={"decay": 0.99}), setup)
    without = plan_memory(TrainConfig(policy=policy, batch_size=2), setup)
    cfg = TrainConfig(policy=policy)
    module = build_policy(cfg.policy)  # real tensors: what train/ema.py averages is what requires grad
    if lora:
        apply_lora(module, cfg.policy.lora)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert trainable < sum(p.numel() for p in module.parameters())  # pi05_tiny freezes its vision tower
    expected = -(-4 * trainable // ranks_share)  # fp32, divided among the ranks under ZeRO
    assert with_ema.parts["EMA of the weights (fp32)"] == expected
    assert "EMA of the weights (fp32)" not in without.parts
    assert with_ema.total - without.total == expected


def test_under_ddp_the_gradients_are_the_buckets_so_the_plan_counts_them_once():
    """train/trainer.py asks DDP for gradient_as_bucket_view (gradients are views into its all-reduce buckets) and
    zeroes them in place; the plan then holds one gradient-sized part, not a second bucket copy."""
    from accelerate.state import AcceleratorState, GradientState

    from opentau_cli.train.trainer import make_accelerator

    cfg = TrainConfig(policy={"preset": "pi05_tiny"}, batch_size=2)
    setup = AccelerateSetup(backend="ddp", num_processes=2)
    try:
        acc = make_accelerator(cfg, setup)
        assert acc.ddp_handler is not None and acc.ddp_handler.gradient_as_bucket_view is True
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    parts = plan_memory(cfg, setup).parts
    assert parts["gradients"] == parts["AdamW state"] // 2  # 4 bytes per trainable parameter, once
    assert not [name for name in parts if "bucket" in name.lower()]
