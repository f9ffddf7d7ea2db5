"""The command line surface: command groups, config commands, exit codes, no tracebacks."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from opentau_cli.cli.main import app
from opentau_cli.config import Machine, load_config
from conftest import EXAMPLES, run_cli

runner = CliRunner()
# pi05_config.json starts from lerobot/pi05_base and PaliGemma's tokenizer: offline, from a cache laid out for it.
pytestmark = [pytest.mark.quick, pytest.mark.usefixtures("published_pi05_hub")]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
FULL = str(EXAMPLES / "pi05_config.json")
ACCELERATE_CONFIGS = sorted(EXAMPLES.glob("accelerate_*_config.yaml"))
# Every shipped training config, so examples never rot.
TRAIN_CONFIGS = sorted(EXAMPLES.glob("*.json")) + sorted((EXAMPLES.parents[1] / "benchmarks").glob("*.json"))


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_help_lists_every_command_group():
    result = invoke("--help")
    assert result.exit_code == 0
    for name in ("train", "resume", "eval", "checkpoint", "config", "profile", "dataset"):
        assert name in result.output
    sub = invoke("checkpoint", "--help").output
    for name in ("consolidate", "export", "inspect", "verify", "list", "push"):
        assert name in sub
    sub = invoke("config", "--help").output
    for name in ("validate", "show", "schema"):
        assert name in sub


@pytest.fixture(scope="module")
def example_datasets(tmp_path_factory):
    """The datasets the mixture example reads, made as docs/data.md makes them (paths relative to the working dir)."""
    from opentau_cli.data import write_synth

    cwd = tmp_path_factory.mktemp("examples")
    write_synth(cwd / "data" / "reach_v21", episodes=5, steps_per_episode=6)
    write_synth(cwd / "data" / "reach_v30_video", episodes=5, steps_per_episode=6, fmt="v3.0", video=True, cameras=2)
    return cwd


@pytest.mark.parametrize("accel", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("config", TRAIN_CONFIGS, ids=lambda p: p.stem)
def test_every_example_config_validates_with_every_accelerate_config_for_an_8_gpu_machine(isolated_env, example_datasets,
                                                                                        monkeypatch, accel, config):
    monkeypatch.chdir(example_datasets)
    # A multi-machine YAML leaves machine 0's address to the launch (the SLURM script passes it), as a user does.
    address = ["--main_process_ip", "127.0.0.1"] if yaml.safe_load(accel.read_text()).get("num_machines", 1) > 1 else []
    result = invoke("config", "validate", str(config), "--accelerate-config", str(accel), "--gpus", "8", *address,
                    f"--output_dir={isolated_env / 'run'}")
    assert result.exit_code == 0, result.output
    assert "Config OK" in result.output and "checked for        a machine with 8 CUDA GPUs (--gpus 8)" in result.output


def test_validate_checks_for_this_machine_by_default_and_says_so(isolated_env, monkeypatch):
    monkeypatch.setattr(Machine, "this", classmethod(lambda cls: Machine(cuda=False, gpus=0)))
    result = invoke("config", "validate", TINY, f"--output_dir={isolated_env / 'run'}")
    assert result.exit_code == 0, result.output
    assert "checked for        this machine (no CUDA GPU)" in result.stdout
    full = invoke("config", "validate", FULL, f"--output_dir={isolated_env / 'run'}")
    assert full.exit_code == 2 and "The pi05 preset (~3.3B parameters) needs CUDA GPUs" in full.stderr


@pytest.mark.parametrize("gpus", ["-1", "eight"])
def test_validate_refuses_a_gpu_count_that_is_not_a_count_with_exit_2(isolated_env, gpus):
    result = invoke("config", "validate", TINY, "--gpus", gpus, f"--output_dir={isolated_env / 'run'}")
    assert result.exit_code == 2, result.output
    assert "--gpus" in result.output and "Traceback" not in result.output


def test_validate_shows_the_policys_parameter_counts(isolated_env):
    from opentau_cli.policies import count_parameters

    result = invoke("config", "validate", TINY, f"--output_dir={isolated_env / 'run'}")
    counts = count_parameters(load_config(TINY, [], environ={}).policy)
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("parameters"))
    assert f"({counts['total']:,} / {counts['trainable']:,})" in row
    assert re.search(r"\d\.\d\dM total, \d\.\d\dM trainable", row), row


def test_validate_prints_backend_world_size_global_batch_steps_and_output_dir(isolated_env):
    result = invoke(
        "config", "validate", TINY, "--accelerate-config", str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"),
        "--steps", "40", f"--output_dir={isolated_env / 'run'}",
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "DeepSpeed ZeRO-3" in out and "2 (1 machine)" in out and "global batch       16" in out
    assert "steps              40" in out and str(isolated_env / "run") in out


def test_validate_rejects_zero3_with_gradient_checkpointing_with_exit_2(isolated_env):
    result = invoke(
        "config", "validate", FULL, "--accelerate-config", str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"),
        "--policy.gradient_checkpointing=true", f"--output_dir={isolated_env / 'run'}",
    )
    assert result.exit_code == 2
    assert "use DDP or ZeRO-1/2" in result.output and "FSDP" not in result.output
    assert "Traceback" not in result.output


def test_validate_warns_when_zero3_downgrades_compile(isolated_env):
    result = invoke(
        "config", "validate", TINY, "--accelerate-config", str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"),
        "--policy.use_torch_compile=true", f"--output_dir={isolated_env / 'run'}",
    )
    assert result.exit_code == 0
    assert "Warning:" in result.output and "eager" in result.output


def test_show_prints_the_resolved_config_as_json(isolated_env):
    result = invoke("config", "show", TINY, "--steps=40", "--policy.chunk_size", "5", "--policy.n_action_steps=5")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["steps"] == 40 and data["policy"]["chunk_size"] == 5 and data["policy"]["preset"] == "pi05_tiny"


def test_schema_is_json_with_the_policy_section():
    result = invoke("config", "schema")
    assert result.exit_code == 0
    assert "policy" in json.loads(result.output)["properties"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["config", "validate", "/nonexistent.json"], "not found"),
        (["config", "validate", TINY, "--policy.chunk_sise=3"], "did you mean 'policy.chunk_size'"),
        (["config", "validate", TINY, "--accelerate-config", "/nonexistent.yaml"], "not found"),
        (["config", "show", TINY, "--steps=lots"], "steps: Input should be a valid integer"),
    ],
)
def test_user_mistakes_exit_2_with_one_line_and_no_traceback(isolated_env, args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_installed_script_reports_malformed_json_with_position_and_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps": 10,,}')
    proc = run_cli(["config", "validate", str(bad)], env={"HF_HOME": str(tmp_path)})
    assert proc.returncode == 2
    assert "line 1, column 14" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_installed_opentau_train_alias_reaches_the_train_command(tmp_path):
    proc = run_cli(["--config_path", str(tmp_path / "missing.json")], script="opentau-train", env={"HF_HOME": str(tmp_path)})
    assert proc.returncode == 2
    assert "missing.json" in proc.stderr and "not found" in proc.stderr
