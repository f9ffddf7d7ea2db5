"""Accelerate YAML parsing and the validation rules shared by `config validate` and `train`."""

from __future__ import annotations

from pathlib import Path

import re

import pytest

from opentau_cli.config import (
    AccelerateSetup, Machine, load_config, read_accelerate_config, resolve_accelerate_config, setup_from_dict, validate,
)
from opentau_cli.errors import UserError
from opentau_cli.plan.run_plan import check_output_dir
from opentau_cli.store.layout import CHECKPOINTS, LAST, LOGS, METRICS, TENSORBOARD
from opentau_cli.store.layout import holds_run
from conftest import EXAMPLES

pytestmark = pytest.mark.quick

ZERO3 = EXAMPLES / "accelerate_deepspeed_zero3_config.yaml"
ZERO2 = EXAMPLES / "accelerate_deepspeed_config.yaml"
CPU = Machine(cuda=False, gpus=0)
GPU_BOX = Machine(cuda=True, gpus=8)


def cfg(*overrides: str, tmp: Path | None = None):
    """The default config on the tiny preset (the full one is refused without CUDA), in a fresh output dir."""
    base = ["--policy.preset=pi05_tiny", *([f"--output_dir={tmp / 'run'}"] if tmp else [])]
    return load_config(None, [*base, *overrides], environ={})


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "name, backend, stage, procs, mixed",
    [
        ("accelerate_ddp_config.yaml", "ddp", None, 8, "bf16"),
        ("accelerate_deepspeed_config.yaml", "deepspeed", 2, 8, "bf16"),
        ("accelerate_deepspeed_zero3_config.yaml", "deepspeed", 3, 8, "bf16"),
        ("accelerate_cpu_ddp_config.yaml", "ddp", None, 2, "no"),
        ("accelerate_cpu_deepspeed_config.yaml", "deepspeed", 2, 2, "no"),
        ("accelerate_cpu_deepspeed_zero3_config.yaml", "deepspeed", 3, 2, "no"),
    ],
)
def test_example_accelerate_configs_parse_to_their_backend(name, backend, stage, procs, mixed):
    setup = read_accelerate_config(EXAMPLES / name)
    assert (setup.backend, setup.zero_stage, setup.world_size, setup.mixed_precision) == (backend, stage, procs, mixed)


def test_deepspeed_accumulation_and_clipping_are_read(tmp_path):
    path = write_yaml(
        tmp_path / "ds.yaml",
        "distributed_type: DEEPSPEED\nnum_processes: 4\nnum_machines: 2\nmain_process_ip: 10.0.0.1\n"
        "deepspeed_config:\n  zero_stage: 1\n  gradient_accumulation_steps: 4\n  gradient_clipping: 0.5\n",
    )
    setup = read_accelerate_config(path)
    assert (setup.zero_stage, setup.ds_gradient_accumulation_steps, setup.ds_gradient_clipping) == (1, 4, 0.5)
    assert (setup.num_machines, setup.main_process_ip) == (2, "10.0.0.1")


def test_without_a_yaml_the_default_accelerate_config_is_used_when_present(isolated_env, monkeypatch):
    assert resolve_accelerate_config(None) == AccelerateSetup()  # none present: one process
    default = isolated_env / "hf_home" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text((EXAMPLES / "accelerate_cpu_ddp_config.yaml").read_text())
    setup = resolve_accelerate_config(None)
    assert (setup.backend, setup.world_size, setup.path) == ("ddp", 2, default)


@pytest.mark.parametrize(
    "text, message",
    [
        ("just: a yaml\n", "is not an Accelerate config"),
        ("distributed_type: MULTI_TPU_PLUS\nnum_processes: 2\n", "unknown distributed_type 'MULTI_TPU_PLUS'"),
        ("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 7\n", "zero_stage must be 0-3"),
        ("distributed_type: MULTI_GPU\nnum_processes: two\n", "'num_processes' must be an integer"),
        ("distributed_type: [unclosed\n", "not valid YAML at line"),
    ],
)
def test_bad_accelerate_yaml_is_one_clear_user_error(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        read_accelerate_config(write_yaml(tmp_path / "a.yaml", text))


def test_zero3_rejects_gradient_checkpointing_and_names_alternatives(tmp_path):
    with pytest.raises(UserError, match=r"ZeRO-3.*use DDP or ZeRO-1/2"):
        validate(cfg("--policy.gradient_checkpointing=true", tmp=tmp_path), read_accelerate_config(ZERO3), GPU_BOX)


def test_zero2_allows_gradient_checkpointing(tmp_path):
    checked = validate(cfg("--policy.gradient_checkpointing=true", tmp=tmp_path), read_accelerate_config(ZERO2), GPU_BOX)
    assert checked.config.policy.gradient_checkpointing


def test_zero3_downgrades_torch_compile_to_eager_with_a_warning(tmp_path):
    checked = validate(cfg("--policy.use_torch_compile=true", tmp=tmp_path), read_accelerate_config(ZERO3), GPU_BOX)
    assert checked.config.policy.use_torch_compile is False
    assert any("eager" in w for w in checked.warnings)


@pytest.mark.parametrize("yaml_name", ["accelerate_ddp_config.yaml", "accelerate_deepspeed_zero3_config.yaml"])
def test_more_processes_than_visible_gpus_is_refused_naming_the_count(tmp_path, yaml_name):
    setup = read_accelerate_config(EXAMPLES / yaml_name)  # 8 processes on one machine
    with pytest.raises(UserError, match=r"starts 8 processes per machine but this machine has 2 visible GPU\(s\); set num_processes to 2"):
        validate(cfg(tmp=tmp_path), setup, Machine(cuda=True, gpus=2))
    assert validate(cfg(tmp=tmp_path), setup, Machine(cuda=True, gpus=8)).accelerate.world_size == 8
    # Two machines of 4 processes each fit 4 GPUs per machine.
    two = read_accelerate_config(write_yaml(tmp_path / "m.yaml", "distributed_type: MULTI_GPU\nnum_processes: 8\n"
                                            "num_machines: 2\nmain_process_ip: 10.0.0.1\n"))
    assert validate(cfg(tmp=tmp_path), two, Machine(cuda=True, gpus=4)).accelerate.world_size == 8


@pytest.mark.parametrize("machine", [CPU, GPU_BOX], ids=["cpu", "8_gpus"])
def test_fsdp1_is_refused_on_every_machine_naming_fsdp2(tmp_path, machine):
    fsdp = read_accelerate_config(write_yaml(tmp_path / "f.yaml", "distributed_type: FSDP\nnum_processes: 2\n"
                                                                  "fsdp_config:\n  fsdp_version: 1\n"))
    with pytest.raises(UserError, match="asks for FSDP1 .* set fsdp_version: 2") as e:
        validate(cfg(tmp=tmp_path), fsdp, machine)
    assert "\n" not in str(e.value)


def test_batch_size_must_equal_micro_batch_times_accumulation(tmp_path):
    with pytest.raises(UserError, match=r"batch_size \(8\) must equal per_device_batch_size \(3\) x gradient_accumulation_steps \(2\)"):
        validate(cfg("--per_device_batch_size=3", "--gradient_accumulation_steps=2", tmp=tmp_path), AccelerateSetup(), CPU)
    with pytest.raises(UserError, match="per_device_batch_size \\(unset\\)"):
        validate(cfg("--gradient_accumulation_steps=3", tmp=tmp_path), AccelerateSetup(), CPU)
    checked = validate(cfg("--gradient_accumulation_steps=4", tmp=tmp_path), AccelerateSetup(), CPU)
    assert checked.config.per_device_batch_size == 2


def test_deepspeed_yaml_disagreeing_with_config_warns_and_config_wins(tmp_path):
    ds = read_accelerate_config(
        write_yaml(
            tmp_path / "ds.yaml",
            "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n"
            "  gradient_accumulation_steps: 8\n  gradient_clipping: 5.0\n",
        )
    )
    checked = validate(cfg("--gradient_accumulation_steps=2", tmp=tmp_path), ds, CPU)
    assert checked.config.gradient_accumulation_steps == 2
    assert checked.config.optimizer.grad_clip_norm == 1.0
    assert any("gradient_accumulation_steps=8" in w and "using 2" in w for w in checked.warnings)
    assert any("gradient_clipping=5.0" in w and "using 1.0" in w for w in checked.warnings)


def test_existing_output_dir_is_refused_unless_resuming_or_overwriting(tmp_path):
    (tmp_path / "run" / CHECKPOINTS / "000010").mkdir(parents=True)
    (refusal,) = check_output_dir(cfg(tmp=tmp_path))
    assert re.search("already exists.*opentau resume", refusal)
    assert check_output_dir(cfg("--overwrite=true", tmp=tmp_path)) == []
    assert check_output_dir(cfg("--resume=true", tmp=tmp_path)) == []


def test_the_dir_of_a_start_that_failed_before_its_first_checkpoint_can_be_started_again(tmp_path):
    run = tmp_path / "run"
    (run / LOGS / "20260101-000000").mkdir(parents=True)
    (run / METRICS).write_text("{}\n")
    (run / TENSORBOARD).mkdir()
    (run / CHECKPOINTS / ".tmp-000100-20260101-000000").mkdir(parents=True)  # a save it did not finish
    assert not holds_run(run)
    assert check_output_dir(cfg(tmp=tmp_path)) == []
    (run / CHECKPOINTS / LAST).write_text("000100")
    assert holds_run(run)
    (run / CHECKPOINTS / LAST).unlink()
    (run / "notes.txt").write_text("mine")  # not something opentau writes: never written into
    assert holds_run(run)


def test_n_action_steps_cannot_exceed_chunk_size(tmp_path):
    with pytest.raises(UserError, match=r"n_action_steps \(20\) must be <= policy.chunk_size \(10\)"):
        validate(cfg("--policy.chunk_size=10", "--policy.n_action_steps=20", tmp=tmp_path), AccelerateSetup(), CPU)


@pytest.mark.parametrize("key", ["steps", "log_freq", "save_freq"])
def test_steps_and_frequencies_must_be_positive(key):
    with pytest.raises(UserError, match=f"{key}: Input should be greater than or equal to 1"):
        cfg(f"--{key}=0")


def test_all_problems_are_reported_together(tmp_path):
    with pytest.raises(UserError) as err:
        validate(
            cfg("--policy.n_action_steps=99", "--per_device_batch_size=3", tmp=tmp_path),
            read_accelerate_config(write_yaml(tmp_path / "f.yaml", "distributed_type: FSDP\nnum_processes: 2\n")),
            CPU,
        )
    text = str(err.value)
    assert "n_action_steps" in text and "batch_size" in text and "FSDP" in text


def test_fp16_on_cpu_is_refused(tmp_path):
    setup = read_accelerate_config(write_yaml(tmp_path / "a.yaml", "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: fp16\n"))
    with pytest.raises(UserError, match="fp16.*needs CUDA"):
        validate(cfg(tmp=tmp_path), setup, CPU)


def test_validation_frequency_without_held_out_episodes_is_refused(tmp_path):
    with pytest.raises(UserError, match="val_split"):
        validate(cfg("--validation.val_freq=10", tmp=tmp_path), AccelerateSetup(), CPU)


def test_the_full_pi05_preset_is_refused_on_a_machine_without_cuda_and_allowed_with_it(tmp_path):
    full = cfg("--policy.preset=pi05", tmp=tmp_path)
    with pytest.raises(UserError, match=r"pi05 preset .* needs CUDA GPUs: none is visible on this machine"):
        validate(full, AccelerateSetup(), CPU)
    with pytest.raises(UserError, match="none is visible on the target machine"):
        validate(full, AccelerateSetup(), Machine.with_gpus(0))
    assert validate(full, AccelerateSetup(), GPU_BOX).machine == GPU_BOX


def test_a_target_machine_is_described_by_its_gpu_count_and_a_negative_count_is_refused():
    assert Machine.with_gpus(8) == Machine(cuda=True, gpus=8, target=True)
    assert Machine.with_gpus(8).describe() == "a machine with 8 CUDA GPUs (--gpus 8)"
    assert Machine.with_gpus(1).describe() == "a machine with 1 CUDA GPU (--gpus 1)"
    assert Machine.with_gpus(0) == Machine(cuda=False, gpus=0, target=True)
    assert CPU.describe() == "this machine (no CUDA GPU)"
    with pytest.raises(UserError, match="--gpus must be 0 or more"):
        Machine.with_gpus(-1)


def test_the_checks_handed_to_validate_are_reported_with_the_config_rules(tmp_path):
    seen = []

    def data_check(c):
        seen.append(c.policy.use_torch_compile)
        return ["the data says no."]

    with pytest.raises(UserError) as err:
        validate(cfg("--policy.n_action_steps=99", "--policy.use_torch_compile=true", tmp=tmp_path),
                 read_accelerate_config(ZERO3), GPU_BOX, [data_check])
    assert "n_action_steps" in str(err.value) and "the data says no." in str(err.value)
    assert seen == [False]  # the checks see the config as adjusted (compile downgraded under ZeRO-3)


def test_a_loss_weighting_that_names_some_terms_weighs_the_others_one_and_an_unknown_term_is_refused(tmp_path):
    assert cfg('--policy.loss_weighting={"ce": 0.5}').policy.loss_weighting == {"mse": 1.0, "ce": 0.5}
    with pytest.raises(UserError, match="unknown term 'l1' \\(known: mse, ce\\)"):
        validate(cfg('--policy.loss_weighting={"l1": 1.0}', tmp=tmp_path), AccelerateSetup(), CPU)


def test_setup_from_dict_reads_back_what_to_dict_wrote():
    for setup in (AccelerateSetup(), read_accelerate_config(ZERO3)):
        assert setup_from_dict(setup.to_dict()) == setup


def test_the_config_package_imports_no_other_opentau_package_but_errors():
    """The rules get the data and policy checks from the layer above (opentau_cli.plan.run_plan), never by importing them."""
    import ast

    import opentau_cli.config

    allowed = ("opentau_cli.config", "opentau_cli.errors")
    found = []
    for path in Path(opentau_cli.config.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith("opentau_cli") and not n.startswith(allowed)]
    assert found == []


# ------------------------------------------------------------------------------------------- checkpoint.best_metric
KEEP_BEST = ("--checkpoint.keep_best=2", "--validation.val_freq=2", "--validation.val_split=0.25")


def test_best_metric_defaults_to_the_loss_of_the_weights_export_eval_and_serve_use_by_default(tmp_path):
    """EMA on: export / eval / serve default to the EMA weights, so RUN:best is ranked on them; the resolved name is
    what the run records (train_config.json is the validated config)."""
    assert cfg(*KEEP_BEST).checkpoint.best_metric is None
    assert validate(cfg(*KEEP_BEST, "--ema.decay=0.9", tmp=tmp_path), AccelerateSetup(), CPU).config.checkpoint.best_metric == "ema_val_loss"
    assert validate(cfg(*KEEP_BEST, tmp=tmp_path), AccelerateSetup(), CPU).config.checkpoint.best_metric == "val_loss"
    # Nothing ranks without keep_best: nothing is resolved, so a later launch resolves it for its own EMA setting.
    assert validate(cfg("--ema.decay=0.9", tmp=tmp_path), AccelerateSetup(), CPU).config.checkpoint.best_metric is None


def test_the_validation_keys_follow_the_losses_and_the_ema():
    assert cfg().validation_keys() == ["val_loss", "val_mse_loss"]
    assert cfg("--ema.decay=0.9", "--policy.discrete_action_loss=true").validation_keys() == [
        "val_loss", "val_mse_loss", "val_ce_loss", "ema_val_loss", "ema_val_mse_loss", "ema_val_ce_loss"]


def test_a_misspelt_best_metric_is_refused_naming_the_closest_key(tmp_path):
    with pytest.raises(UserError) as err:
        validate(cfg(*KEEP_BEST, "--checkpoint.best_metric=val_los", tmp=tmp_path), AccelerateSetup(), CPU)
    assert str(err.value) == ("checkpoint.best_metric 'val_los' is not a validation key of this run: did you mean "
                              "'val_loss'? (validation reports val_loss, val_mse_loss).")
    with pytest.raises(UserError, match=r"'ema_val_los' .* did you mean 'ema_val_loss'\?"):
        validate(cfg(*KEEP_BEST, "--ema.decay=0.9", "--checkpoint.best_metric=ema_val_los", tmp=tmp_path), AccelerateSetup(), CPU)
    # A key validation reports only with the discrete-action loss on.
    with pytest.raises(UserError, match="'val_ce_loss' is not a validation key"):
        validate(cfg(*KEEP_BEST, "--checkpoint.best_metric=val_ce_loss", tmp=tmp_path), AccelerateSetup(), CPU)
    checked = validate(cfg(*KEEP_BEST, "--policy.discrete_action_loss=true", "--checkpoint.best_metric=val_ce_loss",
                           tmp=tmp_path), AccelerateSetup(), CPU)
    assert checked.config.checkpoint.best_metric == "val_ce_loss"


def test_ema_val_loss_ranks_with_the_ema_on_and_is_refused_without_it(tmp_path):
    checked = validate(cfg(*KEEP_BEST, "--ema.decay=0.9", "--checkpoint.best_metric=ema_val_mse_loss", tmp=tmp_path),
                       AccelerateSetup(), CPU)
    assert checked.config.checkpoint.best_metric == "ema_val_mse_loss" and checked.warnings == []
    with pytest.raises(UserError) as err:
        validate(cfg(*KEEP_BEST, "--checkpoint.best_metric=ema_val_loss", tmp=tmp_path), AccelerateSetup(), CPU)
    assert str(err.value) == ("checkpoint.best_metric 'ema_val_loss' is reported only with the EMA of the weights "
                              "(ema.decay > 0): set ema.decay, or rank by val_loss.")


def test_ranking_the_live_weights_of_a_run_with_an_ema_says_which_weights_run_best_holds(tmp_path):
    """An explicit val_loss with the EMA on (also what a run started before the default followed the EMA recorded
    in its train_config.json, which a resume keeps): kept, and the launch says export / eval / serve need
    --weights live to use the weights it ranked."""
    import json

    old = tmp_path / "train_config.json"
    saved = cfg(*KEEP_BEST, "--ema.decay=0.99", tmp=tmp_path).to_json_dict()
    saved["checkpoint"]["best_metric"] = "val_loss"
    old.write_text(json.dumps(saved))
    checked = validate(load_config(old, [], environ={}), AccelerateSetup(), CPU)
    assert checked.config.checkpoint.best_metric == "val_loss"
    assert checked.warnings == [
        "checkpoint.best_metric=val_loss ranks checkpoints by the trained (live) weights, while export, eval and serve "
        "use the EMA weights by default: pass them --weights live for RUN:best, or rank by ema_val_loss."]


def test_config_validate_refuses_a_misspelt_best_metric_in_one_line_before_launch(tmp_path):
    from conftest import run_cli_in_process

    result = run_cli_in_process(["config", "validate", str(EXAMPLES / "pi05_tiny_config.json"), *KEEP_BEST,
                                 "--checkpoint.best_metric=val_los", f"--output_dir={tmp_path / 'run'}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "Error: checkpoint.best_metric 'val_los' is not a validation key of this run: did you mean 'val_loss'? "
        "(validation reports val_loss, val_mse_loss)."]
    assert not (tmp_path / "run").exists()
