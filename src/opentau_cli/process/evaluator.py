"""The evaluation of the run's published checkpoints in a simulator (eval.env), followed by a thread of the launcher
(docs/ARCHITECTURE.md, "Evaluation during training").

The thread follows `checkpoints/last` as the uploader does (process/uploader.py) and evaluates each due checkpoint
(every eval.every-th by step / save_freq, and the final one) in a process of its own (`python -m
opentau_cli.sim.watch`), never on the ranks: the training loop never waits for it. One evaluation at a time: a
checkpoint published while one runs waits, and when a newer one is published before its turn it is recorded as
skipped (evals/<step>.json), so at most one waits. `evals/queue.json` holds the one running and those waiting:
retention keeps them (train/manager.py), and a launcher that starts again (a restart, a resume, after a preemption)
first evaluates what it names, then every due checkpoint of the run with no record, oldest first; the evaluation
writes its record last and atomically, so a killed one is redone, never half-recorded.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from opentau_cli.store import evals
from opentau_cli.store.layout import CHECKPOINTS, MANIFEST, read_last, step_of
from opentau_cli.store.lineage import current_branch

EVAL_MODULE = "opentau_cli.sim.watch"


def is_due(name: str, *, save_freq: int, every: int, total_steps: int) -> bool:
    step = step_of(name)
    return step is not None and (step == total_steps or (step % save_freq == 0 and (step // save_freq) % every == 0))


class Evaluator:
    """Evaluates the run's due published checkpoints one at a time from a background thread (see the module doc)."""

    def __init__(self, run_dir: Path, *, save_freq: int, every: int, total_steps: int, log: Path,
                 echo: Callable[[str], None] = print, poll_seconds: float = 0.5):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.due = lambda name: is_due(name, save_freq=save_freq, every=every, total_steps=total_steps)
        self.log, self.echo, self.poll_seconds = Path(log), echo, poll_seconds
        self.backlog: list[str] = []  # owed from before this launch, oldest first
        self.waiting: str | None = None  # published during this launch, waiting for its turn
        self.running: str | None = None
        self.later: list[str] = []  # killed evaluations: left to the next launch (queue.json names them)
        self.proc: subprocess.Popen | None = None
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._ending = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="opentau-evaluator", daemon=True)

    def owed(self) -> list[str]:
        """What earlier launches left: the queue's, then every due checkpoint of the run with no record, oldest first."""
        queue = evals.read_queue(self.run_dir)
        recorded = evals.records(self.run_dir)
        owed = [n for n in [queue["running"], *queue["waiting"]] if n and n not in recorded]
        owed += [p.name for p in current_branch(self.run_dir)
                 if self.due(p.name) and p.name not in recorded and (p / MANIFEST).is_file()]
        return sorted(set(owed), key=step_of)

    def start(self) -> "Evaluator":
        self.backlog = self.owed()
        self._seen = set(self.backlog) | set(evals.records(self.run_dir)) | {n for n in [read_last(self.root)] if n}
        self._write_queue()
        self._thread.start()
        return self

    def unseen(self) -> bool:
        """Whether `last` names a checkpoint the thread has not taken up yet (published a moment ago)."""
        return self._newest() is not None

    def pending(self) -> list[str]:
        return [n for n in [self.running, *self.backlog, self.waiting, *self.later] if n]

    def finish(self) -> list[str]:
        """Wait until every owed evaluation is done (the run's final checkpoint's included); returns what is left
        when interrupted (KeyboardInterrupt stops the one running: it is redone by the next launch)."""
        self._ending.set()
        try:
            while self._thread.is_alive():
                self._thread.join(self.poll_seconds)
        except KeyboardInterrupt:
            pass
        self.stop()
        return self.pending()

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
        self._thread.join(timeout=5)

    # The thread.

    def _newest(self) -> str | None:
        name = read_last(self.root)
        if name is None or name in self._seen or not (self.root / name / MANIFEST).is_file():
            return None
        return name

    def _follow(self) -> None:
        name = self._newest()
        if name is None:
            return
        due = [*self._missed(name), *([name] if self.due(name) else [])]  # oldest first
        self._seen.add(name)
        if not due:
            return
        for older in [n for n in [self.waiting, *due[:-1]] if n]:
            evals.write_record(self.run_dir, older, {
                "status": evals.SKIPPED, "step": step_of(older),
                "reason": f"checkpoint {due[-1]} was published before its turn (one evaluation at a time; the newest "
                          "waiting one goes next)"})
        self.waiting = due[-1]
        self._write_queue()

    def _missed(self, name: str) -> list[str]:
        """The due checkpoints saved since the newest one this thread saw that `last` never named while it looked
        (the run saved twice between two looks): overtaken like a waiting one, so recorded as skipped too."""
        step, width = step_of(name), len(name)
        seen = [s for s in map(step_of, self._seen) if s is not None and s < step]
        recorded = evals.records(self.run_dir)
        between = (str(s).zfill(width) for s in range(max(seen, default=0) + 1, step))
        return [n for n in between if self.due(n) and n not in recorded and n not in self.pending()]

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._follow()
            if self.backlog:
                name = self.backlog.pop(0)
            elif self.waiting is not None:
                name, self.waiting = self.waiting, None
            else:
                if self._ending.is_set() and self._newest() is None:
                    return
                self._stop.wait(self.poll_seconds)
                continue
            self.running = name
            self._write_queue()
            self._evaluate(name)
            if not self._stop.is_set():
                self.running = None
                self._write_queue()

    def _evaluate(self, name: str) -> None:
        ckpt = self.root / name
        if not (ckpt / MANIFEST).is_file():
            evals.write_record(self.run_dir, name, {"status": evals.SKIPPED, "step": step_of(name),
                                                    "reason": "deleted before its evaluation"})
            return
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", EVAL_MODULE, str(self.run_dir), str(ckpt)],
                                         stdout=log, stderr=log)
            while self.proc.poll() is None:  # still following what is published: a checkpoint it skips is said
                self._follow()
                self._stop.wait(self.poll_seconds)
            rc = self.proc.returncode
        if self._stop.is_set():
            return  # stopped by the launcher: left in the queue, redone by the next launch
        if rc < 0:  # killed by a signal (a preemption reaching the whole job, the OOM killer): owed, not failed
            self.later.append(name)
            self.echo(f"The evaluation of checkpoint {name} was killed (signal {-rc}); the next launch redoes it.")
        elif rc != 0:
            evals.write_record(self.run_dir, name, {"status": "failed", "step": step_of(name),
                                                    "reason": f"exit code {rc}; see {self.log}"})
            self.echo(f"The evaluation of checkpoint {name} failed (exit code {rc}); see {self.log}. Training goes on.")

    def _write_queue(self) -> None:
        waiting = [n for n in [*self.backlog, self.waiting, *self.later] if n]
        try:
            evals.write_queue(self.run_dir, self.running, waiting)
        except OSError:
            pass  # advisory while it runs; a restart recomputes what is owed from the records
