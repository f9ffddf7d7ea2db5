"""A run's evaluations in a simulator (eval.env): one record per published checkpoint, beside the checkpoints, and
the queue of the launcher's evaluation thread (docs/ARCHITECTURE.md, "Evaluation during training").

    evals/<step>.json   {"status": "done", "step", "env", "seed", "rollouts", "success_rate", "mean_return",
                         "mean_steps", ...} or {"status": "skipped", "step", "reason"}; written atomically, last
    evals/queue.json    {"running": name | null, "waiting": [names]}: what a restarted launcher owes

The records live outside the checkpoint directories, so a checkpoint's manifest still vouches for exactly its files,
and they outlive retention (the run's history of success). Imports nothing heavy: the launcher and the ranks read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from opentau_cli.store.layout import EVALS
from opentau_cli.store.manifest import write_json_atomic

QUEUE = "queue.json"
DONE, SKIPPED = "done", "skipped"
SUCCESS_KEY = "eval/success_rate"  # metrics.jsonl's key, and checkpoint.best_metric's name for it
# metrics.jsonl keys of a done record: the record's own field -> the logged key
LOGGED = {"success_rate": SUCCESS_KEY, "mean_return": "eval/mean_return", "mean_steps": "eval/episode_length"}


def evals_dir(run_dir: Path) -> Path:
    return Path(run_dir) / EVALS


def record_path(run_dir: Path, name: str) -> Path:
    return evals_dir(run_dir) / f"{name}.json"


def read_record(run_dir: Path, name: str) -> dict | None:
    try:
        return json.loads(record_path(run_dir, name).read_text())
    except (OSError, ValueError):
        return None


def write_record(run_dir: Path, name: str, record: dict) -> None:
    evals_dir(run_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(record_path(run_dir, name), record)


def records(run_dir: Path) -> dict[str, dict]:
    """{checkpoint name: its record}, every record the run holds."""
    out = {}
    folder = evals_dir(run_dir)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        if path.name != QUEUE and path.stem.isdigit():
            record = read_record(run_dir, path.stem)
            if record is not None:
                out[path.stem] = record
    return out


def new_records(run_dir: Path, known: set[str]) -> list[tuple[str, dict]]:
    """The records whose checkpoint names are not in `known`, oldest first: one listing of evals/, reading only
    those (a tracker's look at logging time, train/trackers.py)."""
    try:
        names = [e.name[:-5] for e in os.scandir(evals_dir(run_dir)) if e.name.endswith(".json")]
    except OSError:
        return []
    found = ((n, read_record(run_dir, n)) for n in sorted(names) if n.isdigit() and n not in known)
    return [(n, r) for n, r in found if r is not None]


def success_rate(run_dir: Path, name: str) -> float | None:
    record = read_record(run_dir, name)
    return float(record["success_rate"]) if record and record.get("status") == DONE else None


def read_queue(run_dir: Path) -> dict:
    try:
        queue = json.loads((evals_dir(run_dir) / QUEUE).read_text())
    except (OSError, ValueError):
        return {"running": None, "waiting": []}
    return {"running": queue.get("running"), "waiting": list(queue.get("waiting") or [])}


def write_queue(run_dir: Path, running: str | None, waiting: list[str]) -> None:
    evals_dir(run_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(evals_dir(run_dir) / QUEUE, {"running": running, "waiting": waiting})


def busy(run_dir: Path) -> set[str]:
    """The checkpoints retention keeps for the evaluation: the one under evaluation and those waiting for it."""
    queue = read_queue(run_dir)
    return {n for n in [queue["running"], *queue["waiting"]] if n}
