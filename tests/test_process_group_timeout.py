"""distributed.timeout_minutes reaches the process group torch creates, under DDP and DeepSpeed, and is what the
trainer asks Accelerate for with and without CUDA."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from opentau_cli.config import TrainConfig
from opentau_cli.config.accelerate import AccelerateSetup
from opentau_cli.train.trainer import process_group_kwargs

pytestmark = pytest.mark.full

DRIVER = Path(__file__).with_name("pg_timeout_driver.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_default_timeout_is_an_hour():
    assert TrainConfig().distributed.timeout_minutes == 60


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("backend", ["single", "ddp", "deepspeed"])
def test_every_backend_asks_for_the_configured_timeout_with_and_without_cuda(backend, cuda):
    cfg = TrainConfig(distributed={"timeout_minutes": 90})
    passed = process_group_kwargs(cfg, AccelerateSetup(backend=backend), cuda).to_kwargs()
    assert passed["timeout"] == timedelta(minutes=90)
    # On CUDA Accelerate picks nccl itself; only DeepSpeed without CUDA is told gloo ("CPU recipes").
    assert passed.get("backend") == ("gloo" if backend == "deepspeed" and not cuda else None)


@pytest.mark.parametrize("backend", ["ddp", "deepspeed"])
def test_the_timeout_reaches_the_process_group(backend):
    """A real 1-rank process group, created by Accelerate from the trainer's Accelerator: its gloo backend holds 37
    minutes (gloo's own default is 30, NCCL's 10)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    if backend == "deepspeed":
        env.update(DS_ACCELERATOR="cpu", ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2")
    done = subprocess.run([sys.executable, str(DRIVER), backend, "37"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PROCESS_GROUP_TIMEOUT_S=2220" in done.stdout.splitlines(), done.stdout


def test_the_plan_prints_the_timeout(isolated_env):
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app
    from conftest import EXAMPLES

    result = CliRunner().invoke(app, ["config", "validate", str(EXAMPLES / "pi05_tiny_config.json"),
                                      "--distributed.timeout_minutes=45", f"--output_dir={isolated_env / 'run'}"])
    assert result.exit_code == 0, result.output
    assert "distributed        hang timeout 45 min (distributed.timeout_minutes)" in result.stdout
