"""Experiment trackers (W&B, MLflow, and whatever else Accelerate's tracker API supports) for rank 0's training log.

`logging.trackers` names them; TensorBoard, the default, is written by the metrics logger (train/metrics.py) and is
not handled here. `Trackers.open` starts the others on the main process only (on every other process it is a
no-op), `log` gets every record metrics.jsonl gets (same keys as TensorBoard, same steps), `checkpoint` a save's
step, seconds blocked and size, `state` the run ids the checkpoint records (training_state.json `trackers`).

A resume continues the tracked run recorded in its checkpoint: W&B with `resume="must"` on the same id, MLflow the
same run id. When that run already holds steps past the checkpoint (a rollback, or a run killed after its last
save), continuing it would repeat steps: the resume forks instead (W&B `fork_from` at the checkpoint's step; MLflow a
new run holding the old one's metrics up to that step, tagged with where it came from). The last step each tracked
run got is kept in `<output_dir>/trackers.json` for that decision.

W&B also gets the evaluations in a simulator (eval.env, store/evals.py), which the launcher's evaluation process
records after the checkpoint's step has gone by: W&B drops a `log` at a step lower than its last one, so they are
logged at the step of the moment with `eval/step` (the checkpoint's step) as their x-axis (`define_metric`), one
per W&B step (a second log of the same keys at one step replaces the first). Rank 0 looks for new records each time
it logs (one listing of evals/, never waiting); what ends after the ranks (the final checkpoint's) the launcher logs
once they are gone (`log_late_evaluations`), continuing the run past its last step, one step per result.
trackers.json keeps, per checkpoint logged, the W&B step it went in at, so nothing is logged twice and a fork takes
again what its parent got after the fork's step (docs/ARCHITECTURE.md, "Evaluation during training"). MLflow takes
them from the evaluation process itself (sim/watch.py), by run id.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from opentau_cli.errors import UserError
from opentau_cli.store import evals

TENSORBOARD = "tensorboard"
WANDB = "wandb"
EVAL_STEP = "eval/step"  # W&B's x-axis of the evaluations: the evaluated checkpoint's step
LOGGED = "trackers.json"  # in the run directory: {tracker: {"id": run id, "step": the last step it got, W&B "evals"}}
# What a tracker needs installed: the import name and the opentau-cli extra that installs it.
EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


START_HINTS = {
    "wandb": "log in with `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to keep the run under "
             "<output_dir>/wandb/ for a later `wandb sync`",
    "mlflow": "set MLFLOW_TRACKING_URI to your tracking server (a local file: store also needs MLFLOW_ALLOW_FILE_STORE=true)",
}


def known_trackers() -> list[str]:
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    return sorted(LOGGER_TYPE_TO_CLASS)


def mlflow_setting(environ=None) -> str | None:
    """What stops MLflow from starting in this environment, as the setting to give (None: nothing). Without
    MLFLOW_TRACKING_URI MLflow 3 opens a sqlite store in the working directory, which its client package
    (mlflow-skinny) cannot open: the ranks would fail after launch with MLflow's own exception; a file: store is
    refused by MLflow unless MLFLOW_ALLOW_FILE_STORE=true."""
    environ = os.environ if environ is None else environ
    uri = environ.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        return ("logging.trackers names mlflow but MLFLOW_TRACKING_URI is not set: set it to your tracking server "
                "(e.g. http://mlflow.example:5000), or to a local store (file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true).")
    scheme = uri.split(":", 1)[0] if ":" in uri else ""
    file_store = scheme == "file" or (not scheme and uri not in ("databricks", "databricks-uc"))  # a bare path too
    allowed = environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")
    if file_store and not allowed:
        return (f"logging.trackers names mlflow with the file store MLFLOW_TRACKING_URI={uri}, which MLflow 3 refuses "
                "unless MLFLOW_ALLOW_FILE_STORE=true: set that too, or point MLFLOW_TRACKING_URI at your tracking server.")
    return None


# What a tracker needs set before launch, beyond being installed: one line naming the setting, or None.
SETTINGS = {"mlflow": mlflow_setting}


def check_trackers(cfg) -> list[str]:
    """Before launch: every tracker in logging.trackers is one Accelerate knows, is installed (one line each,
    naming the extra to install) and has the settings it needs to start (SETTINGS)."""
    # Accelerate's list imports torch (a second of CPU in the command): asked only for a tracker beyond the default
    known = known_trackers() if set(cfg.logging.trackers) - {TENSORBOARD} else [TENSORBOARD]
    errors = []
    for name in cfg.logging.trackers:
        if name not in known:
            errors.append(f"logging.trackers names '{name}', which is not a tracker Accelerate supports ({', '.join(known)}).")
            continue
        module, extra = EXTRAS.get(name, (name, None))
        if importlib.util.find_spec(module) is None:
            how = f"pip install 'opentau-cli[{extra}]'" if extra else f"pip install {module}"
            errors.append(f"logging.trackers names {name}, which is not installed: {how}.")
            continue
        problem = SETTINGS[name]() if name in SETTINGS else None
        if problem:
            errors.append(problem)
    return errors


def tracker_values(record: dict) -> dict:
    """A metrics.jsonl record as trackers log it: its numbers under train/ or val/ (TensorBoard's names)."""
    prefix = "val/" if record.get("kind") == "val" else "train/"
    return {prefix + k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def eval_values(record: dict) -> dict:
    """A done evaluation record (store/evals.py) as W&B logs it: metrics.jsonl's eval keys and its x-axis."""
    return {EVAL_STEP: int(record["step"]), **{key: record[field] for field, key in evals.LOGGED.items()}}


def _define_eval_axis(run) -> None:
    run.define_metric(EVAL_STEP, hidden=True)
    run.define_metric("eval/*", step_metric=EVAL_STEP)


def log_late_evaluations(run_dir: Path, project: str) -> None:
    """After the ranks are gone: the done evaluations W&B has not got yet (the final checkpoint's, evaluated after the
    ranks ended), in the run trackers.json names, continued past its last step, one step each (see the module doc)."""
    run_dir = Path(run_dir)
    logged = _read_logged(run_dir)
    entry = logged.get(WANDB)
    if not entry or "evals" not in entry:
        return
    late = [(n, r) for n, r in evals.new_records(run_dir, set(entry["evals"])) if r.get("status") == evals.DONE]
    if not late:
        return
    import wandb  # directly: this process has no Accelerator for Accelerate's tracker to log through

    run = wandb.init(project=project, id=entry["id"], resume="must", dir=str(run_dir))
    try:
        _define_eval_axis(run)
        for name, record in late:  # one step each: a second at the same step would replace the first's values
            entry["step"] = int(entry["step"]) + 1
            run.log(eval_values(record), step=entry["step"])
            entry["evals"][name] = entry["step"]
    finally:
        run.finish()
        _write_json(run_dir, logged)


def flat_config(config: dict, prefix: str = "") -> dict:
    """The resolved config as flat key -> scalar (what trackers store as hyperparameters)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, name + "."))
        else:
            out[name] = value if isinstance(value, (bool, int, float, str)) or value is None else json.dumps(value)
    return out


def _read_logged(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / LOGGED).read_text())
    except (OSError, ValueError):
        return {}


class Trackers:
    """The run's trackers other than TensorBoard; a no-op off the main process or when there are none."""

    def __init__(self, run_dir: Path, trackers: dict | None = None, ids: dict | None = None, step: int = 0):
        self.run_dir = Path(run_dir)
        self.trackers = trackers or {}  # name -> accelerate GeneralTracker, started
        self.ids = ids or {}  # name -> the tracked run's id
        self._logged = {name: {"id": self.ids[name], "step": step} for name in self.trackers}
        if WANDB in self.trackers:
            self._logged[WANDB]["evals"] = {}  # checkpoint name -> the W&B step its evaluation went in at
        self._looked: set[str] = set()  # evaluation records read and not for W&B (skipped, failed)
        self.notes: list[str] = []  # what open decided, for the console

    @classmethod
    def open(cls, accelerator, cfg, run_dir: Path, *, resume_state: dict | None = None, step: int = 0,
             lineage: dict | None = None) -> "Trackers":
        """Start the trackers of `cfg.logging.trackers` (but TensorBoard) on the main process; with `resume_state`
        (the checkpoint's training_state.json, resumed at `step`) continue or fork the runs it records; `lineage`
        (default: the checkpoint's) is recorded on the runs."""
        names = [n for n in dict.fromkeys(cfg.logging.trackers) if n != TENSORBOARD]
        run_dir = Path(run_dir)
        if not names or not accelerator.is_main_process:
            return cls(run_dir)
        recorded = (resume_state or {}).get("trackers") or {}
        lineage = lineage if lineage is not None else (resume_state or {}).get("lineage")
        logged = _read_logged(run_dir)
        trackers, ids, notes, forked = {}, {}, [], set()
        for name in names:
            old = recorded.get(name)
            past = logged.get(name, {})
            fork = old is not None and past.get("id") == old and int(past.get("step", 0)) > step
            try:
                tracker, ids[name] = _start(name, cfg, run_dir, old, step, fork)
            except Exception as exc:  # a login, a server, a run id the tracker does not know: the user's to fix
                raise UserError(f"logging.trackers: {name} did not start ({type(exc).__name__}: {exc}); "
                                f"{START_HINTS.get(name, 'check its settings')}.") from exc
            trackers[name] = tracker
            if fork:
                forked.add(name)
                notes.append(f"{name}: run {old} already holds steps past {step} (up to {past['step']}): continuing in "
                             f"run {ids[name]}, forked from it at step {step}.")
            elif old is not None:
                notes.append(f"{name}: continuing run {old} at step {step}.")
        self = cls(run_dir, trackers, ids, step)
        self.notes = notes
        if WANDB in trackers:
            _define_eval_axis(trackers[WANDB].run)
            before = logged.get(WANDB, {})
            if recorded.get(WANDB) is not None and before.get("id") == recorded[WANDB]:
                # continued, or forked: what the run got up to the fork's step
                self._logged[WANDB]["evals"] = {n: s for n, s in before.get("evals", {}).items() if s <= step}
        config = {k: v for k, v in cfg.to_json_dict().items() if k != "resume"}
        history = {"opentau.lineage": json.dumps(lineage)} if lineage else {}
        if resume_state is not None:
            history["opentau.resumed_at_step"] = str(step)
        for name, tracker in trackers.items():
            if recorded.get(name) is None or name in forked:
                tracker.store_init_configuration(flat_config(config))  # a new run: its hyperparameters
            _record_history(name, tracker, history)
        self._write_logged()
        return self

    def log(self, record: dict) -> None:
        """One metrics.jsonl record (train or val), at its step."""
        if not self.trackers:
            return
        values = tracker_values(record)
        for tracker in self.trackers.values():
            tracker.log(values, step=int(record["step"]))
        self._log_evaluations(int(record["step"]))
        self._mark(int(record["step"]))

    def checkpoint(self, step: int, seconds_blocked: float, path: Path | None = None) -> None:
        """A save: its step, how long training waited for it, its size on disk (when already written)."""
        if not self.trackers:
            return
        values = {"checkpoint/step": step, "checkpoint/seconds_blocked": float(seconds_blocked)}
        if path is not None and Path(path).is_dir():
            values["checkpoint/bytes"] = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        for tracker in self.trackers.values():
            tracker.log(values, step=step)
        self._mark(step)

    def state(self) -> dict:
        """The tracked runs' ids, for training_state.json (`trackers`)."""
        return dict(self.ids)

    def close(self) -> None:
        if WANDB in self.trackers:  # a last look, at the last step logged
            self._log_evaluations(self._logged[WANDB]["step"])
            self._write_logged()
        for tracker in self.trackers.values():
            tracker.finish()
        self.trackers = {}

    def _log_evaluations(self, step: int) -> None:
        """W&B: the evaluation records that appeared since the last look, at `step` (see the module doc)."""
        if WANDB not in self.trackers:
            return
        logged = self._logged[WANDB]["evals"]
        if step in logged.values():
            return  # one result per W&B step: a second at the same step would replace the first's values
        for name, record in evals.new_records(self.run_dir, set(logged) | self._looked):
            if record.get("status") != evals.DONE:
                self._looked.add(name)
                continue
            self.trackers[WANDB].log(eval_values(record), step=step)
            logged[name] = step
            return  # the next one at the next logging

    def _mark(self, step: int) -> None:
        for entry in self._logged.values():
            entry["step"] = max(entry["step"], step)
        self._write_logged()

    def _write_logged(self) -> None:
        _write_json(self.run_dir, self._logged)


def _write_json(run_dir: Path, logged: dict) -> None:
    tmp = run_dir / (LOGGED + ".tmp")
    tmp.write_text(json.dumps(logged) + "\n")
    tmp.replace(run_dir / LOGGED)


def _start(name: str, cfg, run_dir: Path, old: str | None, step: int, fork: bool):
    """A started Accelerate tracker `name` and the id of its run: a new run, `old` continued, or `old` forked at `step`."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    log = cfg.logging
    run_name = log.run_name or Path(cfg.output_dir).name
    if name == "wandb":
        kwargs = dict(name=run_name, tags=list(log.tags) or None, dir=str(run_dir))
        if old is not None and fork:
            kwargs.update(fork_from=f"{old}?_step={step}")
        elif old is not None:
            kwargs.update(id=old, resume="must")
        tracker = LOGGER_TYPE_TO_CLASS["wandb"](log.project, **kwargs)
        tracker.start()
        return tracker, tracker.run.id
    if name == "mlflow":
        tags = {tag: "" for tag in log.tags}
        if fork:
            tags["opentau.forked_from"] = f"{old}@{step}"
        tracker = LOGGER_TYPE_TO_CLASS["mlflow"](experiment_name=log.project, run_id=None if fork else old, tags=tags or None,
                                                run_name=run_name)
        tracker.start()
        run_id = tracker.active_run.info.run_id
        if fork:
            _copy_mlflow_history(old, run_id, step)
        return tracker, run_id
    cls = LOGGER_TYPE_TO_CLASS[name]
    kwargs = {"logging_dir": str(run_dir / name)} if getattr(cls, "requires_logging_directory", False) else {}
    tracker = cls(log.project, **kwargs)
    tracker.start()
    return tracker, old or run_name


def _record_history(name: str, tracker, values: dict) -> None:
    """Where the run comes from (lineage, resume step) on the tracked run: W&B config, MLflow tags (its parameters
    cannot change once logged)."""
    if not values:
        return
    if name == "mlflow":
        import mlflow

        mlflow.set_tags(values)
    else:
        tracker.store_init_configuration(values)


def _copy_mlflow_history(source: str, target: str, step: int) -> None:
    """The metrics `source` got up to `step`, into `target`: a forked run starts with its parent's history."""
    from mlflow import MlflowClient

    client = MlflowClient()
    keys = client.get_run(source).data.metrics
    points = [m for key in keys for m in client.get_metric_history(source, key) if m.step <= step]
    for i in range(0, len(points), 1000):  # MLflow's limit per batch
        client.log_batch(target, metrics=points[i:i + 1000])


if __name__ == "__main__":  # the launcher's, once the ranks are gone: python -m opentau_cli.train.trackers RUN PROJECT
    import sys

    log_late_evaluations(Path(sys.argv[1]), sys.argv[2])
