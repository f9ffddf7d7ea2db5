"""Elastic resume before launch: the global batch kept on the new number of processes, and the topology history."""

from __future__ import annotations

import pytest

from opentau_cli.errors import UserError
from opentau_cli.store.topology import describe_change, fit_global_batch, topologies, with_topology
from opentau_cli.train.reshard import sampler_position

pytestmark = pytest.mark.quick


def saved(batch, accum=1, micro=None):
    return {"batch_size": batch, "gradient_accumulation_steps": accum, "per_device_batch_size": micro or batch // accum}


@pytest.mark.parametrize("cfg,before,after,expected", [
    (saved(4), 2, 1, (8, 8, 1)),  # 2 -> 1: per-device batch doubles
    (saved(8), 1, 2, (4, 4, 1)),
    (saved(8, accum=2), 1, 2, (4, 2, 2)),  # accumulation kept where it divides
    (saved(12, accum=4), 1, 4, (3, 3, 1)),  # 3 does not divide by 4: per-device batch kept, accumulation 1
    (saved(12, accum=3, micro=4), 1, 6, (2, 2, 1)),  # neither divides: accumulation 1
    (saved(4, accum=2), 4, 2, (8, 4, 2)),
])
def test_global_batch_is_kept_on_the_new_number_of_processes(cfg, before, after, expected):
    got = fit_global_batch(cfg, before, after, {})
    assert (got["batch_size"], got["per_device_batch_size"], got["gradient_accumulation_steps"]) == expected
    assert got["batch_size"] * after == cfg["batch_size"] * before
    assert got["per_device_batch_size"] * got["gradient_accumulation_steps"] == got["batch_size"]


def test_a_global_batch_that_does_not_divide_is_refused_naming_the_process_counts_that_do():
    with pytest.raises(UserError, match=r"global batch \(8 = 4 per process x 2 processes\) does not divide over 3 "
                                        r"processes: resume with one of 1, 2, 4, 8 processes"):
        fit_global_batch(saved(4), 2, 3, {})


def test_explicit_batch_flags_are_kept_or_refused():
    got = fit_global_batch(saved(4), 2, 1, {"gradient_accumulation_steps": 4})
    assert (got["per_device_batch_size"], got["gradient_accumulation_steps"]) == (2, 4)
    with pytest.raises(UserError, match="accumulation = 8; --per_device_batch_size=3 does not fit it"):
        fit_global_batch(saved(4), 2, 1, {"per_device_batch_size": 3})
    with pytest.raises(UserError, match="accumulation = 8; --per_device_batch_size=2 x --gradient_accumulation_steps=2 "):
        fit_global_batch(saved(4), 2, 1, {"per_device_batch_size": 2, "gradient_accumulation_steps": 2})
    with pytest.raises(UserError, match="--batch_size=4 would change the checkpoint's global batch of 8"):
        fit_global_batch(saved(4), 2, 1, {"batch_size": 4})


def test_topology_history_reads_old_checkpoints_and_appends_only_changes():
    old = {"world_size": 2, "backend": "ddp", "zero_stage": None, "accelerate": {"num_machines": 1}}
    history = topologies(old)
    assert history == [{"step": 0, "world_size": 2, "backend": "ddp", "zero_stage": None, "per_device_batch": None,
                        "grad_accum": None, "machines": 1}]
    same = {"step": 40, "world_size": 2, "backend": "ddp", "zero_stage": None, "per_device_batch": 4, "grad_accum": 1,
            "machines": 1}
    assert with_topology(history, same) == history
    moved = dict(same, world_size=1, per_device_batch=8)
    assert with_topology(history, moved) == [*history, moved]
    assert with_topology([*history, moved], dict(moved, step=60)) == [*history, moved]


def test_reshard_flag_needs_a_resume_and_a_boolean(tmp_path):
    from conftest import EXAMPLES, run_cli_in_process

    base = ["train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={tmp_path / 'run'}"]
    env = {"HF_HOME": str(tmp_path / "hf_home")}
    fresh = run_cli_in_process([*base, "--reshard=true"], env=env)
    assert fresh.returncode == 2 and "--reshard=true applies to a resume: pass it with --resume=true" in fresh.stderr, fresh.stderr
    bad = run_cli_in_process([*base, "--reshard=maybe"], env=env)
    assert bad.returncode == 2 and "--reshard takes true or false, not 'maybe'" in bad.stderr, bad.stderr
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_without_a_recorded_position_resumes_at_its_batches_times_its_global_micro_batch():
    state = {"world_size": 2, "sampler": {"epoch": 1, "batch": 6}}
    assert sampler_position(state, saved(8, accum=2)) == {"epoch": 1, "batch": 6, "position": 6 * 4 * 2}


def test_the_change_is_described_in_one_line():
    before = {"world_size": 16, "backend": "deepspeed", "zero_stage": 3, "per_device_batch": 2, "grad_accum": 1, "machines": 2}
    after = {"world_size": 8, "backend": "ddp", "zero_stage": None, "per_device_batch": 2, "grad_accum": 2, "machines": 1}
    assert describe_change(before, after) == (
        "Elastic resume: 16 processes on 2 machines under ZeRO-3 -> 8 processes on 1 machine under ddp; per-device batch "
        "2 x accumulation 1 -> per-device batch 2 x accumulation 2 (global batch kept); the data continues at its "
        "global sample position.")
