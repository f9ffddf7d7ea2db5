"""One real launch and its resume, shared by the Hub dataset and both trackers: `opentau train` on a LeRobot v3.0
dataset named by repo id, read offline from a Hugging Face cache that holds only the selected episodes and camera,
logging to W&B (offline, the real package) and MLflow (a local file store); SIGTERM arrives during a save, the run
saves and exits 0; the branch `main` then moves to another commit, and `opentau resume` continues on the commit the
checkpoint recorded, in the same W&B and MLflow runs. What the trackers hold is read back with their own readers and
must equal metrics.jsonl, with no step twice."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import EXAMPLES, SINGLE_PROCESS_ENV, opentau_bin, run_cli
from opentau_cli.store.layout import CHECKPOINTS, METRICS, TRAIN_CONFIG, TRAINING_STATE, read_last
from test_data_hub import FRONT, TOP, lay_out, unselected
from test_trackers import mlflow_metric, wandb_runs

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.timeout(900)]

HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
REPO = "org/reach_v30"
STEPS = 6


def last_checkpoint(run: Path) -> Path:
    return run / CHECKPOINTS / read_last(run / CHECKPOINTS)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    import av, mlflow, wandb  # noqa: F401  (dev dependencies: missing ones fail here, never skip)
    from opentau_cli.data import write_synth

    base = tmp_path_factory.mktemp("tracked")
    source = write_synth(base / "src", fmt="v3.0", episodes=4, steps_per_episode=10, cameras=2, seed=3, video=True)
    other = write_synth(base / "src_new", fmt="v3.0", episodes=4, steps_per_episode=10, cameras=2, seed=4, video=True)
    cache = base / "hf_cache"
    commit = lay_out(cache, REPO, source, "main", left_out=unselected)
    uri = f"file:{base / 'mlruns'}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(base / "hf_home"),
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(base / "wandb_config"),
           "WANDB_CACHE_DIR": str(base / "wandb_cache"), "MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true",
           **SINGLE_PROCESS_ENV}
    env.pop("OPENTAU_DEBUG", None)
    run = base / "run"
    args = ["train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={run}", "--steps", str(STEPS),
            "--save_freq", "2", "--log_freq", "1", "--batch_size", "4", "--scheduler.warmup_steps", "2",
            "--validation.val_freq=2", "--validation.val_split=0.5", f"--dataset.repo_id={REPO}",
            "--dataset.episodes=[0,2]", f'--dataset.camera_keys={{"{TOP}": "camera0"}}',
            "--logging.trackers=tensorboard,wandb,mlflow", "--logging.project=reach", "--logging.run_name=tracked"]
    # The scheduler's SIGTERM reaches the launcher while the save of step 2 is written: a later step saves and stops.
    first = subprocess.run([opentau_bin(), *args], capture_output=True, text=True, timeout=600, start_new_session=True,
                           env={**env, "PYTHONPATH": str(HOOKS), "TEST_KILL_AT": "before_metadata@2",
                                "TEST_KILL_SIGNAL": "SIGTERM"})
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    preempted = last_checkpoint(run)
    before = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    # The branch moves on: main now names another commit of the repo.
    moved = lay_out(cache, REPO, other, "main", left_out=unselected)
    resumed = run_cli(["resume", str(run)], env=env)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    return dict(run=run, commit=commit, moved=moved, preempted=preempted, before=before, first=first, resumed=resumed,
                records=[json.loads(line) for line in (run / METRICS).read_text().splitlines()])


def test_the_run_reads_the_hub_dataset_pinned_and_resumes_on_the_recorded_commit(tracked_run):
    run, commit = tracked_run["run"], tracked_run["commit"]
    assert "Preempted" in tracked_run["first"].stdout + tracked_run["first"].stderr
    final = last_checkpoint(run)
    config = json.loads((final / TRAIN_CONFIG).read_text())
    state = json.loads((final / TRAINING_STATE).read_text())
    assert (config["dataset"]["repo_id"], config["dataset"]["revision"]) == (REPO, commit)
    assert state["dataset_revisions"] == {"reach_v30": {"repo_id": REPO, "commit": commit}}
    # main moved before the resume: the resumed launch still read (and recorded) the checkpoint's commit.
    assert tracked_run["moved"] != commit and tracked_run["moved"] not in json.dumps([config, state])
    snapshots = run.parent / "hf_cache" / "datasets--org--reach_v30" / "snapshots"
    assert not list(snapshots.rglob(f"*{FRONT}*"))  # the unselected camera was never there, nor needed


def test_wandb_holds_every_record_of_metrics_jsonl_in_one_run_continued_at_the_resume_step(tracked_run):
    records, preempted = tracked_run["records"], int(tracked_run["preempted"].name)
    runs = wandb_runs(tracked_run["run"])
    state = json.loads((last_checkpoint(tracked_run["run"]) / TRAINING_STATE).read_text())
    assert [(r["id"], r["resumed"]) for r in runs] == [(state["trackers"]["wandb"], False), (state["trackers"]["wandb"], True)]
    assert runs[0]["project"] == "reach"
    logged = [(step, v["train/loss"]) for r in runs for step, v in r["history"] if "train/loss" in v]
    assert logged == [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]  # same steps, same losses, once each
    assert [s for s, _ in logged] == list(range(1, STEPS + 1))
    assert max(s for s, _ in runs[0]["history"]) == preempted  # the first launch stopped at its save
    val = [(step, v["val/val_loss"]) for r in runs for step, v in r["history"] if "val/val_loss" in v]
    assert val == [(r["step"], r["val_loss"]) for r in records if r["kind"] == "val"]
    saves = [step for r in runs for step, v in r["history"] if "checkpoint/step" in v]
    assert saves == sorted(set(saves)) and preempted in saves and STEPS in saves


def test_mlflow_holds_every_record_of_metrics_jsonl_in_the_same_run(tracked_run, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tracked_run['run'].parent / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    records = tracked_run["records"]
    state = json.loads((last_checkpoint(tracked_run["run"]) / TRAINING_STATE).read_text())
    import mlflow

    run_id = state["trackers"]["mlflow"]
    # The resume continued the preempted launch's MLflow run, and made no other.
    assert json.loads((tracked_run["preempted"] / TRAINING_STATE).read_text())["trackers"]["mlflow"] == run_id
    assert [r.info.run_id for r in mlflow.search_runs(search_all_experiments=True, output_format="list")] == [run_id]
    assert mlflow_metric(run_id, "train/loss") == [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert mlflow_metric(run_id, "val/val_loss") == [(r["step"], r["val_loss"]) for r in records if r["kind"] == "val"]
    run = mlflow.MlflowClient().get_run(run_id)
    assert run.data.params["dataset.repo_id"] == REPO and run.data.params["dataset.revision"] == tracked_run["commit"]
    assert run.data.tags["opentau.resumed_at_step"] == tracked_run["preempted"].name.lstrip("0")
    lineage = json.loads(run.data.tags["opentau.lineage"])  # the resumed checkpoint's place in the run's history
    assert lineage == json.loads((tracked_run["preempted"] / TRAINING_STATE).read_text())["lineage"]
