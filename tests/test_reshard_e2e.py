"""Elastic resume end to end through the installed CLI: a 2-process DDP run on the demo data, continued from its
step-3 checkpoint on 2 processes under ZeRO-2 (a backend change alone, --reshard=true), then from the step-6
checkpoint that launch wrote on 1 process.

Four launches (the uninterrupted reference, a refusal, two resumes), shared by every assertion (module-scoped). Each
launch records the training frames it reads (tests/hooks), so the samples before plus after each resume are
compared with the uninterrupted run's, step by step.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES, own_cache, run_cli, run_cli_in_process
from opentau_cli.store.layout import CHECKPOINTS, METRICS, MODEL_WEIGHTS, TRAIN_CONFIG, TRAINING_STATE

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
DDP = str(EXAMPLES / "accelerate_cpu_ddp_config.yaml")
ZERO2 = str(EXAMPLES / "accelerate_cpu_deepspeed_config.yaml")
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
STEPS, GLOBAL_BATCH = 9, 8
SINGLE_YAML = "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\nnum_machines: 1\nmixed_precision: 'no'\n"


STALE = -1.0  # no real loss: marks the records the copied run holds past its checkpoint


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir) if r.get("kind") == "train"}


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
        # The copy's records past step 3 get a loss no run logs: the resumes must replace them with their own.
        lines = [json.dumps({**r, "loss": STALE} if r.get("step", 0) > 3 and "loss" in r else r) for r in _records(self.run)]
        (self.run / METRICS).write_text("".join(line + "\n" for line in lines))
        # In-process (it stops at its checks); a launch it made would still start workers with the sample hook.
        self.refused = self.cli(["resume", str(self.run), f"--accelerate-config={ZERO2}", "--steps", "6"], "refused",
                                in_process=True)
        self.to_zero2 = _ok(self.cli(["resume", str(self.run), "--reshard=true", f"--accelerate-config={ZERO2}",
                                      "--steps", "6"], "to_zero2"))
        self.to_one = _ok(self.cli(["resume", str(self.run), "--reshard=true", f"--accelerate-config={single}",
                                    "--steps", str(STEPS)], "to_one"))

    def cli(self, args: list[str], record: str, in_process: bool = False):
        out = self.tmp / "samples" / record
        out.mkdir(parents=True)
        env = {"HF_HOME": str(self.tmp / "hf_home"), "OPENTAU_CACHE_DIR": own_cache(self.cache),
               "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
               "TEST_RECORD_SAMPLES": str(out)}
        return (run_cli_in_process if in_process else run_cli)(args, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("reshard_e2e"))


def test_resume_under_another_backend_without_reshard_is_refused_naming_the_flag(runs):
    assert runs.refused.returncode == 2
    assert "--reshard=true" in runs.refused.stderr and "Traceback" not in runs.refused.stderr
    assert not list((runs.tmp / "samples" / "refused").iterdir())  # nothing launched


def test_resharded_runs_read_exactly_the_uninterrupted_runs_samples(runs):
    samples = runs.tmp / "samples"
    reference = _steps_read(samples / "ref", 2, 4, 1)
    assert sorted(reference) == list(range(1, STEPS + 1))
    got = {s: reference[s] for s in (1, 2, 3)}
    zero2 = _steps_read(samples / "to_zero2", 2, 4, 4)
    one = _steps_read(samples / "to_one", 1, 8, 7)
    assert sorted(zero2) == [4, 5, 6] and sorted(one) == [7, 8, 9]
    for part in (zero2, one):
        got.update(part)
    assert got == reference
    assert all(len(reference[s]) == GLOBAL_BATCH for s in reference)


def test_resume_prints_what_changed(runs):
    assert "Elastic resume: 2 processes on 1 machine under ddp -> 2 processes on 1 machine under ZeRO-2" in runs.to_zero2.stderr
    text = runs.to_one.stderr
    assert "under ZeRO-2 -> 1 process on 1 machine under single" in text
    assert "per-device batch 4 x accumulation 1 -> per-device batch 8 x accumulation 1" in text


def test_the_resumed_steps_are_logged_by_the_resumed_launches(runs):
    train = [r for r in _records(runs.run) if r.get("kind") == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # each step once: the stale records were dropped
    assert STALE not in (r["loss"] for r in train)


def test_a_backend_change_alone_continues_with_the_uninterrupted_losses(runs):
    """2 processes under DDP -> 2 under ZeRO-2: every rank continues its own random streams on the same samples from
    bit-exact weights and AdamW state, so the losses are the uninterrupted run's up to the reduction order."""
    ref, got = _losses(runs.ref), _losses(runs.run)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=0), step


def loss_noise(ckpt: Path, frames: list[int], cache: Path, monkeypatch, draws: int = 16) -> float:
    """The standard deviation of the training loss of `ckpt`'s policy on the batch of `frames` over `draws` draws of
    the flow-matching noise and times: how much a step's loss moves when only those random draws differ."""
    from safetensors.torch import load_file

    from opentau_cli.config import load_config
    from opentau_cli.data.build import make_dataset, split_episodes
    from opentau_cli.data.hub import dataset_root
    from opentau_cli.data.sampler import collate
    from opentau_cli.policies import build_policy

    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(cache))
    cfg = load_config(ckpt / TRAIN_CONFIG, {})
    policy = build_policy(cfg.policy)
    policy.load_state_dict(load_file(str(ckpt / MODEL_WEIGHTS)))
    (member,) = cfg.dataset.members()
    root = dataset_root(member, cfg.dataset.num_cameras)
    data = make_dataset(cfg, member, root, split_episodes(root, cfg.validation.val_split, cfg.seed, member.episodes)[0])
    batch = collate([data[i] for i in frames])
    losses = []
    for seed in range(draws):
        torch.manual_seed(seed)
        with torch.no_grad():
            losses.append(float(policy(batch)["loss"]))
    return float(torch.tensor(losses).std())


def test_a_world_size_change_continues_with_the_uninterrupted_losses_within_the_measured_noise(runs, monkeypatch):
    """2 processes -> 1: the new rank draws its own noise and times (a stream derived from (seed, step, rank)), so
    the first resumed step differs from the uninterrupted run's by those draws alone (same weights, same samples).
    Their effect is measured here on that step's batch with the step-6 weights, and each resumed step must lie
    within 5 standard deviations of it (the difference of two draws has sqrt(2) of one)."""
    ref, got = _losses(runs.ref), _losses(runs.run)
    frames = _steps_read(runs.tmp / "samples" / "ref", 2, 4, 1)[7]
    sigma = loss_noise(runs.ref / CHECKPOINTS / "000006", frames, runs.cache, monkeypatch)
    print(f"measured noise of the step-7 loss over 16 draws: {sigma:.4g} (loss {ref[7]:.4g})")
    assert 0 < sigma < 0.5 * ref[7]  # the noise is real and far from the loss itself (the exact check: the test above)
    for step in (7, 8, 9):
        assert abs(got[step] - ref[step]) <= 5 * sigma, (step, got[step], ref[step], sigma)


def test_the_first_step_after_a_world_size_change_is_the_loss_of_the_checkpoints_exact_state(runs, monkeypatch):
    """2 processes under ZeRO-2 -> 1: the resumed launch's first loss (step 7) equals, bit for bit, the loss computed
    here from the step-6 checkpoint's fp32 master weights as DeepSpeed's own zero_to_fp32 reads them, on the frames the
    launch read for that step, with the new rank's noise stream (numpy's SeedSequence of (seed, step, rank), as
    docs/ARCHITECTURE.md documents it): the weights arrive exactly after resharding, and only the draws differ from
    the uninterrupted run (whose step-7 loss lies within the measured noise of these draws: the next test)."""
    import ds_ckpt_helper
    import numpy as np

    ckpt = runs.run / CHECKPOINTS / "000006"  # written by the ZeRO-2 launch
    out = runs.tmp / "zero_to_fp32_000006"
    ds_ckpt_helper.run_zero_to_fp32([(ckpt, out)])
    weights = ds_ckpt_helper.zero_to_fp32_output(out)
    frames = [int(x) for x in (runs.tmp / "samples" / "to_one" / "rank0.txt").read_text().split()][:8]  # in read order
    assert sorted(frames) == _steps_read(runs.tmp / "samples" / "to_one", 1, 8, 7)[7]
    cfg_seed = json.loads((ckpt / TRAIN_CONFIG).read_text())["seed"]
    seed = int(np.random.SeedSequence([cfg_seed, 6, 0]).generate_state(1)[0])
    assert first_step_loss(ckpt, weights, frames, runs.cache, monkeypatch, seed) == _losses(runs.run)[7]


def first_step_loss(ckpt: Path, weights: dict, frames: list[int], cache: Path, monkeypatch, seed: int) -> float:
    """The training loss of `ckpt`'s policy holding `weights` on the batch of `frames`, with torch seeded `seed`."""
    from opentau_cli.config import load_config
    from opentau_cli.data.build import make_dataset, split_episodes
    from opentau_cli.data.hub import dataset_root
    from opentau_cli.data.sampler import collate
    from opentau_cli.policies import build_policy

    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(cache))
    cfg = load_config(ckpt / TRAIN_CONFIG, {})
    policy = build_policy(cfg.policy)
    missing, unexpected = policy.load_state_dict(weights, strict=False)
    assert not unexpected and all(not p.requires_grad for n, p in policy.named_parameters() if n in missing)
    (member,) = cfg.dataset.members()
    root = dataset_root(member, cfg.dataset.num_cameras)
    data = make_dataset(cfg, member, root, split_episodes(root, cfg.validation.val_split, cfg.seed, member.episodes)[0])
    batch = collate([data[i] for i in frames])  # in the order read: each sample draws its own noise and time
    policy.train()
    torch.manual_seed(seed)
    return float(policy(batch)["loss"])


def test_the_resharded_runs_checkpoints_are_ordinary_checkpoints_with_their_topology_history(runs):
    last = runs.run / CHECKPOINTS / "000009"
    state = json.loads((last / TRAINING_STATE).read_text())
    assert state["world_size"] == 1 and state["backend"] == "single"
    assert [(t["step"], t["world_size"], t["backend"], t["per_device_batch"]) for t in state["topologies"]] == [
        (0, 2, "ddp", 4), (3, 2, "deepspeed", 4), (6, 1, "single", 8)]
    assert state["samples_seen"] == STEPS * GLOBAL_BATCH
    zero2 = runs.run / CHECKPOINTS / "000006"  # written by the ZeRO-2 launch (the run keeps every checkpoint)
    assert json.loads((zero2 / TRAINING_STATE).read_text())["zero_stage"] == 2
    consolidated = run_cli_in_process(["checkpoint", "consolidate", str(zero2)], env={"HF_HOME": str(runs.tmp / "hf_home")})
    assert consolidated.returncode == 0 and (zero2 / "model.safetensors").is_file(), consolidated.stderr
    verify = run_cli_in_process(["checkpoint", "verify", str(zero2)], env={"HF_HOME": str(runs.tmp / "hf_home")})
    assert verify.returncode == 0, verify.stdout + verify.stderr  # consolidate listed its output in the manifest
    # A plain resume under the launch that wrote it passes every check (manifest, pickles, topology) like any
    # checkpoint's; the run is at its last step, so nothing is launched.
    env = {"HF_HOME": str(runs.tmp / "hf_home"), "OPENTAU_CACHE_DIR": str(runs.cache)}
    again = run_cli_in_process(["resume", str(runs.run)], env=env)
    assert again.returncode == 0 and "Nothing to do" in again.stderr and "Elastic" not in again.stderr, again.stderr


def test_config_validate_checks_an_elastic_resume_without_launching(runs):
    ckpt = runs.ref / CHECKPOINTS / "000003"
    args = ["config", "validate", str(ckpt / "train_config.json"), "--resume=true", "--rollback=true",
            f"--accelerate-config={runs.tmp / 'single.yaml'}"]  # the reference run goes on past 000003: a rollback
    env = {"HF_HOME": str(runs.tmp / "hf_home"), "OPENTAU_CACHE_DIR": str(runs.cache)}
    plain = run_cli_in_process(args, env=env)
    assert plain.returncode == 2 and "--reshard=true" in plain.stderr, plain.stderr
    elastic = run_cli_in_process([*args, "--reshard=true"], env=env)
    assert elastic.returncode == 0 and "8 = 8 per device x 1 accumulation x 1 processes" in elastic.stdout, elastic.stderr
    assert "per-device batch 4 x accumulation 1 -> per-device batch 8 x accumulation 1" in elastic.stderr
    odd = run_cli_in_process([*args, "--reshard=true", "--gradient_accumulation_steps=3"], env=env)
    assert odd.returncode == 2 and "--gradient_accumulation_steps=3 does not fit it" in odd.stderr, odd.stderr
