"""A damaged copy of the real g1 dataset (one video removed, one truncated), through the installed CLI.

A removed file is found before launch by `config validate` and `train` alike (so is a video that does not decode
at the first selected episode: tests/test_data_remote.py); a truncated one of a later episode only shows while
reading: the 2-rank run stops with exit 2 and one line, the elastic launcher's traceback stays in the run's logs, and
the same command runs again once the file is restored.
"""

from __future__ import annotations

import shutil

import pytest

from conftest import EXAMPLES, run_cli
from opentau_cli.store.layout import CHECKPOINTS, LOGS, METRICS, TENSORBOARD

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.timeout(900)]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
DDP = str(EXAMPLES / "accelerate_cpu_ddp_config.yaml")
VIDEOS = ("videos", "chunk-000", "observation.images.cam_high")
WIDE = ["--policy.max_state_dim=32", "--policy.max_action_dim=32"]  # the g1 robot's 26 joints
LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "torch.distributed.elastic", "To enable traceback")


@pytest.fixture
def damaged(g1, tmp_path):
    """The g1 dataset with episode 2's video removed and episode 1's cut to its first 300 kB."""
    root = tmp_path / "g1"
    shutil.copytree(g1, root)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the shared copy is read-only
    videos = root.joinpath(*VIDEOS)
    (videos / "episode_000002.mp4").unlink()
    (videos / "episode_000001.mp4").write_bytes((g1.joinpath(*VIDEOS) / "episode_000001.mp4").read_bytes()[:300_000])
    return root


def tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_video_removed_from_the_real_dataset_is_named_by_validate_and_train_before_anything_starts(damaged, tmp_path):
    out = tmp_path / "run"
    before = tree(damaged)
    args = [f"--dataset.root={damaged}", f"--output_dir={out}", *WIDE]
    validate = run_cli(["config", "validate", TINY, *args], cwd=tmp_path)
    train = run_cli(["train", f"--config_path={TINY}", *args], cwd=tmp_path)
    for r in (validate, train):
        assert r.returncode == 2, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "observation.images.cam_high/episode_000002.mp4 is missing" in errors[0]
        assert "video_path" in errors[0] and "dataset.episodes" in errors[0]  # where it was looked for, what to do
    assert not out.exists() and tree(damaged) == before


def test_a_truncated_video_stops_a_2_rank_run_with_one_line_and_the_same_command_runs_once_it_is_restored(g1, damaged, tmp_path):
    out = tmp_path / "run"
    command = ["train", f"--config_path={TINY}", f"--accelerate-config={DDP}", f"--dataset.root={damaged}", f"--output_dir={out}",
               "--dataset.episodes=[0,1]", "--validation.val_split=0", "--validation.val_freq=0", "--batch_size=2", "--steps=2",
               "--save_freq=2", "--log_freq=1", "--scheduler.warmup_steps=0", *WIDE]
    failed = run_cli(command, cwd=tmp_path)
    assert failed.returncode == 2, failed.stderr[-3000:]
    console = failed.stdout + failed.stderr
    assert not [noise for noise in LAUNCHER_NOISE if noise in console], console[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "cannot open video" in errors[0] and "episode_000001.mp4" in errors[0], failed.stderr
    (first_start,) = (out / LOGS).iterdir()
    assert "ChildFailedError" in (first_start / "launcher.log").read_text()  # the launcher's dump is kept, off the console
    assert not (out / CHECKPOINTS).exists()

    shutil.copy(g1.joinpath(*VIDEOS) / "episode_000001.mp4", damaged.joinpath(*VIDEOS) / "episode_000001.mp4")
    retried = run_cli(command, cwd=tmp_path)
    assert retried.returncode == 0, retried.stderr[-3000:]
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == ["000002", "last"]
    assert len(list((out / LOGS).iterdir())) == 2
    # The failed start's results went into its own log dir: this run's metrics hold its 2 steps only.
    assert (first_start / TENSORBOARD).is_dir() and (first_start / METRICS).is_file()
    assert len((out / METRICS).read_text().splitlines()) == 2
