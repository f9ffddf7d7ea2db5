"""The shared config model: loading order, overrides, unknown keys, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opentau_cli.config import TrainConfig, load_config, parse_overrides
from opentau_cli.errors import UserError
from conftest import EXAMPLES

pytestmark = pytest.mark.quick


def write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_defaults_fill_every_section_and_derive_micro_batch(isolated_env):
    cfg = load_config(None, [], environ={})
    assert cfg.policy.chunk_size == 50
    assert cfg.optimizer.grad_clip_norm == 1.0
    assert cfg.per_device_batch_size == cfg.batch_size // cfg.gradient_accumulation_steps


def test_json_then_env_then_cli_override_in_that_order(tmp_path):
    path = write_json(tmp_path / "c.json", {"steps": 10, "policy": {"chunk_size": 20, "n_action_steps": 5}})
    env = {"OPENTAU_STEPS": "11", "OPENTAU_POLICY__CHUNK_SIZE": "21"}
    cfg = load_config(path, ["--steps", "12"], environ=env)
    assert cfg.steps == 12  # CLI beats env beats JSON
    assert cfg.policy.chunk_size == 21  # env beats JSON
    assert cfg.policy.n_action_steps == 5  # JSON beats default, sibling keys kept


def test_both_override_spellings_and_bare_flags_work():
    parsed = parse_overrides(["--steps", "40", "--log_freq=5", "--resume=true", "--policy.chunk_size=10", "--overwrite"])
    assert parsed == {"steps": "40", "log_freq": "5", "resume": "true", "policy.chunk_size": "10", "overwrite": "true"}
    cfg = load_config(None, parsed, environ={})
    assert (cfg.steps, cfg.log_freq, cfg.resume, cfg.policy.chunk_size, cfg.overwrite) == (40, 5, True, 10, True)


def test_dashes_in_override_keys_are_accepted():
    assert parse_overrides(["--log-freq=3"]) == {"log_freq": "3"}


def test_text_fields_keep_numeric_looking_values_as_text():
    cfg = load_config(None, ["--output_dir=123", "--dataset.root=007"], environ={})
    # Text, made absolute against the working directory (config/paths.py), never the number 123.
    assert cfg.output_dir == Path.cwd() / "123"
    assert cfg.dataset.root == str(Path.cwd() / "007")


def test_list_and_optional_values_parse_from_the_command_line():
    cfg = load_config(None, ["--policy.image_resolution=[64,48]", "--checkpoint.keep_last=3"], environ={})
    assert cfg.policy.image_resolution == (64, 48)
    assert cfg.checkpoint.keep_last == 3
    cfg = load_config(None, ["--checkpoint.keep_last=null"], environ={})
    assert cfg.checkpoint.keep_last is None


def test_unknown_cli_key_names_the_key_and_suggests_the_closest():
    with pytest.raises(UserError, match=r"'policy.chunk_sise'.*did you mean 'policy.chunk_size'"):
        parse_overrides(["--policy.chunk_sise=3"])
    with pytest.raises(UserError, match=r"'stepz'.*did you mean 'steps'"):
        parse_overrides(["--stepz=3"])


def test_unknown_json_key_is_reported_with_a_suggestion(tmp_path):
    path = write_json(tmp_path / "c.json", {"optimizer": {"learning_rate": 1e-4}})
    with pytest.raises(UserError, match=r"unknown config key 'optimizer.learning_rate'"):
        load_config(path, [], environ={})


def test_unknown_env_key_is_an_error_naming_the_variable():
    with pytest.raises(UserError, match=r"OPENTAU_STEPZ.*did you mean 'steps'"):
        load_config(None, [], environ={"OPENTAU_STEPZ": "3"})


def test_wrong_types_are_reported_all_at_once(tmp_path):
    path = write_json(tmp_path / "c.json", {"steps": "many", "policy": {"chunk_size": 0}})
    with pytest.raises(UserError) as err:
        load_config(path, [], environ={})
    assert "steps" in str(err.value) and "policy.chunk_size" in str(err.value)


def test_malformed_json_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "steps": 10,\n  "seed": ,\n}')
    with pytest.raises(UserError, match=r"line 3, column 11"):
        load_config(path, [], environ={})


def test_missing_config_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.json", [], environ={})


def test_config_path_under_configs_is_found_without_the_prefix(monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent.parent)
    cfg = load_config("examples/pi05_config.json", [], environ={})
    assert cfg.config_path == Path("configs/examples/pi05_config.json")
    assert cfg.policy.preset == "pi05"


def test_resolved_config_round_trips_through_json(tmp_path):
    cfg = load_config(EXAMPLES / "pi05_tiny_config.json", ["--steps=7"], environ={})
    path = write_json(tmp_path / "train_config.json", cfg.to_json_dict())
    again = load_config(path, [], environ={})
    assert again.model_dump(exclude={"config_path"}) == cfg.model_dump(exclude={"config_path"})
    assert again.config_path == path


def test_schema_lists_every_section():
    schema = TrainConfig.model_json_schema()
    for section in ("policy", "dataset", "optimizer", "scheduler", "checkpoint", "logging", "validation"):
        assert section in schema["properties"]


@pytest.mark.parametrize("key", ["policy.tokenizer_path", "policy.pretrained_path"])
def test_an_empty_path_is_refused_in_one_line_rather_than_read_as_the_working_directory(key, tmp_path):
    """`--policy.tokenizer_path=` (often an unset shell variable) would otherwise become '.', then a multi-line
    tokenizer error (or a model search in the working directory): refused from the command line, a config file and
    the environment alike; null is how to say "not set"."""
    from conftest import run_cli_in_process

    section, field = key.split(".")
    config = write_json(tmp_path / "c.json", {**json.loads((EXAMPLES / "pi05_tiny_config.json").read_text()),
                                              "output_dir": str(tmp_path / "run")})
    env = f"OPENTAU_{section.upper()}__{field.upper()}"
    for args, environ in (([f"--{key}="], {}), ([f"--{key}= "], {}), ([], {env: ""})):
        result = run_cli_in_process(["config", "validate", str(config), *args], env=environ)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert key in line and "is empty" in line, line
    in_file = write_json(tmp_path / "empty.json", {section: {field: ""}})
    with pytest.raises(UserError) as err:
        load_config(in_file, [], environ={})
    assert str(err.value) == (f"Invalid config in {in_file}: {key}: is empty: give a local path or a Hugging Face repo "
                              "id (org/name), or leave it out (null) (got '')")
    assert getattr(load_config(None, [f"--{key}=null"], environ={}).policy, field) is None
    assert not (tmp_path / "run").exists()
