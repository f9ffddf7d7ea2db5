"""End-to-end training through the installed CLI: real `accelerate launch`, 2 CPU processes, the pi05_tiny preset.

Runs are shared between assertions (module-scoped fixtures): per backend one uninterrupted run and one resume of
its middle checkpoint into the same run directory (so the resume also saves again over an existing step). The DDP,
ZeRO-2 and ZeRO-3 uninterrupted runs are the session's shared ones (conftest.ddp_reference, zero2_reference,
zero3_reference), copied before they are resumed into.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    DDP_REFERENCE_SAVE, DDP_REFERENCE_STEPS, EXAMPLES, SINGLE_PROCESS_ENV, opentau_bin, own_cache, run_cli,
    run_cli_in_process,
)
from opentau_cli.store.layout import (
    CHECKPOINTS, DS_TAG, LAST, LOGS, MANIFEST, METRICS, MODEL_WEIGHTS, OPTIMIZER, SCHEDULER, TENSORBOARD, TRAIN_CONFIG,
    TRAINING_STATE, ZERO_TO_FP32, ds_shard_glob, leftover_of, read_last, step_of,
)
from opentau_cli.store.lineage import ROLLED_BACK

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
YAML = {
    "single": None,
    "ddp": str(EXAMPLES / "accelerate_cpu_ddp_config.yaml"),
    "zero2": str(EXAMPLES / "accelerate_cpu_deepspeed_config.yaml"),
    "zero3": str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"),
}
STEPS, SAVE = DDP_REFERENCE_STEPS, DDP_REFERENCE_SAVE  # 6, 3
# Global batch 8 on every backend: 8 per process alone, 4 per process on 2 processes.
COMMON = ["--steps", str(STEPS), "--save_freq", str(SAVE), "--log_freq", "1", "--scheduler.warmup_steps", "2"]


_CACHE: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def private_demo_cache(tmp_path_factory):
    """This module's own demo dataset: runs compared with each other must read the same data, whatever else
    happens to the shared cache meanwhile."""
    _CACHE[:] = [tmp_path_factory.mktemp("opentau_cache")]
    yield
    _CACHE.clear()


def env_for(tmp: Path) -> dict:
    return {"HF_HOME": str(tmp / "hf_home"), "OPENTAU_CACHE_DIR": own_cache(_CACHE[0])}  # HF_HOME: no user Accelerate default


def train_args(backend: str, out: Path, *extra: str) -> list[str]:
    args = ["train", f"--config_path={TINY}", f"--output_dir={out}", *COMMON, "--batch_size", "8" if backend == "single" else "4"]
    if YAML[backend]:
        args.append(f"--accelerate-config={YAML[backend]}")
    return args + list(extra)


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / METRICS).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"


STALE = -1.0  # no real loss: marks the records an earlier launch left past the checkpoint


def mark_stale_past(run_dir: Path, step: int) -> None:
    """Give the records past `step` a loss no run logs, so that the resumed run's records are told from them: the
    resume must drop them and log those steps itself."""
    lines = [json.dumps({**r, "loss": STALE} if r.get("step", 0) > step and "loss" in r else r) for r in records(run_dir)]
    (run_dir / METRICS).write_text("".join(line + "\n" for line in lines))


class Run:
    """One backend: an uninterrupted run, then a resume of its middle checkpoint into the same run directory (the
    uninterrupted run's records past the checkpoint marked stale first: the resumed ones are its own)."""

    def __init__(self, backend: str, tmp: Path, *extra: str, name: str | None = None, reference: Path | None = None):
        self.backend, self.dir, self.env = backend, tmp / (name or backend), env_for(tmp)
        if backend == "single":
            self.env.update(SINGLE_PROCESS_ENV)
        if reference is None:
            ok(run_cli(train_args(backend, self.dir, *extra), env=self.env))
        else:
            shutil.copytree(reference, self.dir, symlinks=True)
        self.full = losses(self.dir)
        self.full_records = records(self.dir)
        self.full_last_state = json.loads((self.dir / CHECKPOINTS / "000006" / TRAINING_STATE).read_text())
        self.ckpt_mid = self.dir / CHECKPOINTS / "000003"
        mark_stale_past(self.dir, SAVE)
        # The run's later checkpoints move aside (lineage.py): the resumed launch writes the same steps again.
        self.resume = run_cli(["resume", str(self.ckpt_mid), "--rollback=true"], env=self.env)
        ok(self.resume)
        self.resumed_records = records(self.dir)
        self.resumed = losses(self.dir)


# The session's shared runs (train_args(backend, ..., *EMA), validated at each save; ZeRO-3's saving asynchronously),
# copied before they are resumed into.
SHARED_RUNS = {"ddp": "ddp_reference", "zero2": "zero2_reference", "zero3": "zero3_reference"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("train")
    made: dict[str, Run] = {}

    def get(backend: str) -> Run:
        if backend == "mixture" and backend not in made:
            made[backend] = Run("ddp", tmp, *mixture_args(tmp), name="mixture")
        if backend in SHARED_RUNS and backend not in made:
            made[backend] = Run(backend, tmp, reference=request.getfixturevalue(SHARED_RUNS[backend]))
        if backend not in made:
            made[backend] = Run(backend, tmp, *EMA)
        return made[backend]

    return get


# Every run keeps an EMA (train/ema.py; the shared references too): nothing else about the run changes.
EMA = ("--ema.decay=0.9",)


@pytest.mark.parametrize("backend", ["single", "ddp", "zero2", "zero3"])
def test_resume_continues_the_ema_bit_for_bit(runs, backend):
    run = runs(backend)
    uninterrupted = list(run.dir.glob(f"{ROLLED_BACK}/*/{CHECKPOINTS}/000006"))
    assert len(uninterrupted) == 1  # the uninterrupted run's last checkpoint, moved aside by the resume's rollback
    names = sorted(p.name for p in uninterrupted[0].glob("ema*.safetensors"))
    assert names == (["ema.safetensors"] if backend in ("single", "ddp") else ["ema_rank0.safetensors", "ema_rank1.safetensors"])
    for name in names:
        full, resumed = load_file(str(uninterrupted[0] / name)), load_file(str(run.dir / CHECKPOINTS / "000006" / name))
        assert sorted(full) == sorted(resumed) and all(torch.equal(full[k], resumed[k]) for k in full), name


@pytest.mark.parametrize("backend", ["single", "ddp", "zero2", "zero3"])
def test_train_saves_checkpoints_and_resume_continues_after_the_checkpoint(runs, backend):
    run = runs(backend)
    assert sorted(run.full) == list(range(1, STEPS + 1))
    ckpts = sorted(p.name for p in (run.dir / CHECKPOINTS).iterdir() if not p.name.startswith("."))
    assert ckpts == ["000003", "000006", LAST]
    assert os.readlink(run.dir / CHECKPOINTS / LAST) == "000006"
    for name in (TRAIN_CONFIG, TRAINING_STATE, MANIFEST, SCHEDULER):
        assert (run.ckpt_mid / name).is_file()
    state = json.loads((run.ckpt_mid / TRAINING_STATE).read_text())
    assert state["step"] == SAVE and state["samples_seen"] == 8 * SAVE
    assert state["world_size"] == (1 if backend == "single" else 2)
    assert state["sampler"]["epoch"] * 10**6 + state["sampler"]["batch"] > 0
    saved_cfg = json.loads((run.ckpt_mid / TRAIN_CONFIG).read_text())
    assert Path(saved_cfg["config_path"]).parts[-3:] == (CHECKPOINTS, "000003", TRAIN_CONFIG)
    assert saved_cfg["resume"] is False
    # The resume logged from step SAVE + 1 on (not 1), saved the last step again over the old one, and left no temp dirs.
    assert "Resumed from" in run.resume.stdout + run.resume.stderr
    assert sorted(run.resumed) == list(range(1, STEPS + 1))
    assert not [p for p in (run.dir / CHECKPOINTS).iterdir() if p.name.startswith(".")]
    assert json.loads((run.dir / CHECKPOINTS / "000006" / TRAINING_STATE).read_text())["step"] == STEPS
    assert (run.dir / TENSORBOARD).is_dir() and list((run.dir / TENSORBOARD).rglob("events.out.tfevents*"))
    assert len(list((run.dir / LOGS).iterdir())) == 2


def mixture_args(tmp: Path) -> list[str]:
    """A 2-rank mixture: a v2.1 dataset of PNG cameras, its state made 6 wide, and a v3.0 one of mp4 cameras mapped
    to the other slot, weighted 3:1, with validation on episodes held out of each."""
    from opentau_cli.data import write_synth
    from test_data_mixture import widen_state

    png = write_synth(tmp / "mix_png", episodes=5, steps_per_episode=8, seed=1)
    widen_state(png, 6)
    video = write_synth(tmp / "mix_video", episodes=4, steps_per_episode=8, cameras=2, seed=2, fmt="v3.0", video=True)
    members = [{"root": str(png), "weight": 3}, {"root": str(video), "camera_keys": {"observation.images.front": "camera1"}}]
    return [f"--dataset.mixture={json.dumps(members)}", "--dataset.num_cameras=2", "--validation.val_split=0.25",
            "--validation.val_freq", str(SAVE), "--validation.max_batches", "1"]


@pytest.mark.parametrize("backend", ["single", "ddp", "zero2", "zero3", "mixture"])
def test_resumed_losses_equal_uninterrupted_losses(runs, backend):
    run = runs(backend)
    # Every step once: the stale records past the checkpoint were dropped, the resumed launch logged those steps.
    train_steps = [r["step"] for r in run.resumed_records if r.get("kind") == "train"]
    assert train_steps == list(range(1, STEPS + 1))
    assert STALE not in run.resumed.values()
    for step in range(SAVE + 1, STEPS + 1):
        assert run.resumed[step] == run.full[step], f"step {step}"  # same world size and backend: bit for bit
    for step in range(1, SAVE + 1):
        assert run.resumed[step] == run.full[step]  # records up to the checkpoint are kept as they were


def test_a_mixture_run_records_the_samples_drawn_from_each_dataset_and_their_own_statistics(runs):
    run = runs("mixture")
    resumed = json.loads((run.dir / CHECKPOINTS / "000006" / TRAINING_STATE).read_text())
    for state in (run.full_last_state, resumed):
        drawn = state["samples_per_dataset"]
        assert list(drawn) == ["mix_png", "mix_video"] and sum(drawn.values()) == state["samples_seen"] == 8 * STEPS
        assert drawn["mix_png"] > drawn["mix_video"] > 0  # weighted 3:1
        widths = [len(d["stats"]["state"]["q01"]) for d in state["datasets"]]
        assert widths == [6, 4] and [d["weight"] for d in state["datasets"]] == [3.0, 1.0]
    assert resumed["samples_per_dataset"] == run.full_last_state["samples_per_dataset"]
    mid = json.loads((run.ckpt_mid / TRAINING_STATE).read_text())["samples_per_dataset"]
    assert sum(mid.values()) == 8 * SAVE
    assert [r["step"] for r in run.full_records if r.get("kind") == "val"] == [SAVE, STEPS]


def _by_hand_action_mse(ckpt: Path, member_index: int, stats: dict, stride: int) -> float:
    """The action MSE on a mixture member's held-out episodes of the checkpoint's policy given `stats` by hand, with
    eval's noise (one seeded generator, a chunk every `stride` frames, 8 per batch)."""
    import torch

    from opentau_cli.config import load_config
    from opentau_cli.data.build import make_dataset, split_episodes
    from opentau_cli.data.sampler import collate
    from opentau_cli.policies import build_policy

    cfg = load_config(ckpt / TRAIN_CONFIG, {})
    policy = build_policy(cfg.policy)
    policy.load_state_dict(load_file(str(ckpt / MODEL_WEIGHTS)))
    policy.set_stats(stats)
    policy.eval()
    member = cfg.dataset.mixture[member_index]
    _, held_out = split_episodes(member.root, cfg.validation.val_split, cfg.seed, member.episodes)
    data = make_dataset(cfg, member, Path(member.root), held_out)
    generator, steps, joints = torch.Generator().manual_seed(0), cfg.policy.n_action_steps, len(stats["action"]["q01"])
    indices = list(range(0, len(data), stride))
    squared, count = 0.0, 0.0
    for start in range(0, len(indices), 8):
        batch = collate([data[i] for i in indices[start : start + 8]])
        noise = torch.randn(len(batch["task"]), cfg.policy.chunk_size, cfg.policy.max_action_dim, generator=generator)
        with torch.no_grad():
            predicted = policy.sample_actions(batch, noise=noise)
        valid = (~batch["action_is_pad"][:, :steps]).double()
        squared += (((predicted.double() - batch["actions"][:, :steps, :joints].double()) ** 2) * valid[..., None]).sum().item()
        count += valid.sum().item() * joints
    return squared / count


def test_a_mixture_run_exports_and_evaluates_its_second_dataset_with_that_dataset_s_own_statistics(runs, tmp_path):
    """--dataset picks the member: the export holds its own statistics (its widths, not the first member's widened
    ones the policy carries), and eval on its held-out episodes gives the actions of the policy given them by hand."""
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app

    run = runs("mixture")
    final = run.dir / CHECKPOINTS / "000006"
    own = {d["name"]: d["stats"] for d in json.loads((final / TRAINING_STATE).read_text())["datasets"]}
    exported = tmp_path / "mix_video"
    r = CliRunner().invoke(app, ["checkpoint", "export", str(run.dir), "--output", str(exported), "--dataset", "mix_video"])
    assert r.exit_code == 0, r.output
    weights, held = load_file(str(exported / MODEL_WEIGHTS)), load_file(str(final / MODEL_WEIGHTS))
    for stat in ("q01", "q99", "mean", "std"):
        assert weights[f"normalize_inputs.buffer_state.{stat}"].tolist() == pytest.approx(own["mix_video"]["state"][stat])
        assert weights[f"unnormalize_outputs.buffer_actions.{stat}"].tolist() == pytest.approx(own["mix_video"]["action"][stat])
    assert len(own["mix_video"]["state"]["q01"]) == 4 and int(held["state_dim"]) == 6  # the policy holds the first's
    assert weights["normalize_inputs.buffer_state.q99"].tolist() != held["state_q99"][:4].tolist()

    def evaluated(source: Path, name: str, *extra: str) -> dict:
        r = CliRunner().invoke(app, ["eval", str(source), "--output", str(tmp_path / name), "--stride", "2",
                                     "--plot-episodes", "0", *extra])
        assert r.exit_code == 0, r.output
        return json.loads((tmp_path / name / "eval.json").read_text())

    by_checkpoint = evaluated(run.dir, "eval_checkpoint", "--dataset", "mix_video")
    assert by_checkpoint["dataset_name"] == "mix_video" and by_checkpoint["held_out"] is True
    assert by_checkpoint["policy"]["mse"] == pytest.approx(_by_hand_action_mse(final, 1, own["mix_video"], stride=2), rel=1e-5)
    # The export, evaluated as a model on the same episodes of the same data, mapped as the member maps it.
    member = json.loads((final / TRAIN_CONFIG).read_text())["dataset"]["mixture"][1]
    by_export = evaluated(exported, "eval_export", f"--dataset.root={member['root']}", "--dataset.num_cameras=2",
                          f"--dataset.camera_keys={json.dumps(member['camera_keys'])}",
                          "--episodes", ",".join(map(str, by_checkpoint["episodes"])))
    assert by_export["policy"]["mse"] == pytest.approx(by_checkpoint["policy"]["mse"], rel=1e-5)
    assert by_export["mean_action"]["mse"] == pytest.approx(by_checkpoint["mean_action"]["mse"], rel=1e-5)


def test_export_and_eval_refuse_a_dataset_the_run_did_not_train_on_naming_its_datasets(runs, tmp_path):
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app

    for run, named in ((runs("mixture").dir, "mix_png, mix_video"), (runs("ddp").dir, "demo")):
        for command in (["checkpoint", "export", str(run), "--output", str(tmp_path / "out")],
                        ["eval", str(run), "--output", str(tmp_path / "out")]):
            r = CliRunner().invoke(app, [*command, "--dataset", "mix_vidoe"])
            assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0 and "Traceback" not in r.output, r.output
            assert f"--dataset mix_vidoe: no dataset of that name; the datasets are {named}." in r.stderr
    r = CliRunner().invoke(app, ["eval", str(runs("mixture").dir), "--dataset.root=@demo", "--output", str(tmp_path / "out")])
    assert r.exit_code == 2 and "--dataset.root: the run trained on a mixture" in r.stderr and "--dataset NAME" in r.stderr, r.output
    assert not (tmp_path / "out").exists()
    # A single-dataset run takes its own dataset's name: the policy's statistics are that dataset's.
    r = CliRunner().invoke(app, ["checkpoint", "export", str(runs("ddp").dir), "--output", str(tmp_path / "demo"), "--dataset", "demo"])
    assert r.exit_code == 0, r.output


def test_resuming_a_mixture_with_another_mixture_exits_2_naming_what_changed(runs, tmp_path, monkeypatch):
    """Planned in-process like the other resume refusals: nothing launched or written."""
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app
    from opentau_cli.config import Machine
    from opentau_cli.process import launch

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(Machine, "this", classmethod(lambda cls: Machine(cuda=False, gpus=0)))
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("the resume got past its checks"))
    ckpt = _copy_ckpt(runs("mixture").ckpt_mid, tmp_path / "run")
    mixture = json.loads((ckpt / TRAIN_CONFIG).read_text())["dataset"]["mixture"]
    reweighted = json.dumps([mixture[0], {**mixture[1], "weight": 2.0}])
    before = _tree(tmp_path / "run")
    for command in (["resume", str(ckpt)], ["train", f"--config_path={ckpt / TRAIN_CONFIG}", "--resume=true"]):
        r = CliRunner().invoke(app, [*command, f"--dataset.mixture={reweighted}"])
        assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0, r.output
        assert "trained on another mixture (dataset.mixture[1] (mix_video).weight: checkpoint 1.0, now 2.0)" in r.stderr
    r = CliRunner().invoke(app, ["resume", str(ckpt), f"--dataset.mixture={json.dumps(mixture[:1])}"])
    assert r.exit_code == 2 and "datasets: checkpoint mix_png, mix_video, now mix_png" in r.stderr, r.output
    assert _tree(tmp_path / "run") == before


def test_metrics_records_have_the_documented_keys(runs):
    rec = runs("ddp").full_records[0]
    for key in ("step", "loss", "mse_loss", "lr", "grad_norm", "samples_per_s"):
        assert isinstance(rec[key], (int, float)), key
    assert rec["step"] == 1 and rec["grad_norm"] > 0 and rec["samples_per_s"] > 0


def test_model_safetensors_loads_into_a_fresh_pi05(runs):
    from opentau_cli.config import load_config
    from opentau_cli.policies import build_policy

    run = runs("ddp")
    tensors = load_file(str(run.ckpt_mid / MODEL_WEIGHTS))
    policy = build_policy(load_config(TINY).policy)
    missing, unexpected = policy.load_state_dict(tensors, strict=True), None
    assert not missing.missing_keys and not missing.unexpected_keys and unexpected is None


def test_deepspeed_checkpoints_hold_shards_of_both_ranks(runs):
    for backend in ("zero2", "zero3"):
        tag = runs(backend).ckpt_mid / DS_TAG
        for rank in (0, 1):
            assert list(tag.glob(ds_shard_glob("optim", rank))), (rank, sorted(p.name for p in tag.iterdir()))
        assert (runs(backend).ckpt_mid / ZERO_TO_FP32).is_file()


def test_step_one_loss_is_equal_under_ddp_and_zero2(runs):
    assert runs("zero2").full[1] == runs("ddp").full[1]


def test_step_one_loss_is_equal_under_ddp_and_zero3(runs):
    assert runs("zero3").full[1] == runs("ddp").full[1]


def test_validation_runs_under_zero3_on_every_rank(runs):
    val = [r for r in runs("zero3").full_records if r.get("kind") == "val"]
    assert [r["step"] for r in val] == [SAVE, STEPS]
    assert all(r["val_loss"] > 0 and r["val_batches"] == 4 for r in val)


# SIGTERM (preemption) on 2 DDP processes: tests/test_lora_e2e.py's SIGTERM test, the same assertions (saves, exits 0,
# the resume logs the uninterrupted losses bit for bit, keep_last=1 keeps the checkpoint resumed from) on a LoRA run;
# the preemption path does not depend on what trains. A full single-process run: tests/test_trackers_e2e.py.


# One ZeRO-2 run (2 ranks, a save every step, keep_last=2) SIGKILLed whole at a different moment of four saves,
# resumed after each kill: (moment, the rank that meets it, the step whose save is killed, newest complete after).
# The manifest's own rename (before_manifest_rename), a rank-0 step between the two rank-0 moments kept here, is
# killed in tests/test_checkpoint_faults.py with every other moment.
KILL_CHAIN = [
    ("mid_file", 1, 2, "000001"),
    ("before_publish", 0, 3, "000002"),
    ("before_last", 0, 4, "000004"),
    ("mid_retention", 0, 5, "000005"),
]
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks


def test_sigkill_at_four_moments_of_real_2_rank_saves_keeps_checkpoints_sound_and_resume_exact(runs, tmp_path):
    from opentau_cli.store.manifest import is_complete, verify_manifest
    from opentau_cli.store.runs import latest

    reference = runs("zero2").full
    run = tmp_path / "run"
    ckpts = run / CHECKPOINTS
    base_env = {**os.environ, **env_for(tmp_path), "PYTHONPATH": str(HOOKS)}
    base_env.pop("OPENTAU_DEBUG", None)
    command = train_args("zero2", run, "--save_freq", "1", "--checkpoint.keep_last", "2")
    for moment, rank, step, newest in KILL_CHAIN:
        env = {**base_env, "TEST_KILL_AT": f"{moment}@{step}", "TEST_KILL_RANK": str(rank)}
        proc = subprocess.run([opentau_bin(), *command], env=env, capture_output=True, text=True, timeout=600,
                              start_new_session=True)
        assert proc.returncode == -signal.SIGKILL, f"{moment}: not killed\n{proc.stderr[-3000:]}"
        _assert_killed_at(moment, ckpts)
        # Every step directory is complete and verifies; half-written or half-deleted ones are hidden leftovers.
        steps = sorted(d.name for d in ckpts.iterdir() if step_of(d.name) is not None)
        assert all(is_complete(ckpts / d) and verify_manifest(ckpts / d) == [] for d in steps), (moment, steps)
        assert latest(run) == ckpts / newest, (moment, steps)
        assert is_complete(ckpts / read_last(ckpts))
        assert run_cli_in_process(["checkpoint", "verify", str(run)], env=env_for(tmp_path)).returncode == 0, moment
        command = ["resume", str(run)]
    ok(run_cli(command, env=env_for(tmp_path)))

    resumed = losses(run)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert resumed[s] == reference[s], f"step {s}"
    # Leftovers cleaned; keep_last=2 kept the newest two (the one resumed from, 000005, is one of them).
    assert sorted(p.name for p in ckpts.iterdir()) == ["000005", "000006", LAST]


def _assert_killed_at(moment: str, ckpts: Path) -> None:
    """What the disk shows right after the kill proves which moment it struck."""
    hidden = [p for p in ckpts.iterdir() if p.name.startswith(".")]
    left = {leftover_of(p.name): p for p in hidden}  # (save | deletion, step): the run id dropped
    assert None not in left, hidden
    if moment == "mid_file":
        assert list(left) == [("save", "000002")]
        assert list(left["save", "000002"].rglob(ds_shard_glob("optim", rank=1)))
        assert not (left["save", "000002"] / MANIFEST).exists()
    elif moment == "before_publish":
        assert list(left) == [("save", "000003")]
        assert (left["save", "000003"] / MANIFEST).exists()
    elif moment == "before_last":
        assert not left and read_last(ckpts) == "000003" and (ckpts / "000004").is_dir()
    elif moment == "mid_retention":
        assert list(left) == [("deletion", "000002")] and read_last(ckpts) == "000005"


# Bad input: exit 2, one clear line, nothing written.


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_resume_of_a_directory_without_checkpoints_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    r = run_cli_in_process(["resume", str(tmp_path / "empty")], env=env_for(tmp_path))
    assert r.returncode == 2 and "No checkpoint found" in r.stderr and "Traceback" not in r.stderr
    assert _tree(tmp_path / "empty") == []


def _copy_ckpt(src: Path, dst_run: Path) -> Path:
    dst = dst_run / CHECKPOINTS / src.name
    shutil.copytree(src, dst)
    return dst


def test_resume_of_a_checkpoint_with_a_missing_file_exits_2_and_loads_nothing(runs, tmp_path):
    ckpt = _copy_ckpt(runs("ddp").ckpt_mid, tmp_path / "run")
    (ckpt / OPTIMIZER).unlink()
    before = _tree(tmp_path / "run")
    r = run_cli_in_process(["resume", str(ckpt)], env=env_for(tmp_path))
    assert r.returncode == 2, r.stderr
    assert OPTIMIZER in r.stderr and "manifest" in r.stderr and "Traceback" not in r.stderr
    assert _tree(tmp_path / "run") == before


def test_resume_with_an_incompatible_preset_exits_2(runs, tmp_path):
    ckpt = runs("ddp").ckpt_mid
    before = _tree(runs("ddp").dir)
    r = run_cli_in_process(["train", f"--config_path={ckpt / TRAIN_CONFIG}", "--resume=true", "--steps=12",
                 "--policy.preset=pi05_small"], env=env_for(tmp_path))
    assert r.returncode == 2 and "policy.preset" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _tree(runs("ddp").dir) == before


def test_deepspeed_checkpoint_resumed_under_ddp_exits_2_and_says_consolidate(runs, tmp_path):
    ckpt = _copy_ckpt(runs("zero2").ckpt_mid, tmp_path / "run")
    r = run_cli_in_process(["resume", str(ckpt), f"--accelerate-config={YAML['ddp']}"], env=env_for(tmp_path))
    assert r.returncode == 2 and "consolidate" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run" / LOGS).exists()


def test_resume_with_another_world_size_exits_2(runs, tmp_path):
    ckpt = _copy_ckpt(runs("ddp").ckpt_mid, tmp_path / "run")
    single = tmp_path / "single.yaml"
    single.write_text("distributed_type: 'NO'\nnum_processes: 1\n")
    r = run_cli_in_process(["resume", str(ckpt), f"--accelerate-config={single}"], env=env_for(tmp_path))
    assert r.returncode == 2 and "2 processes" in r.stderr, r.stderr


def _no_accelerate_record(ckpt: Path) -> None:
    state = json.loads((ckpt / TRAINING_STATE).read_text())
    del state["accelerate"]
    (ckpt / TRAINING_STATE).write_text(json.dumps(state))


RESUME_REFUSALS = {
    "another world size": (["--accelerate-config={single}"], None),
    "another backend": ([f"--accelerate-config={YAML['zero2']}"], None),
    "another preset": (["--policy.preset=pi05_small"], None),
    "a damaged checkpoint": ([], lambda ckpt: (ckpt / OPTIMIZER).unlink()),
    "a checkpoint without its launch": ([], _no_accelerate_record),
}


@pytest.mark.parametrize("case", list(RESUME_REFUSALS))
def test_config_validate_refuses_a_resume_exactly_as_train_does(runs, tmp_path, monkeypatch, case):
    """`train --resume=true` and `config validate --resume=true` of a checkpoint's train_config.json: same exit code,
    same words, nothing launched or written (in-process, on a pinned machine without CUDA)."""
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app
    from opentau_cli.config import Machine
    from opentau_cli.process import launch

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(Machine, "this", classmethod(lambda cls: Machine(cuda=False, gpus=0)))
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("train got past its checks"))
    (tmp_path / "single.yaml").write_text("distributed_type: 'NO'\nnum_processes: 1\n")
    ckpt = _copy_ckpt(runs("ddp").ckpt_mid, tmp_path / "run")
    args, damage = RESUME_REFUSALS[case]
    if damage:
        damage(ckpt)
    args = ["--resume=true", *(a.replace("{single}", str(tmp_path / "single.yaml")) for a in args)]
    before = _tree(tmp_path / "run")
    train = CliRunner().invoke(app, ["train", f"--config_path={ckpt / TRAIN_CONFIG}", *args])
    validate = CliRunner().invoke(app, ["config", "validate", str(ckpt / TRAIN_CONFIG), *args])
    assert train.exit_code == 2 and train.stderr.startswith("Error: "), train.output
    assert (validate.exit_code, validate.stderr) == (train.exit_code, train.stderr)
    assert _tree(tmp_path / "run") == before


def test_config_validate_of_a_finished_runs_checkpoint_says_there_is_nothing_to_do(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app

    final = runs("ddp").dir / CHECKPOINTS / "000006"
    r = CliRunner().invoke(app, ["config", "validate", str(final / TRAIN_CONFIG), "--resume=true"])
    assert r.exit_code == 0, r.output
    assert "Nothing to do" in r.stderr
    assert ["resume", "from", str(final.resolve())] in [line.split() for line in r.stdout.splitlines()]


def test_train_config_path_with_resume_true_resumes_that_checkpoint_with_more_steps(runs, tmp_path, monkeypatch):
    """The upstream line `opentau-train --config_path=<ckpt>/train_config.json --resume=true --steps=N`, planned
    in-process (the launch itself is the one the other tests run)."""
    from opentau_cli.plan.run_plan import plan_train

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    run_dir = tmp_path / "moved_run"
    ckpt = _copy_ckpt(runs("ddp").dir / CHECKPOINTS / "000006", run_dir)
    plan = plan_train(ckpt / TRAIN_CONFIG, None, ["--resume=true", "--steps=9"])
    assert plan.resume_from == ckpt.resolve()
    assert plan.config.steps == 9 and plan.config.output_dir == run_dir.resolve()
    assert plan.setup.backend == "ddp" and plan.setup.world_size == 2  # the checkpoint's launch, no flag needed


def test_resuming_a_finished_run_exits_0_and_launches_nothing(runs, tmp_path):
    run = runs("ddp")
    logs_before = sorted((run.dir / LOGS).iterdir())
    r = run_cli_in_process(["resume", str(run.dir)], env=env_for(tmp_path))
    assert r.returncode == 0 and "Nothing to do" in r.stderr and "--steps" in r.stderr, r.stderr
    assert sorted((run.dir / LOGS).iterdir()) == logs_before
