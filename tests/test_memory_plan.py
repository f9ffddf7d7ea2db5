"""The memory plan (opentau_cli/plan/memory.py), in-process: its peak is the largest phase of a step on top of what
lives through the run, its parts add up, card sizes are read as cards are sold, the device's costs are named, its
step measurement cannot go stale, and a run that does not fit is refused with settings that would. How close it
comes to real training processes is tests/test_memory_plan_real.py's business."""

from __future__ import annotations

import os
import subprocess

import pytest
from typer.testing import CliRunner

from opentau_cli.cli.main import app
from opentau_cli.config import TrainConfig
from opentau_cli.config.accelerate import AccelerateSetup
from opentau_cli.errors import UserError
from opentau_cli.plan.memory import (CPU_RETENTION, CUDA_CONTEXT, CUDA_FRAGMENTATION, NCCL_BUFFERS, check_fits, parse_size,
                                     plan_memory)
from conftest import EXAMPLES, SUITE_CACHE, opentau_bin

pytestmark = pytest.mark.quick

GIB = 2**30


@pytest.fixture(autouse=True)
def _one_thread_suite_cache(one_thread, monkeypatch):
    """One intra-op thread (conftest.one_thread says why) and the suite's step-measurement cache: each measurement is
    keyed by everything it depends on (the tests below on the keys hold that), so what another test measured is what
    measuring again gives, and the launches' measurements are shared with this module's."""
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(SUITE_CACHE))


def real_trainable(policy: dict) -> int:
    """Trainable values of the policy built with real tensors (what train/trainer.py hands AdamW)."""
    from opentau_cli.policies import build_policy
    from opentau_cli.policies.lora import apply_lora

    cfg = TrainConfig(policy=policy)
    module = build_policy(cfg.policy)
    if cfg.policy.lora.enabled:
        apply_lora(module, cfg.policy.lora)
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def test_the_peak_is_the_largest_phase_on_top_of_what_lives_and_the_printed_parts_add_up_to_it():
    cfg = TrainConfig(policy={"preset": "pi05_tiny"}, batch_size=4)
    plan = plan_memory(cfg, AccelerateSetup(backend="ddp", num_processes=2, mixed_precision="bf16"))
    assert set(plan.phases) == {"forward", "backward", "optimizer step"}
    largest = max(sum(parts.values()) for parts in plan.phases.values())
    assert plan.total == sum(plan.lives.values()) + largest + sum(plan.device_costs.values())
    assert sum(plan.parts.values()) == plan.total
    text = plan.describe(80 * GIB)

    def shown(n: int) -> str:  # as nvidia-smi counts: GiB, MiB below one GiB
        return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"

    assert text.startswith(f"{shown(plan.total)} peak per GPU (DDP on 2 GPUs, 4 per device")
    for name, n in {**plan.lives, **plan.phases[plan.peak_phase], **plan.device_costs}.items():
        if n:
            assert f"{name} {shown(n)}" in text
    for name, parts in plan.phases.items():
        assert f"{name} {shown(sum(parts.values()))}" in text
    assert f"; fits a 80.0 GiB card (margin {shown(80 * GIB - plan.total)})" in text


def test_under_ddp_the_gradients_live_through_the_run_in_the_buckets_and_no_phase_takes_them_off():
    """train/trainer.py asks DDP for gradient_as_bucket_view (gradients are views into its all-reduce buckets) and
    zeroes them in place: one gradient-sized part through the run, nothing subtracted from the step."""
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
    ddp = plan_memory(cfg, setup)
    single = plan_memory(cfg, AccelerateSetup(backend="single"))
    trainable = real_trainable({"preset": "pi05_tiny"})
    assert ddp.lives["gradients (DDP buckets)"] == 4 * trainable
    assert not [part for parts in ddp.phases.values() for part in parts if "gradient" in part]
    # The same activations in both; single process allocates its gradients in the backward and frees them after.
    assert ddp.phases["forward"]["activations"] == single.phases["forward"]["activations"] > 0
    assert single.phases["optimizer step"]["gradients"] == 4 * trainable


def test_with_gradient_accumulation_the_held_gradients_are_in_the_next_forward():
    one = plan_memory(TrainConfig(policy={"preset": "pi05_tiny"}, batch_size=4), AccelerateSetup(backend="single"))
    two = plan_memory(TrainConfig(policy={"preset": "pi05_tiny"}, batch_size=8, per_device_batch_size=4,
                                  gradient_accumulation_steps=2), AccelerateSetup(backend="single"))
    trainable = real_trainable({"preset": "pi05_tiny"})
    assert "gradients" not in one.phases["forward"]
    assert two.phases["forward"] == {**one.phases["forward"], "gradients": 4 * trainable}


@pytest.mark.parametrize("launch, lora, ranks_share", [
    (dict(backend="single"), False, 1),
    (dict(backend="ddp", num_processes=4, mixed_precision="bf16"), False, 1),  # every rank keeps the whole EMA
    (dict(backend="deepspeed", zero_stage=2, num_processes=4, mixed_precision="bf16"), False, 4),  # its partition
    (dict(backend="deepspeed", zero_stage=3, num_processes=4, mixed_precision="bf16"), False, 4),
    (dict(backend="fsdp", num_processes=4, mixed_precision="bf16", fsdp_version=2), False, 4),  # its shards
    (dict(backend="ddp", num_processes=2, mixed_precision="bf16"), True, 1),  # LoRA: the trainable tensors only
])
def test_with_ema_the_plan_has_a_line_for_the_fp32_copy_each_rank_keeps(launch, lora, ranks_share):
    policy = {"preset": "pi05_tiny", **({"lora": {"rank": 4}} if lora else {})}
    setup = AccelerateSetup(**launch)
    with_ema = plan_memory(TrainConfig(policy=policy, batch_size=2, ema={"decay": 0.99}), setup)
    without = plan_memory(TrainConfig(policy=policy, batch_size=2), setup)
    trainable = real_trainable(policy)
    expected = -(-4 * trainable // ranks_share)  # fp32, divided among the ranks under ZeRO
    assert with_ema.lives["EMA of the weights (fp32)"] == expected
    assert "EMA of the weights (fp32)" not in without.lives
    assert sum(with_ema.lives.values()) - sum(without.lives.values()) == expected
    assert with_ema.phases["optimizer step"]["EMA update temporary"] > 0  # train/ema.py's chunked product


def test_under_fsdp2_on_cpu_every_rank_first_holds_the_whole_model_as_built_and_that_is_the_peak_when_larger():
    """Every rank builds the whole policy in fp32 before fully_shard cuts it (docs/ARCHITECTURE.md, "Memory plan"): on
    8 CPU processes at one sample per device that is more than a step holds, and the plan's peak is the build."""
    cfg = TrainConfig(policy={"preset": "pi05_small", "gradient_checkpointing": True, "image_resolution": [112, 112],
                              "chunk_size": 10, "n_action_steps": 10, "tokenizer_max_length": 48}, batch_size=1)
    fsdp = AccelerateSetup(backend="fsdp", num_processes=8, mixed_precision="bf16", fsdp_version=2)
    cpu, gpu = plan_memory(cfg, fsdp, device="cpu"), plan_memory(cfg, fsdp)
    from opentau_cli.policies import build_policy

    built = sum(p.numel() * p.element_size() for p in build_policy(cfg.policy).parameters())  # fp32, real tensors
    assert cpu.build["the whole model as built (fp32)"] == built
    assert cpu.build_is_peak and cpu.allocated == sum(cpu.build.values()) > cpu.step_peak
    assert sum(cpu.parts.values()) == cpu.total
    assert "= the model's build " in cpu.describe() and "above a step's" in cpu.describe()
    # On a GPU the whole model is in host memory; each unit comes to the GPU whole only to be sharded.
    assert not gpu.build_is_peak and gpu.allocated == gpu.step_peak
    assert sum(gpu.build.values()) < built


def test_the_device_costs_are_named_allowances_cuda_context_nccl_and_fragmentation_on_gpus_glibc_on_cpu():
    cfg = TrainConfig(policy={"preset": "pi05_tiny"}, batch_size=4)
    ddp = AccelerateSetup(backend="ddp", num_processes=2)
    gpu, cpu = plan_memory(cfg, ddp), plan_memory(cfg, ddp, device="cpu")
    assert gpu.device_costs == {"CUDA context": CUDA_CONTEXT, "NCCL buffers": NCCL_BUFFERS,
                                "allocator fragmentation (10% of allocated)": int(CUDA_FRAGMENTATION * gpu.allocated)}
    assert "NCCL buffers" not in plan_memory(cfg, AccelerateSetup(backend="single")).device_costs
    assert cpu.device_costs == {"glibc retention (25% of allocated)": int(CPU_RETENTION * cpu.allocated)}
    assert "on 2 CPU processes" in cpu.label and "on 2 GPUs" in gpu.label
    # AdamW on CPU updates one tensor at a time (two fp32 copies of the largest); on CUDA foreach, one copy of all.
    trainable = real_trainable({"preset": "pi05_tiny"})
    assert gpu.phases["optimizer step"]["AdamW temporaries"] == 4 * trainable
    assert cpu.phases["optimizer step"]["AdamW temporaries"] < 4 * trainable


def test_the_zero_sizes_a_run_gets_are_deepspeed_s_defaults_the_config_file_s_numbers_or_accelerate_s_auto(monkeypatch):
    """An Accelerate YAML cannot set ZeRO's bucket sizes: the run gets DeepSpeed's own defaults (read here from
    DeepSpeed's config class); a deepspeed_config_file's numbers win, "auto" is Accelerate's h*h, 0.9*h*h and 10*h
    from the model's width (2048 for pi05: PaliGemma's hidden_size)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from opentau_cli.config.accelerate import zero_settings
    from opentau_cli.policies.pi05.configuration import hidden_size

    ds = DeepSpeedZeroConfig()
    assert zero_settings({}, 2048) == {
        "reduce_bucket_size": ds.reduce_bucket_size, "stage3_prefetch_bucket_size": ds.prefetch_bucket_size,
        "stage3_param_persistence_threshold": ds.param_persistence_threshold,
        "stage3_max_live_parameters": ds.max_live_parameters, "stage3_max_reuse_distance": ds.max_reuse_distance,
        "sub_group_size": ds.sub_group_size}
    assert hidden_size(TrainConfig().policy) == 2048
    auto = zero_settings({"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "param_persistence_threshold": "auto", "stage3_max_live_parameters": 3e8}, 2048)
    assert (auto["reduce_bucket_size"], auto["stage3_prefetch_bucket_size"], auto["stage3_param_persistence_threshold"],
            auto["stage3_max_live_parameters"]) == (4_194_304, 3_774_873, 20_480, 300_000_000)
    with pytest.raises(UserError, match=r"zero_optimization.reduce_bucket_size must be a number or \"auto\", got 'big'"):
        zero_settings({"reduce_bucket_size": "big"}, 2048)


def test_zero3_keeps_gathered_what_it_uses_again_within_the_reuse_distance_and_prefetches_up_to_max_live():
    """Four modules of 10 elements in a row, worked by hand: with every later use within the reuse distance, the
    whole model is gathered when the backward starts; with none, one module at a time (plus what is prefetched,
    while fewer than stage3_max_live_parameters are gathered)."""
    from opentau_cli.plan.memory import ModuleTrace, zero3_gathered

    chain = ModuleTrace(numels=[10, 10, 10, 10], module_params=[[0], [1], [2], [3]],
                        forward=[1, -1, 2, -2, 3, -3, 4, -4], grad_out=[True] * 4)
    sizes = dict(stage3_param_persistence_threshold=0, stage3_max_live_parameters=10**9, stage3_max_reuse_distance=10**9,
                 stage3_prefetch_bucket_size=0)
    assert zero3_gathered(chain, sizes) == (40, 40)
    assert zero3_gathered(chain, {**sizes, "stage3_max_reuse_distance": 0}) == (10, 10)
    # Prefetching 10 elements ahead: the next module in the trace is gathered while the current one runs. As the
    # backward starts, D (gathered again) and C (fetched ahead while D ran forward) and B (fetched ahead now).
    assert zero3_gathered(chain, {**sizes, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 10}) == (20, 30)
    # ... but not past stage3_max_live_parameters gathered.
    assert zero3_gathered(chain, {**sizes, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 10,
                                  "stage3_max_live_parameters": 10}) == (10, 10)
    # Parameters under the persistence threshold stay whole on every rank: counted apart, never gathered.
    assert zero3_gathered(chain, {**sizes, "stage3_param_persistence_threshold": 10}) == (0, 0)


def test_a_card_is_read_as_sold_80gb_and_80gib_are_both_what_nvidia_smi_shows_for_it():
    assert parse_size("80GB") == parse_size("80GiB") == parse_size("80 gb") == 81920 * 2**20
    assert parse_size("81559MiB") == 81559 * 2**20  # the exact figure nvidia-smi shows for an H100 80GB
    assert parse_size("141GB") == 141 * GIB
    with pytest.raises(UserError, match="^--gpu-memory .lots. is not a card size; write e.g. 80GB"):
        parse_size("lots")


def test_the_optimizer_row_prints_binary_units_once_not_bb():
    from opentau_cli.cli.summary import optimizer_row

    counts = {"total": 3_300_000_000, "trainable": 2_832_000_000}  # the full pi05 with its vision tower frozen
    row = optimizer_row(counts, 8, None)
    assert row.startswith(f"{8 * 2_832_000_000 / GIB:.2f} GiB AdamW state") and "BB" not in row
    assert f"{8 * 2_832_000_000 / 8 / GIB:.2f} GiB per process, ZeRO-2 shards it over 8" in optimizer_row(counts, 8, 2)
    assert f"{8 * 2_832_000_000 / 8 / GIB:.2f} GiB per process, FSDP2 shards it over 8" in optimizer_row(counts, 8, None, "FSDP2")


def test_the_step_measurement_cache_is_keyed_by_the_code_and_libraries_it_measures(monkeypatch, tmp_path):
    from opentau_cli.plan import memory as memory_plan

    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path))
    cfg = TrainConfig(policy={"preset": "pi05_tiny"}, batch_size=2)
    args = (cfg.policy, 2, cfg.dataset.num_cameras, "float32", False)
    first = memory_plan.step_bytes(*args)
    cached = list((tmp_path / "memory_plan").iterdir())
    assert len(cached) == 1 and memory_plan.step_bytes(*args) == first
    monkeypatch.setattr(memory_plan, "_code_version", lambda: "changed")  # as after an edit of the policy's code
    assert memory_plan.step_bytes(*args) == first
    assert len(list((tmp_path / "memory_plan").iterdir())) == 2  # measured again, not read from the old entry
    real_versions = memory_plan._library_versions()
    for library in range(3):  # another torch, transformers or peft: measured again
        versions = [*real_versions[:library], "another", *real_versions[library + 1:]]
        monkeypatch.setattr(memory_plan, "_library_versions", lambda versions=versions: versions)
        assert memory_plan.step_bytes(*args) == first
        assert len(list((tmp_path / "memory_plan").iterdir())) == 3 + library
    cached[0].write_text('{"bytes": 1}')  # an entry of an older format is measured again, never misread
    monkeypatch.undo()
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path))
    assert memory_plan.step_bytes(*args) == first


def test_the_policy_sizes_cache_is_keyed_by_the_code_and_libraries_that_build_it(monkeypatch, tmp_path):
    from opentau_cli.plan import memory as memory_plan

    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(memory_plan, "_SIZES", {})
    cfg = TrainConfig(policy={"preset": "pi05_tiny", "lora": {"rank": 4}})
    counts = memory_plan.parameter_counts(cfg.policy)
    assert counts == {"total": counts["total"], "trainable": real_trainable(cfg.policy.model_dump())}
    cached = list((tmp_path / "memory_plan").glob("sizes_*.json"))
    assert len(cached) == 1
    monkeypatch.setattr(memory_plan, "_SIZES", {})
    monkeypatch.setattr(memory_plan, "sizes", lambda _cfg: pytest.fail("built again although cached"))
    assert memory_plan.parameter_counts(cfg.policy) == counts  # read back, not built
    monkeypatch.undo()
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path))
    for changed in ("_code_version", "_library_versions"):  # an edit of the policies' code, another transformers
        with monkeypatch.context() as m:
            m.setattr(memory_plan, "_SIZES", {})
            m.setattr(memory_plan, changed, lambda: "changed")
            assert memory_plan.parameter_counts(cfg.policy) == counts
    assert len(list((tmp_path / "memory_plan").glob("sizes_*.json"))) == 3  # built again each time, not read
    cached[0].write_text('{"total": 1}')  # an entry of another format is built again, never misread
    monkeypatch.setattr(memory_plan, "_SIZES", {})
    assert memory_plan.parameter_counts(cfg.policy) == counts


def test_a_policy_that_cannot_be_built_is_refused_by_every_launch_and_never_cached(monkeypatch, tmp_path):
    from opentau_cli.plan import memory as memory_plan

    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path))
    bad = TrainConfig(policy={"preset": "pi05_tiny", "image_resolution": [36, 36]})  # not a multiple of the patch
    for _ in range(2):
        monkeypatch.setattr(memory_plan, "_SIZES", {})
        with pytest.raises(UserError, match="multiple of the pi05_tiny patch size"):
            memory_plan.parameter_counts(bad.policy)
    assert not (tmp_path / "memory_plan").exists() or not list((tmp_path / "memory_plan").glob("sizes_*"))


def test_a_second_plan_of_the_same_policy_imports_no_transformers_and_without_a_gpu_no_torch(tmp_path):
    """Measured from outside: Python's own import log (-X importtime) of two `opentau config validate` commands. On a
    machine with no GPU device file (no CUDA GPU for torch to find) the second imports no torch either, and prints
    the same memory plan."""
    env = {**os.environ, "OPENTAU_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPROFILEIMPORTTIME": "1"}
    command = [opentau_bin(), "config", "validate", str(EXAMPLES / "pi05_tiny_config.json"),
               f"--accelerate-config={EXAMPLES / 'accelerate_cpu_ddp_config.yaml'}", f"--output_dir={tmp_path / 'run'}"]
    imported, plans = [], []
    for _ in range(2):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        imported.append({line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")})
        plans.append([line for line in done.stdout.splitlines() if line.strip().startswith("memory plan")])
    # A package that importlib.import_module imports (runtime.import_paused) has no line of its own in the log, only
    # what it imports with an import statement: a package shows as its modules.
    def uses(modules: set[str], package: str) -> bool:
        return any(m.split(".")[0] == package for m in modules)

    assert uses(imported[0], "transformers") and "opentau_cli.policies" in imported[0] and uses(imported[0], "torch")
    assert not uses(imported[1], "transformers") and "opentau_cli.policies" not in imported[1]
    gpu_device_files = [f for f in os.listdir("/dev") if f.startswith("nvidia") and f[6:].isdigit() or f in ("dxg", "kfd")]
    assert uses(imported[1], "torch") == bool(gpu_device_files), gpu_device_files
    assert len(plans[0]) == 1 and "GiB peak per GPU (DDP on 2 GPUs" in plans[0][0] and plans[1] == plans[0]


def test_the_example_pi05_config_fits_an_80gb_card_under_every_backend_with_the_margin_printed(tmp_path):
    for accel in ("accelerate_ddp_config.yaml", "accelerate_deepspeed_config.yaml", "accelerate_deepspeed_zero3_config.yaml",
                  "accelerate_fsdp2_config.yaml"):
        result = CliRunner().invoke(app, [
            "config", "validate", str(EXAMPLES / "pi05_config.json"), "--accelerate-config", str(EXAMPLES / accel),
            "--gpus", "8", "--gpu-memory", "80GB", f"--output_dir={tmp_path / 'run'}",
            "--policy.pretrained_path=null", "--policy.tokenizer_path=null"])
        assert result.exit_code == 0, result.output
        row = next(line for line in result.stdout.splitlines() if line.strip().startswith("memory plan"))
        assert "fits a 80.0 GiB card (margin" in row and " per device" in row, row
        if "fsdp2" in accel:
            assert "(FSDP2 on 8 GPUs, " in row and "weights (fp32 shard)" in row, row


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
    assert message.startswith(f"The run needs about {plan.total / GIB:.1f} GiB per GPU (DDP on 2 GPUs, 8 per device")
    assert "--per_device_batch_size=4 --gradient_accumulation_steps=2 (the same batch_size)" in message
    assert message.endswith("(--distributed.memory_check=false launches anyway).")
    check_fits(smaller, setup, card)  # the named setting does fit
    from opentau_cli.config import Machine
    from opentau_cli.plan.memory import check_memory, set_card_memory

    set_card_memory(card)
    try:
        with pytest.raises(UserError):
            check_memory(cfg, setup, Machine.with_gpus(2))
        cfg.distributed.memory_check = False
        check_memory(cfg, setup, Machine.with_gpus(2))  # asked to launch anyway
    finally:
        set_card_memory(None)
