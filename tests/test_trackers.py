"""Experiment trackers through Accelerate's tracker API, with the real `wandb` (offline) and `mlflow` (a local file
store) packages, read back through their own readers: `wandb leet inspect` on the offline run files, MLflow's
client on the store. In process: a new run, its continuation on resume, and the fork after a rollback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from opentau_cli.config.load import load_config
from opentau_cli.train import trackers as trackers_mod
from opentau_cli.train.trackers import Trackers, check_trackers

pytestmark = [pytest.mark.full, pytest.mark.timeout(300)]


@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    """W&B offline and an MLflow file store, both under tmp_path; returns the MLflow tracking URI."""
    import mlflow, wandb  # noqa: F401  (dev dependencies: missing, the test fails)
    from accelerate import PartialState

    PartialState(cpu=True)  # what the Accelerator of a run sets up, which Accelerate's trackers log through
    uri = f"file:{tmp_path / 'mlruns'}"
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"), "MLFLOW_TRACKING_URI": uri,
                       "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(key, value)
    return uri


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline run under run_dir/wandb, in start order, as wandb's own reader (`wandb leet inspect`) prints it:
    {id, fork (run, step) or None, resumed, history: [(step, {key: value})]}."""
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(folder)],
                             capture_output=True, text=True, check=True).stdout
        run = {"history": []}
        for line in out.splitlines():
            record = json.loads(line)
            if record.get("type") == "run":
                info = record["run"]
                branch = info.get("branch_point")
                run.update(id=info["run_id"], start=info["start_time"], resumed=bool(info.get("resume")), project=info.get("project"),
                           tags=info.get("tags", []), fork=(branch["run"], branch["value"]) if branch else None)
            elif record.get("type") == "history":
                item = record["history"]["item"]
                run["history"].append((record["history"]["step"]["num"],
                                       {k: v for k, v in item.items() if not k.startswith("_")}))
        runs.append(run)
    return sorted(runs, key=lambda r: r["start"])


def mlflow_metric(run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return [(m.step, m.value) for m in sorted(MlflowClient().get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))]


def records(steps) -> list[dict]:
    return [{"kind": "train", "step": s, "loss": 1.0 / s, "lr": 1e-3, "grad_norm": 0.5} for s in steps]


MAIN = SimpleNamespace(is_main_process=True)


def cfg_for(run_dir: Path):
    return load_config(None, [f"--output_dir={run_dir}", "--logging.trackers=[tensorboard,wandb,mlflow]",
                              "--logging.project=reach", "--logging.tags=[pi05,test]"])


def test_a_resume_continues_the_same_runs_and_a_rollback_forks_them_at_its_step(tmp_path, offline_trackers):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = cfg_for(run_dir)
    first = Trackers.open(MAIN, cfg, run_dir)
    for record in records(range(1, 5)):
        first.log(record)
    first.checkpoint(4, 0.25, None)
    ids = first.state()
    first.close()

    # SIGTERM at step 4, saved, resumed there: the same runs go on at step 5.
    second = Trackers.open(MAIN, cfg, run_dir, resume_state={"trackers": ids}, step=4)
    assert second.state() == ids and second.notes == [f"wandb: continuing run {ids['wandb']} at step 4.",
                                                       f"mlflow: continuing run {ids['mlflow']} at step 4."]
    for record in records(range(5, 7)):
        second.log(record)
    second.close()

    # Rolled back to the checkpoint of step 2 while the runs hold steps up to 6: forked at 2, nothing repeated.
    third = Trackers.open(MAIN, cfg, run_dir, resume_state={"trackers": ids}, step=2, lineage={"parent": {"step": 2}})
    forked = third.state()
    assert forked["wandb"] != ids["wandb"] and forked["mlflow"] != ids["mlflow"]
    for record in records(range(3, 5)):
        third.log({**record, "loss": record["loss"] * 2})
    third.close()

    runs = wandb_runs(run_dir)
    assert [(r["id"], r["resumed"], r["fork"]) for r in runs] == [
        (ids["wandb"], False, None), (ids["wandb"], True, None), (forked["wandb"], False, (ids["wandb"], 2))]
    assert runs[0]["project"] == "reach" and runs[0]["tags"] == ["pi05", "test"]
    losses = [[(step, v["train/loss"]) for step, v in r["history"] if "train/loss" in v] for r in runs]
    assert losses == [[(s, 1.0 / s) for s in (1, 2, 3, 4)], [(s, 1.0 / s) for s in (5, 6)], [(s, 2.0 / s) for s in (3, 4)]]
    step4 = dict(runs[0]["history"])[4]  # W&B keeps one row per step: the save joins the step's record
    # 0.25 is the canned value first.checkpoint() was given above, not a measured time.
    assert (step4["checkpoint/step"], step4["checkpoint/seconds_blocked"]) == (4, 0.25)

    assert mlflow_metric(ids["mlflow"], "train/loss") == [(s, 1.0 / s) for s in range(1, 7)]
    # The fork holds its parent's history up to the rollback step, then its own.
    assert mlflow_metric(forked["mlflow"], "train/loss") == [(1, 1.0), (2, 0.5), (3, 2.0 / 3), (4, 0.5)]
    from mlflow import MlflowClient

    run = MlflowClient().get_run(forked["mlflow"])
    assert run.data.tags["opentau.forked_from"] == f"{ids['mlflow']}@2" and run.data.params["steps"] == "30000"
    assert json.loads(run.data.tags["opentau.lineage"]) == {"parent": {"step": 2}}


def test_only_the_main_process_opens_trackers(tmp_path, offline_trackers):
    other = Trackers.open(SimpleNamespace(is_main_process=False), cfg_for(tmp_path), tmp_path)
    other.log(records([1])[0])
    assert other.state() == {} and not (tmp_path / "wandb").exists() and not (tmp_path / "mlruns").exists()


def test_an_unknown_or_missing_tracker_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.test:5000")  # mlflow installed and set: no line
    cfg = load_config(None, ["--logging.trackers=[tensorboard,wandb,mlflow,neptune]"])
    real = trackers_mod.importlib.util.find_spec
    monkeypatch.setattr(trackers_mod.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert check_trackers(cfg) == [
        "logging.trackers names wandb, which is not installed: pip install 'opentau-cli[wandb]'.",
        "logging.trackers names 'neptune', which is not a tracker Accelerate supports "
        f"({', '.join(trackers_mod.known_trackers())}).",
    ]


@pytest.mark.parametrize("env, problem", [
    ({}, "MLFLOW_TRACKING_URI is not set"),
    ({"MLFLOW_TRACKING_URI": "  "}, "MLFLOW_TRACKING_URI is not set"),
    ({"MLFLOW_TRACKING_URI": "file:./mlruns"}, "unless MLFLOW_ALLOW_FILE_STORE=true"),
    ({"MLFLOW_TRACKING_URI": "/data/mlruns"}, "unless MLFLOW_ALLOW_FILE_STORE=true"),
    ({"MLFLOW_TRACKING_URI": "file:./mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"}, None),
    ({"MLFLOW_TRACKING_URI": "http://mlflow.test:5000"}, None),
    ({"MLFLOW_TRACKING_URI": "databricks"}, None),
])
def test_mlflow_without_the_setting_it_needs_is_refused_before_launch_naming_it(monkeypatch, env, problem):
    """Without MLFLOW_TRACKING_URI MLflow 3 opens a sqlite store that its client package cannot open: the ranks would
    fail after launch with MLflow's own exception. Refused before launch instead, one line naming the setting."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    lines = check_trackers(load_config(None, ["--logging.trackers=[tensorboard,mlflow]"]))
    if problem is None:
        assert lines == []
    else:
        (line,) = lines
        assert line.startswith("logging.trackers names mlflow") and problem in line and "\n" not in line


def test_a_tracker_that_cannot_start_is_one_line_saying_what_to_do(tmp_path, offline_trackers, monkeypatch):
    from opentau_cli.errors import UserError

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # MLflow 3 refuses a file store unless allowed
    cfg = load_config(None, [f"--output_dir={tmp_path}", "--logging.trackers=mlflow"])
    with pytest.raises(UserError, match=r"^logging.trackers: mlflow did not start \(MlflowException: .*\); set "
                                        r"MLFLOW_TRACKING_URI to your tracking server"):
        Trackers.open(MAIN, cfg, tmp_path)
