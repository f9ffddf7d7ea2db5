"""Elastic resume end to end through the installed CLI: a 2-process DDP run on the demo data, continued from its
step-3 checkpoint on 1 process (--reshard=true), then from the step-6 checkpoint that the 1-process launch wrote on
2 processes under ZeRO-2.

Three launches, shared by every assertion (module-scoped). Each launch records the training frames it reads
(tests/sample_hook), so the samples before plus after each resume are compared with the uninterrupted run's, step
by step.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import EXAMPLES, run_cli
from opentau_cli.checkpoint.layout import CHECKPOINTS, METRICS, TRAINING_STATE

pytestmark = pytest.mark.e2e

TINY = str(EXAMPLES / "pi05_tiny_config.json")
DDP = str(EXAMPLES / "accelerate_cpu_ddp_config.yaml")
ZERO2 = str(EXAMPLES / "accelerate_cpu_deepspeed_config.yaml")
SAMPLE_HOOK = Path(__file__).parent / "sample_hook"
STEPS, GLOBAL_BATCH = 9, 8
SINGLE_YAML = "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\nnum_machines: 1\nmixed_precision: 'no'\n"


def _losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("kind") == "train"}


def _steps_read(record_dir: Path, ranks: int, per_device: int, first_step: int) -> dict[int, list[int]]:
    """Frames read per optimizer step (all ranks together, sorted: order within a step does not change the update)."""
    per_rank = [[int(x) for x in (record_dir / f"rank{r}.txt").read_text().split()] for r in range(ranks)]
    steps = len(per_rank[0]) // per_device
    assert all(len(p) == steps * per_device for p in per_rank)
    return {first_step + s: sorted(i for p in per_rank for i in p[s * per_device:(s + 1) * per_device]) for s in range(steps)}


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


class Runs:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.cache = tmp / "cache"
        single = tmp / "single.yaml"
        single.write_text(SINGLE_YAML)
        self.ref = tmp / "ref"
        _ok(self.cli(["train", f"--config_path={TINY}", f"--output_dir={self.ref}", f"--accelerate-config={DDP}",
                      "--steps", str(STEPS), "--save_freq", "3", "--log_freq", "1", "--batch_size", "4",
                      "--scheduler.warmup_steps", "2", "--scheduler.decay_steps", str(STEPS)], "ref"))
        self.run = tmp / "elastic"
        shutil.copytree(self.ref, self.run, symlinks=True)
        for late in ("000006", "000009"):
            shutil.rmtree(self.run / CHECKPOINTS / late)
        (self.run / CHECKPOINTS / "last").unlink()
        os.symlink("000003", self.run / CHECKPOINTS / "last")
        self.refused = self.cli(["resume", str(self.run), f"--accelerate-config={single}", "--steps", "6"], "refused")
        self.to_one = _ok(self.cli(["resume", str(self.run), "--reshard=true", f"--accelerate-config={single}",
                                    "--steps", "6"], "to_one"))
        self.to_zero2 = _ok(self.cli(["resume", str(self.run), "--reshard=true", f"--accelerate-config={ZERO2}",
                                      "--steps", str(STEPS)], "to_zero2"))

    def cli(self, args: list[str], record: str):
        out = self.tmp / "samples" / record
        out.mkdir(parents=True)
        env = {"HF_HOME": str(self.tmp / "hf_home"), "OPENTAU_CACHE_DIR": str(self.cache),
               "PYTHONPATH": os.pathsep.join([str(SAMPLE_HOOK), os.environ.get("PYTHONPATH", "")]),
               "TEST_RECORD_SAMPLES": str(out)}
        return run_cli(args, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("reshard_e2e"))


def test_resume_on_another_world_size_without_reshard_is_refused_naming_the_flag(runs):
    assert runs.refused.returncode == 2
    assert "--reshard=true" in runs.refused.stderr and "Traceback" not in runs.refused.stderr
    assert not list((runs.tmp / "samples" / "refused").iterdir())  # nothing launched


def test_resharded_runs_read_exactly_the_uninterrupted_runs_samples(runs):
    samples = runs.tmp / "samples"
    reference = _steps_read(samples / "ref", 2, 4, 1)
    assert sorted(reference) == list(range(1, STEPS + 1))
    got = {s: reference[s] for s in (1, 2, 3)}
    one = _steps_read(samples / "to_one", 1, 8, 4)
    zero2 = _steps_read(samples / "to_zero2", 2, 4, 7)
    assert sorted(one) == [4, 5, 6] and sorted(zero2) == [7, 8, 9]
    for part in (one, zero2):
        got.update(part)
    assert got == reference
    assert all(len(reference[s]) == GLOBAL_BATCH for s in reference)


def test_resume_prints_what_changed(runs):
    text = runs.to_one.stderr
    assert "Elastic resume: 2 processes on 1 machine under ddp -> 1 process on 1 machine under single" in text
    assert "per-device batch 4 x accumulation 1 -> per-device batch 8 x accumulation 1" in text
    assert "under single -> 2 processes on 1 machine under ZeRO-2" in runs.to_zero2.stderr


def test_resharded_losses_match_the_uninterrupted_run_within_noise(runs):
    ref, got = _losses(runs.ref), _losses(runs.run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in (1, 2, 3):
        assert got[step] == ref[step]  # before the first resume: the same records
    # After a resume on another world size the ranks draw other flow-matching noise and times (per-rank streams
    # derived from (seed, step, rank)), so a step's loss differs from the uninterrupted run's by that noise alone.
    # On this tiny model one step's loss moves by up to ~20% with the noise (the reference's own steps 1-3 spread
    # 1.56-1.91), hence 30% per step; the mean over the six resumed steps averages it down, hence 10%. Exactness of
    # weights and optimizer state is held bit for bit elsewhere (test_reshard.py; the worker checks it after loading).
    for step in range(4, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=0.3), step
    mean = lambda d: sum(d[s] for s in range(4, STEPS + 1)) / (STEPS - 3)  # noqa: E731
    assert mean(got) == pytest.approx(mean(ref), rel=0.1)


def test_the_resharded_runs_checkpoints_are_ordinary_checkpoints_with_their_topology_history(runs):
    last = runs.run / CHECKPOINTS / "000009"
    state = json.loads((last / TRAINING_STATE).read_text())
    assert state["world_size"] == 2 and state["backend"] == "deepspeed" and state["zero_stage"] == 2
    assert [(t["step"], t["world_size"], t["backend"], t["per_device_batch"]) for t in state["topologies"]] == [
        (0, 2, "ddp", 4), (3, 1, "single", 8), (6, 2, "deepspeed", 4)]
    assert state["samples_seen"] == STEPS * GLOBAL_BATCH
    consolidated = run_cli(["checkpoint", "consolidate", str(last)], env={"HF_HOME": str(runs.tmp / "hf_home")})
    assert consolidated.returncode == 0 and (last / "model.safetensors").is_file(), consolidated.stderr
    verify = run_cli(["checkpoint", "verify", str(last)], env={"HF_HOME": str(runs.tmp / "hf_home")})
    assert verify.returncode == 0, verify.stdout + verify.stderr  # consolidate listed its output in the manifest
    # A plain resume under the launch that wrote it passes every check (manifest, pickles, topology) like any
    # checkpoint's; the run is at its last step, so nothing is launched.
    env = {"HF_HOME": str(runs.tmp / "hf_home"), "OPENTAU_CACHE_DIR": str(runs.cache)}
    again = run_cli(["resume", str(runs.run)], env=env)
    assert again.returncode == 0 and "Nothing to do" in again.stderr and "Elastic" not in again.stderr, again.stderr


def test_config_validate_checks_an_elastic_resume_without_launching(runs):
    ckpt = runs.ref / CHECKPOINTS / "000003"
    args = ["config", "validate", str(ckpt / "train_config.json"), "--resume=true", f"--accelerate-config={runs.tmp / 'single.yaml'}"]
    env = {"HF_HOME": str(runs.tmp / "hf_home"), "OPENTAU_CACHE_DIR": str(runs.cache)}
    plain = run_cli(args, env=env)
    assert plain.returncode == 2 and "--reshard=true" in plain.stderr, plain.stderr
    elastic = run_cli([*args, "--reshard=true"], env=env)
    assert elastic.returncode == 0 and "8 = 8 per device x 1 accumulation x 1 processes" in elastic.stdout, elastic.stderr
    assert "per-device batch 4 x accumulation 1 -> per-device batch 8 x accumulation 1" in elastic.stderr
    odd = run_cli([*args, "--reshard=true", "--gradient_accumulation_steps=3"], env=env)
    assert odd.returncode == 2 and "--gradient_accumulation_steps=3 does not fit it" in odd.stderr, odd.stderr
