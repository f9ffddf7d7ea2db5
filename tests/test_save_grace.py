"""The save a stop signal starts, checked against the grace the signal leaves before launch (plan/save_time.py):
SLURM's --signal as sbatch takes it (SBATCH_SIGNAL, the batch script's #SBATCH lines), checkpoint.save_grace_seconds,
and the one warning `config validate` prints naming both numbers. tests/test_slurm.py submits a real job."""

from __future__ import annotations

import pytest

from conftest import EXAMPLES, run_cli_in_process
from opentau_cli.config import load_config
from opentau_cli.config.scheduler import script_signal, signal_seconds

pytestmark = pytest.mark.quick

TINY = str(EXAMPLES / "pi05_tiny_config.json")
DDP = str(EXAMPLES / "accelerate_ddp_config.yaml")
# The tiny preset's data and tokenizer with pi05's full architecture (random weights): a checkpoint of tens of GB,
# planned on the meta device for a machine with 8 GPUs.
BIG = [TINY, "--accelerate-config", DDP, "--gpus", "8", "--policy.preset=pi05", "--policy.image_resolution=[224,224]"]
WRITE, UPLOAD = 170e6, 50e6  # the rates docs and BENCHMARKS.md give: 170 MB/s to disk, 50 MB/s to the store


@pytest.mark.parametrize("text, seconds", [("B:USR1@300", 300), ("USR1@60", 60), ("@90", 90), ("SIGUSR1@45", 45),
                                           ("RB:10@120", 120), ("USR1", 60)])
def test_an_sbatch_signal_gives_its_seconds_before_the_time_limit(text, seconds):
    assert signal_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "B:", "USR1@", "@x", "B:USR1@3O0"])
def test_a_value_that_is_no_signal_gives_none(text):
    assert signal_seconds(text) is None


def test_the_batch_scripts_last_signal_line_before_its_first_command_is_the_one_sbatch_takes():
    script = ("#!/bin/bash\n#SBATCH --time=1:00:00\n#SBATCH --signal=B:USR1@300\n\n"
              "#SBATCH --nodes=1 --signal USR2@90  # the later one wins\n"
              "set -e\n#SBATCH --signal=@999\n")
    assert script_signal(script) == "USR2@90"
    assert script_signal("#!/bin/bash\n#SBATCH --time=1:00:00\nopentau train\n") is None
    for example in sorted(EXAMPLES.glob("*.sbatch")):  # every example gives its --signal in the script
        assert script_signal(example.read_text()) == "B:USR1@300", example.name


def big_checkpoint_bytes() -> int:
    """What a checkpoint of BIG holds, counted from the built policy: fp32 weights and AdamW's two fp32 moments of
    what trains (DDP, no EMA)."""
    from opentau_cli.policies import count_parameters

    counts = count_parameters(load_config(TINY, BIG[5:], environ={}).policy)
    return 4 * counts["total"] + 8 * counts["trainable"]


def test_a_save_longer_than_the_stated_grace_is_one_warning_naming_both_numbers(isolated_env):
    result = run_cli_in_process(["config", "validate", *BIG, f"--output_dir={isolated_env / 'run'}",
                                 "--checkpoint.save_grace_seconds=60"])
    assert result.returncode == 0, result.stderr
    nbytes = big_checkpoint_bytes()
    lines = [line for line in result.stderr.splitlines() if "A checkpoint of" in line]
    assert len(lines) == 1
    assert (f"A checkpoint of {nbytes / 1e9:.1f} GB may take ~{nbytes / WRITE:.0f} s to save (at 170 MB/s to disk), "
            "more than the 60 s checkpoint.save_grace_seconds gives before the job is killed: give the job a longer "
            "grace (and checkpoint.save_grace_seconds with it).") in lines[0]


def test_slurms_signal_time_counts_the_upload_and_names_the_drain_that_would_cut_it(isolated_env):
    store = isolated_env / "store"
    result = run_cli_in_process(["config", "validate", *BIG, f"--output_dir={isolated_env / 'run'}",
                                 f"--checkpoint.remote=file://{store}"],
                                env={"SLURM_JOB_ID": "4711", "SBATCH_SIGNAL": "B:USR1@300"})
    assert result.returncode == 0, result.stderr
    nbytes = big_checkpoint_bytes()
    needed = nbytes / WRITE + nbytes / UPLOAD
    assert (f"A checkpoint of {nbytes / 1e9:.1f} GB may take ~{needed:.0f} s to save and upload (at 170 MB/s to "
            f"disk, 50 MB/s to file://{store}), more than the 300 s SBATCH_SIGNAL=B:USR1@300 gives before the job is "
            f"killed: raise it (--signal=B:USR1@{int(needed * 1.5) + 30}), and checkpoint.remote_drain_seconds=60 "
            f"above the upload's ~{nbytes / UPLOAD:.0f} s.") in result.stderr


def test_a_save_that_fits_the_grace_says_nothing(isolated_env):
    result = run_cli_in_process(["config", "validate", TINY, f"--output_dir={isolated_env / 'run'}",
                                 "--checkpoint.save_grace_seconds=60"])
    assert result.returncode == 0, result.stderr
    assert "A checkpoint of" not in result.stderr


def test_a_resume_counts_the_bytes_of_the_checkpoint_it_continues(tmp_path):
    from opentau_cli.config import resolve_accelerate_config
    from opentau_cli.plan.save_time import check_save_grace

    ckpt = tmp_path / "run" / "checkpoints" / "000100"
    (ckpt / "model").mkdir(parents=True)
    with open(ckpt / "model" / "model.safetensors", "wb") as f:  # sparse: 3.4 GB apparent, nothing on disk
        f.truncate(3_400_000_000)
    (ckpt / "training_state.json").write_text("{}")  # 2 bytes
    cfg = load_config(TINY, ["--checkpoint.save_grace_seconds=10"], environ={})
    setup = resolve_accelerate_config(DDP)
    nbytes = 3_400_000_002
    assert check_save_grace(cfg, setup, ckpt) == [
        f"A checkpoint of 3.4 GB (as 000100, which this resumes) may take ~{nbytes / WRITE:.0f} s to save (at 170 MB/s "
        "to disk), more than the 10 s checkpoint.save_grace_seconds gives before the job is killed: give the job a "
        "longer grace (and checkpoint.save_grace_seconds with it)."]
    assert check_save_grace(cfg, setup) == []  # the tiny preset's own checkpoint saves well within 10 s
