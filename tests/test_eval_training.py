"""Training that evaluates its own checkpoints in a simulator (eval.env): a tiny policy trained on MetaWorld reach-v3
expert data, each published checkpoint rolled out by the launcher's evaluation process; its records beside the
checkpoints, its rows in metrics.jsonl, `checkpoint list` / `inspect`, checkpoints/best by success rate, an owed
evaluation finished by a resume, and the refusals before launch. One launch serves every assertion on it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import EXAMPLES, HOOKS, live_descendants, opentau_bin, require_simulators, run_cli, run_cli_in_process
from remote_runs import wait_for
from test_trackers import MAIN, cfg_for, mlflow_metric, offline_trackers, records, wandb_runs  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.full, pytest.mark.slow]

ENV = "metaworld:reach-v3"


@pytest.fixture(scope="module")
def experts(tmp_path_factory) -> Path:
    require_simulators()
    out = tmp_path_factory.mktemp("sim") / "reach"
    done = run_cli(["dataset", "synth", str(out), "--env", ENV, "--episodes", "3", "--seed", "0", "--image-size", "32"])
    assert done.returncode == 0, done.stderr
    return out


def _args(experts: Path, out: Path, *extra: str, env: str | None = ENV, steps: int = 6) -> list[str]:
    return ["--config_path", str(EXAMPLES / "pi05_tiny_config.json"), f"--dataset.root={experts}",
            f"--output_dir={out}", f"--steps={steps}", "--save_freq=2", "--validation.val_split=0", "--validation.val_freq=0",
            *([f"--eval.env={env}"] if env else []), "--eval.rollouts=2", "--eval.max_steps=6", *extra]


@pytest.fixture(scope="module")
def run(experts, tmp_path_factory):
    """A 2-rank DDP launch: its checkpoints, saved from replicated ranks, are evaluated from the published files (the
    sharded backends' launches are test_a_sharded_run_has_its_checkpoint_evaluated_from_the_published_files).
    Training holds before step 3 until checkpoint 000002's evaluation has begun (the fault helper's `wait`): on a
    loaded machine the launcher's evaluation thread can otherwise first look after 000004 is out, and skip 000002."""
    out = tmp_path_factory.mktemp("eval_run") / "run"
    begun = {"PYTHONPATH": str(HOOKS), "TEST_FAULT": "wait@3:0", "TEST_FAULT_RANK": "any",
             "TEST_FAULT_AFTER": f'{out / "evals" / "queue.json"}#"running": "000002"'}
    done = run_cli(["train", *_args(experts, out, "--checkpoint.keep_best=1",
                                    "--checkpoint.best_metric=eval/success_rate", "--checkpoint.best_mode=max"),
                    "--accelerate-config", str(EXAMPLES / "accelerate_cpu_ddp_config.yaml")], env=begun)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done


def _records(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "evals").glob("0*.json"))}


def test_every_published_checkpoint_is_evaluated_or_recorded_as_skipped_and_the_final_one_evaluated(run):
    out, _ = run
    records = _records(out)
    assert sorted(records) == ["000002", "000004", "000006"]
    assert {r["status"] for r in records.values()} <= {"done", "skipped"}
    assert records["000002"]["status"] == "done" and records["000006"]["status"] == "done"
    assert all(r["episodes_run"] == 2 for r in records.values() if r["status"] == "done")
    final = records["000006"]
    assert final["env"] == ENV and final["rollouts"] == 2 and final["seed"] == 0 and final["episodes_run"] == 2
    assert [e["seed"] for e in final["episodes"]] == [0, 1]
    assert all(e["steps"] <= 6 for e in final["episodes"])
    assert json.loads((out / "evals" / "queue.json").read_text()) == {"running": None, "waiting": []}
    for name in ("000002", "000006"):  # the checkpoints' own files untouched: their manifests still vouch for them
        if (out / "checkpoints" / name).is_dir():
            assert run_cli_in_process(["checkpoint", "verify", str(out / "checkpoints" / name)]).returncode == 0


def test_each_result_is_one_metrics_row_at_its_checkpoints_step(run):
    out, _ = run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if r.get("kind") == "eval"]
    done = {int(n): r for n, r in _records(out).items() if r["status"] == "done"}
    assert sorted(r["step"] for r in evaluated) == sorted(done)
    for row in evaluated:
        record = done[row["step"]]
        assert row["eval/success_rate"] == record["success_rate"]
        assert row["eval/mean_return"] == record["mean_return"]
        assert row["eval/episode_length"] == record["mean_steps"]
    assert any(p.name.endswith(".eval") for p in (out / "tensorboard").rglob("*"))


def test_best_is_the_checkpoint_with_the_highest_success_rate_and_the_summary_names_it(run):
    out, done = run
    records = {n: r for n, r in _records(out).items() if r["status"] == "done"}
    best = max(records, key=lambda n: (records[n]["success_rate"], int(n)))
    assert (out / "checkpoints" / "best").resolve().name == best
    assert f"the best is checkpoint {best}" in done.stderr
    assert "at checkpoint 000006 (the last evaluated)" in done.stderr


def test_checkpoint_list_and_inspect_show_the_success_rates(run, tmp_path):
    out, _ = run
    listed = run_cli_in_process(["checkpoint", "list", str(out)])
    assert listed.returncode == 0, listed.stderr
    rate = f"{_records(out)['000006']['success_rate']:.1%}"
    line = next(line for line in listed.stdout.splitlines() if "000006" in line)
    assert rate in line
    shown = run_cli_in_process(["checkpoint", "inspect", str(out / "checkpoints" / "000006")])
    assert f"success rate:    {rate} (" in shown.stdout and ENV in shown.stdout
    plot = tmp_path / "curves.png"
    drawn = run_cli_in_process(["checkpoint", "inspect", str(out), "--plot", str(plot)])
    assert drawn.returncode == 0, drawn.stderr
    assert plot.stat().st_size > 0 and "success rate:" in drawn.stdout


@pytest.mark.parametrize("env, extra, said", [
    ("metaworld:no-such-task-v3", [], "no-such-task-v3"),
    ("aloha:transfer_cube", [], "camera"),
    (None, ["--checkpoint.keep_best=1", "--checkpoint.best_metric=eval/success_rate", "--checkpoint.best_mode=max"],
     "set eval.env"),
])
def test_bad_evaluation_settings_are_refused_before_launch_and_nothing_is_written(experts, tmp_path, env, extra, said):
    out = tmp_path / "run"
    args = _args(experts, out, *extra, env=env)
    for command in (["config", "validate", *args[1:]], ["train", *args]):  # validate takes the config as its argument
        done = run_cli_in_process(command)
        assert done.returncode == 2, done.stdout + done.stderr
        assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not out.exists()


def test_the_model_card_reports_the_checkpoints_success_rate_with_env_seeds_and_episodes(run):
    from opentau_cli.config.load import load_config
    from opentau_cli.tools.model_card import CardFacts, render

    out, _ = run
    ckpt = out / "checkpoints" / "000006"
    record = _records(out)["000006"]
    card = render(CardFacts(repo_id="bob/reach", branch="main", layout="lerobot",
                            config=load_config(str(ckpt / "train_config.json"), {}),
                            state=json.loads((ckpt / "training_state.json").read_text()), run="run",
                            checkpoint="000006", manifest_xxh3="d" * 32, weights="live", dataset="reach",
                            simulator=record, files=["model.safetensors"]))
    assert (f"Success rate **{record['success_rate']:.1%}** ({record['successes']} of 2 episodes; " in card
            and f"in `{ENV}`, episodes from seeds 0 to 1, evaluated during training at step 6" in card)


@pytest.mark.parametrize("accelerate", ["accelerate_cpu_deepspeed_config.yaml", "accelerate_cpu_deepspeed_zero3_config.yaml",
                                        "accelerate_cpu_fsdp2_config.yaml"])  # DDP's: the `run` fixture's launch
def test_a_sharded_run_has_its_checkpoint_evaluated_from_the_published_files(experts, tmp_path, accelerate):
    out = tmp_path / "run"
    done = run_cli(["train", *_args(experts, out, steps=2), "--accelerate-config", str(EXAMPLES / accelerate)])
    assert done.returncode == 0, done.stdout + done.stderr
    record = _records(out)["000002"]
    assert record["status"] == "done" and record["episodes_run"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/success_rate"] for r in rows if r.get("kind") == "eval"] == [record["success_rate"]]


def test_a_rollback_moves_the_newer_checkpoints_records_aside_and_their_new_saves_are_evaluated(run, tmp_path):
    out, _ = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy, symlinks=True)
    done = run_cli(["resume", str(copy / "checkpoints" / "000002"), "--rollback=true"])
    assert done.returncode == 0, done.stdout + done.stderr
    aside = next((copy / "rolled_back").iterdir())
    assert sorted(p.name for p in (aside / "evals").iterdir()) == ["000004.json", "000006.json"]
    records = _records(copy)
    assert records["000002"] == _records(out)["000002"]  # kept: its checkpoint is the resume point
    assert records["000006"]["status"] == "done"
    assert records["000004"]["status"] in ("done", "skipped")


@pytest.fixture(scope="module")
def tracked(experts, tmp_path_factory, s3_server):
    """One launch logging to W&B (offline, the real package) and MLflow (a local file store), its checkpoints copied
    to the test S3 server (checkpoint.remote)."""
    import mlflow, wandb  # noqa: F401  (dev dependencies: missing ones fail here, never skip)

    base = tmp_path_factory.mktemp("tracked")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **s3_server.env,
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(base / "wandb_config"),
           "WANDB_CACHE_DIR": str(base / "wandb_cache"), "MLFLOW_TRACKING_URI": f"file:{base / 'mlruns'}",
           "MLFLOW_ALLOW_FILE_STORE": "true"}
    out = base / "run"
    remote = s3_server.url("tracked")
    done = run_cli(["train", *_args(experts, out, "--logging.trackers=tensorboard,wandb,mlflow",
                                    "--logging.project=reach", f"--checkpoint.remote={remote}")], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, env, s3_server


def _done(out: Path) -> list[dict]:
    return [r for _, r in sorted(_records(out).items()) if r["status"] == "done"]


def test_wandb_gets_each_result_once_with_the_checkpoints_step_as_its_axis(tracked):
    out, _, _ = tracked
    runs = wandb_runs(out)
    state = json.loads((out / "checkpoints" / "000006" / "training_state.json").read_text())
    assert {r["id"] for r in runs} == {state["trackers"]["wandb"]}  # one run (the last result continued it)
    logged = [(step, v) for r in runs for step, v in r["history"] if "eval/success_rate" in v]
    assert [(v["eval/step"], v["eval/success_rate"], v["eval/mean_return"], v["eval/episode_length"]) for _, v in logged] \
        == [(r["step"], r["success_rate"], r["mean_return"], r["mean_steps"]) for r in _done(out)]
    assert all(step >= v["eval/step"] for step, v in logged)  # at the moment it was there, never before
    train = [step for r in runs for step, v in r["history"] if "train/loss" in v]
    assert train == sorted(set(train))  # the training's own steps untouched: none twice


def test_mlflow_gets_each_result_at_its_checkpoints_step(tracked, monkeypatch):
    out, env, _ = tracked
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(key, env[key])
    run_id = json.loads((out / "checkpoints" / "000006" / "training_state.json").read_text())["trackers"]["mlflow"]
    done = _done(out)
    assert mlflow_metric(run_id, "eval/success_rate") == [(r["step"], r["success_rate"]) for r in done]
    assert mlflow_metric(run_id, "eval/mean_return") == [(r["step"], r["mean_return"]) for r in done]
    assert mlflow_metric(run_id, "eval/episode_length") == [(r["step"], r["mean_steps"]) for r in done]


def test_the_remote_copy_holds_every_record_the_final_ones_included(tracked):
    import boto3

    out, _, server = tracked
    client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    listed = client.list_objects_v2(Bucket=server.bucket, Prefix="tracked/evals/")["Contents"]
    stored = {o["Key"].rsplit("/", 1)[1]: client.get_object(Bucket=server.bucket, Key=o["Key"])["Body"].read()
              for o in listed}
    local = {p.name: p.read_bytes() for p in (out / "evals").glob("*.json")}
    assert stored == local and "000006.json" in stored
    rows = client.get_object(Bucket=server.bucket, Key="tracked/metrics.jsonl")["Body"].read()
    assert rows == (out / "metrics.jsonl").read_bytes()


def test_a_resume_finishes_the_evaluation_a_killed_launcher_left_running_logs_it_once_and_stores_it_remotely(
        tracked, monkeypatch):
    """Last of the tracked launch's tests (it changes the run): the final evaluation owed (its record gone here and
    in the store, as when the launcher was killed or Ctrl-C stopped the end of the run), `opentau resume RUN`
    evaluates it, stores it, and logs it nowhere twice (metrics.jsonl, W&B, MLflow)."""
    import boto3

    out, env, server = tracked
    client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    before = _records(out)["000006"]
    eval_rows = [(s, v) for r in wandb_runs(out) for s, v in r["history"] if "eval/success_rate" in v]
    (out / "evals" / "000006.json").unlink()
    client.delete_object(Bucket=server.bucket, Key="tracked/evals/000006.json")
    (out / "evals" / "queue.json").write_text(json.dumps({"running": "000006", "waiting": []}))
    done = run_cli(["resume", str(out)], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr.count("Every checkpoint of") == 1, done.stderr  # said once, before the evaluation
    again = _records(out)["000006"]
    assert again["status"] == "done" and again["episodes"] == before["episodes"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "eval"].count(6) == 1  # its row logged once
    stored = client.get_object(Bucket=server.bucket, Key="tracked/evals/000006.json")["Body"].read()
    assert json.loads(stored) == again
    assert [(s, v) for r in wandb_runs(out) for s, v in r["history"] if "eval/success_rate" in v] == eval_rows
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(key, env[key])
    run_id = json.loads((out / "checkpoints" / "000006" / "training_state.json").read_text())["trackers"]["mlflow"]
    assert mlflow_metric(run_id, "eval/success_rate") == [(r["step"], r["success_rate"]) for r in _done(out)]


def _write_result(run_dir: Path, step: int, rate: float) -> None:
    """A done record as the evaluation process leaves it (written here by hand, store/evals.py's layout)."""
    (run_dir / "evals").mkdir(exist_ok=True)
    (run_dir / "evals" / f"{step:06d}.json").write_text(json.dumps(
        {"status": "done", "step": step, "success_rate": rate, "mean_return": 10 * rate, "mean_steps": 50 - step}))


def _wandb_results(run_dir: Path) -> list[tuple]:
    return [(r["id"], step, v["eval/step"], v["eval/success_rate"], v["eval/mean_return"], v["eval/episode_length"])
            for r in wandb_runs(run_dir) for step, v in r["history"] if "eval/success_rate" in v]


def test_wandb_takes_one_result_per_step_as_they_appear_the_rest_after_the_ranks_and_a_fork_takes_its_own(
        tmp_path, offline_trackers):
    from opentau_cli.train.trackers import Trackers, log_late_evaluations

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = cfg_for(run_dir)
    first = Trackers.open(MAIN, cfg, run_dir)
    first.log(records([1])[0])
    _write_result(run_dir, 2, 0.5)
    _write_result(run_dir, 4, 0.75)
    (run_dir / "evals" / "000003.json").write_text(json.dumps({"status": "skipped", "step": 3, "reason": "newer"}))
    for record in records(range(2, 5)):
        first.log(record)
    _write_result(run_dir, 6, 1.0)
    ids = first.state()
    first.close()  # one last look, at the last step logged
    _write_result(run_dir, 8, 0.0)  # after the ranks
    log_late_evaluations(run_dir, "reach")  # the launcher's, once the ranks are gone
    run = ids["wandb"]
    assert _wandb_results(run_dir) == [(run, 2, 2, 0.5, 5.0, 48), (run, 3, 4, 0.75, 7.5, 46),
                                       (run, 4, 6, 1.0, 10.0, 44), (run, 5, 8, 0.0, 0.0, 42)]

    # Rolled back to step 2 (the newer records go aside): the fork holds 000002's from its parent, takes the new 000004.
    for step in (4, 6, 8):
        (run_dir / "evals" / f"{step:06d}.json").unlink()
    forked = Trackers.open(MAIN, cfg, run_dir, resume_state={"trackers": ids}, step=2)
    _write_result(run_dir, 4, 0.25)
    forked.log(records([3])[0])
    fork = forked.state()["wandb"]
    forked.close()
    assert fork != run and [r for r in _wandb_results(run_dir) if r[0] == fork] == [(fork, 3, 4, 0.25, 2.5, 46)]


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_a_run_stopped_during_an_evaluation_leaves_no_half_record_and_the_resume_redoes_it(experts, tmp_path, stop):
    """SIGTERM to every process of the job (a scheduler's preemption) or SIGKILL (the machine lost) while an
    evaluation process runs: no record of it, the queue names it, and `opentau resume` evaluates it first. Four steps:
    the stop comes during 000002's evaluation while training goes on to 000004, which the resume trains and evaluates
    (six steps would only add one more checkpoint of the same kind)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([opentau_bin(), "train", *_args(experts, out, steps=4)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)

    seen: list[list[str]] = []  # the command lines of the evaluation processes found last

    def evaluating() -> list[list[str]]:
        seen[:] = live_descendants(proc.pid, "opentau_cli.sim.watch")
        return seen

    try:
        wait_for(evaluating, "an evaluation process", proc)
        name = Path(seen[0][-1]).name
        os.killpg(proc.pid, getattr(signal, stop))
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (out / "evals" / f"{name}.json").exists()
    assert name in json.dumps(json.loads((out / "evals" / "queue.json").read_text()))
    if stop == "SIGTERM":  # the launcher said what is owed
        said = next(line for line in stderr.splitlines() if "not evaluated yet" in line)
        assert proc.returncode == 0 and name in said and "`opentau resume" in said, stderr
    done = run_cli(["resume", str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    records = _records(out)
    assert records[name]["status"] == "done" and records["000004"]["status"] == "done"
    assert records[name]["episodes_run"] == 2 and set(records) == {"000002", "000004"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if r.get("kind") == "eval"]
    assert sorted(logged) == sorted(int(n) for n, r in records.items() if r["status"] == "done")  # each once
    assert json.loads((out / "evals" / "queue.json").read_text()) == {"running": None, "waiting": []}


def test_a_redone_evaluation_logs_its_result_once_in_metrics_jsonl_and_mlflow(tmp_path, offline_trackers):
    """An evaluation killed after logging and before its record is redone: its row and MLflow points are not doubled."""
    from opentau_cli.sim.watch import log_result
    from opentau_cli.train.trackers import Trackers

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = cfg_for(run_dir)
    trackers = Trackers.open(MAIN, cfg, run_dir)
    run_id = trackers.state()["mlflow"]
    trackers.close()
    record = {"step": 4, "success_rate": 0.5, "mean_return": 3.25, "mean_steps": 40.0}
    for _ in range(2):
        log_result(run_dir, cfg, record)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 4, "kind": "eval", "eval/success_rate": 0.5, "eval/mean_return": 3.25,
                     "eval/episode_length": 40.0}]
    assert mlflow_metric(run_id, "eval/success_rate") == [(4, 0.5)]
    assert mlflow_metric(run_id, "eval/episode_length") == [(4, 40.0)]
