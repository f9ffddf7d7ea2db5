"""`opentau profile` end to end: the real CLI, the real launcher, the tiny preset on the demo data."""

from __future__ import annotations

import json

import pytest

from conftest import EXAMPLES, run_cli
from opentau_cli.errors import UserError
from opentau_cli.profiling.run import parse_size

TINY = str(EXAMPLES / "pi05_tiny_config.json")


def test_dataloader_only_measures_samples_per_s_without_importing_the_policy(isolated_env):
    out = isolated_env / "dl.json"
    r = run_cli(["profile", f"--config_path={TINY}", "--dataloader-only", "--steps", "6", "--warmup", "1", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    assert "samples/s (ceiling)" in r.stdout
    report = json.loads(out.read_text())
    assert report["mode"] == "dataloader_only"
    assert report["model_built"] is False and report["policy_imported"] is False
    assert report["measured_batches"] == 6 and report["batch_size"] == 8
    assert report["samples_per_s"] == pytest.approx(report["batches_per_s"] * 8)
    assert report["samples_per_s"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataloader-only", "--compare", "a.yaml,b.yaml"], "cannot be combined with --compare"),
        (["--find-max-batch"], "needs --memory-limit"),
        (["--compare", "missing.yaml"], "'missing.yaml' (in --compare) not found"),
        (["--memory-limit", "4GB"], "--memory-limit applies to --find-max-batch only"),
        (["--find-max-batch", "--memory-limit", "lots"], "is not a size"),
        (["--steps", "3", "--policy.chunk_sise=4"], "did you mean 'policy.chunk_size'"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(isolated_env, args, message):
    r = run_cli(["profile", f"--config_path={TINY}", *args], cwd=isolated_env)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert list(isolated_env.glob("outputs*")) == []


def test_memory_sizes_parse_as_powers_of_1024():
    assert parse_size("8GB") == 8 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5g") == int(1.5 * (1 << 30))
    with pytest.raises(UserError):
        parse_size("1MB")
