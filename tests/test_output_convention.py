"""What a command tells and writes, through the installed CLI: the one output convention (export, consolidate, eval,
dataset synth: missing parents made, a non-empty target refused unless --force and an earlier output of the same
command, published whole; overlaps with runs: tests/test_output_overlap.py), file modes that
follow the umask, and the 8-GPU example YAMLs refused on a machine without CUDA. What a umask governs runs in a child
process (the umask is set there only); the refusals and --force replacements run in-process (they launch nothing)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import EXAMPLES, opentau_bin, run_cli, run_cli_in_process
from opentau_cli.store.layout import CHECKPOINTS, LAST, MODEL_WEIGHTS
from opentau_cli.store.outputs import MARKER

pytestmark = pytest.mark.full

TINY = str(EXAMPLES / "pi05_tiny_config.json")
GPU_YAMLS = ["accelerate_ddp_config.yaml", "accelerate_deepspeed_config.yaml", "accelerate_deepspeed_zero3_config.yaml"]
CPU_YAMLS = ["accelerate_cpu_ddp_config.yaml", "accelerate_cpu_deepspeed_config.yaml", "accelerate_cpu_deepspeed_zero3_config.yaml"]
UMASK = 0o027  # not the usual 022: a mode that merely happens to be 0644 does not pass


def _refused(result, *needles: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def _with_umask(args: list[str], **kw) -> subprocess.CompletedProcess:
    """The installed CLI under UMASK (set in the child only)."""
    env = {**os.environ, **kw.pop("env", {})}
    env.pop("OPENTAU_DEBUG", None)
    return subprocess.run([opentau_bin(), *args], env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=lambda: os.umask(UMASK), **kw)


def _modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- 8-GPU YAMLs on a machine without CUDA


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_the_8_gpu_yamls_are_refused_without_cuda_naming_the_cpu_yamls_which_still_run(tmp_path):
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app

    out = tmp_path / "run"

    def validate(yaml: Path, gpus: int):
        result = CliRunner().invoke(app, ["config", "validate", TINY, f"--accelerate-config={yaml}", f"--output_dir={out}",
                                          "--gpus", str(gpus)])
        return subprocess.CompletedProcess([], result.exit_code, result.stdout, result.stderr)

    for name in GPU_YAMLS:
        yaml = EXAMPLES / name
        _refused(validate(yaml, 0), f"{yaml} is for GPUs (", "accelerate_cpu_ddp_config.yaml")
        assert validate(yaml, 8).returncode == 0
    for name in CPU_YAMLS:
        assert validate(EXAMPLES / name, 0).returncode == 0
    if not _has_cuda():  # `train` checks the machine it runs on: the installed CLI, as a user runs it
        ddp8 = EXAMPLES / GPU_YAMLS[0]
        _refused(run_cli(["train", f"--config_path={TINY}", f"--accelerate-config={ddp8}", f"--output_dir={out}"]),
                 f"{ddp8} is for GPUs (distributed_type: MULTI_GPU), and none is visible on this machine")
    assert not out.exists()  # nothing launched, nothing written


# ---------------------------------------------------------------- dataset synth


def test_dataset_synth_makes_parents_refuses_a_used_target_and_replaces_it_with_force(tmp_path):
    target = tmp_path / "new" / "parents" / "reach"
    made = _with_umask(["dataset", "synth", str(target), "--episodes", "2", "--steps-per-episode", "4"])
    assert made.returncode == 0, made.stderr
    assert (target / "meta" / "info.json").is_file()
    assert set(_modes(target).values()) == {0o666 & ~UMASK}
    assert not [p.name for p in target.parent.iterdir() if p.name != "reach"]  # no temp sibling left

    before = (target / "meta" / "info.json").read_text()
    _refused(run_cli_in_process(["dataset", "synth", str(target), "--episodes", "3"]),
             f"{target} already exists and is not empty: choose a new path, or pass --force to replace this earlier "
             "output of `opentau dataset synth`.")
    assert (target / "meta" / "info.json").read_text() == before

    again = run_cli_in_process(["dataset", "synth", str(target), "--episodes", "3", "--steps-per-episode", "4", "--force"])
    assert again.returncode == 0, again.stderr
    assert json.loads((target / "meta" / "info.json").read_text())["total_episodes"] == 3
    assert sorted(p.name for p in target.parent.iterdir()) == ["reach"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli_in_process(["dataset", "synth", str(empty), "--episodes", "1", "--steps-per-episode", "4"]).returncode == 0


def test_a_write_that_fails_midway_leaves_no_temp_sibling_no_parents_it_made_and_the_old_target_intact(tmp_path):
    from opentau_cli.store.outputs import publishing

    target = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with publishing(target, force=False) as staging:
            staging.mkdir()
            (staging / "half.bin").write_bytes(b"x")
            raise RuntimeError("disk gone")
    assert list(tmp_path.iterdir()) == []

    old = tmp_path / "old"  # an earlier output of the same command: the only thing --force replaces
    with publishing(old, force=False, command="dataset synth") as staging:
        staging.mkdir()
        (staging / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        with publishing(old, force=True, command="dataset synth") as staging:
            staging.mkdir()
            raise RuntimeError("killed")
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and (old / "keep.txt").read_text() == "mine"


# ---------------------------------------------------------------- a checkpoint, its export and its evaluation


@pytest.fixture(scope="module")
def run_under_umask(tmp_path_factory):
    """A 2-step single-process tiny run written under UMASK."""
    root = tmp_path_factory.mktemp("umask")
    run = root / "run"
    trained = _with_umask(["train", f"--config_path={TINY}", f"--output_dir={run}", "--steps=2", "--save_freq=2",
                           "--log_freq=1", "--validation.val_freq=0"], env={"HF_HOME": str(root / "hf_home")})
    assert trained.returncode == 0, trained.stderr[-3000:]
    return run


def test_every_file_of_a_checkpoint_follows_the_umask(run_under_umask):
    ckpt = run_under_umask / CHECKPOINTS / LAST
    modes = _modes(ckpt.resolve())
    assert MODEL_WEIGHTS in modes  # written by safetensors' save_file, which makes 0600 files
    assert modes == {name: 0o666 & ~UMASK for name in modes}


def test_export_makes_parents_follows_the_umask_refuses_a_used_target_and_replaces_it_with_force(run_under_umask, tmp_path):
    out = tmp_path / "exported" / "nested" / "lerobot"
    made = _with_umask(["checkpoint", "export", str(run_under_umask), "--output", str(out), "--layout", "lerobot"])
    assert made.returncode == 0, made.stderr
    modes = _modes(out)
    assert any(name.endswith("normalizer_processor.safetensors") for name in modes)  # LeRobot's, via save_file too
    assert modes == {name: 0o666 & ~UMASK for name in modes}
    assert sorted(p.name for p in out.parent.iterdir()) == ["lerobot"]  # no temp sibling left

    weights = (out / MODEL_WEIGHTS).read_bytes()
    _refused(run_cli_in_process(["checkpoint", "export", str(run_under_umask), "--output", str(out), "--layout", "openpi"]),
             f"{out} already exists and is not empty: choose a new path, or pass --force to replace this earlier output of ")
    assert (out / MODEL_WEIGHTS).read_bytes() == weights and not list(out.glob("assets"))
    forced = run_cli_in_process(["checkpoint", "export", str(run_under_umask), "--output", str(out), "--layout", "openpi", "--force"])
    assert forced.returncode == 0, forced.stderr
    assert list(out.glob("assets/*/norm_stats.json")) and not list(out.glob("*normalizer_processor.safetensors"))
    assert sorted(p.name for p in out.parent.iterdir()) == ["lerobot"]


def test_eval_output_makes_parents_refuses_a_used_target_and_replaces_it_with_force(run_under_umask, tmp_path):
    out = tmp_path / "evals" / "nested" / "tiny"
    args = ["eval", str(run_under_umask), "--episodes", "0", "--stride", "25", "--plot-episodes", "0", "--device", "cpu"]
    made = run_cli_in_process([*args, "--output", str(out)])
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "eval.json"]  # the marker: --force replaces only this
    _refused(run_cli_in_process([*args, "--output", str(out)]),
             f"{out} already exists and is not empty: choose a new path, or pass --force to replace this earlier output of ")
    forced = run_cli_in_process([*args, "--output", str(out), "--force"])
    assert forced.returncode == 0, forced.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]
