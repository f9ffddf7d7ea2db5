"""Rank 0's training log: metrics.jsonl, TensorBoard (through Accelerate's tracker) and a progress display."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import IO

from opentau_cli.train.trackers import Trackers, tracker_values


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop records past the checkpoint's step (logged by a run that died after it), so steps never repeat."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except ValueError:
            continue  # a line cut short by a kill
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)


class Progress:
    """A rich bar on a terminal; plain `step N/T ...` lines otherwise (logs, CI). `restarts` > 0 (a run restarted
    automatically that many times) shows as "restart N" on every line, so the user sees the run was restarted."""

    def __init__(self, total: int, start: int, console: IO | None, mode: str, *, restarts: int = 0, uploads=None):
        self.total, self.start = total, start
        self.restarts = restarts
        self.uploads = uploads  # process/uploader.py StatusView with checkpoint.remote: shown on each line
        self.console = console
        self._bar = None
        self._t0 = time.perf_counter()
        if console is None:
            return
        rich = mode == "rich" or (mode == "auto" and console.isatty())
        if rich:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            label = f"[bold]train (restart {restarts})" if restarts > 0 else "[bold]train"
            self._bar = RichProgress(
                TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(), console=Console(file=console, force_terminal=True),
                # The rank's own prints (e.g. each step's JSON record) stay in its log, never above the bar.
                redirect_stdout=False, redirect_stderr=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, record: dict | None) -> None:
        if self.console is None:
            return
        remote = ""
        if self.uploads is not None:
            remote, news = self.uploads.poll()
            for line in news:
                self.message(line)
            remote = f"  {remote}" if remote else ""
        if self._bar is not None:
            info = f"loss {record['loss']:.4f}  {record['samples_per_s']:.1f} samples/s{remote}" if record else None
            self._bar.update(self._task, completed=step, **({"info": info} if info else {}))
        elif record is not None:
            done = step - self.start
            eta = (time.perf_counter() - self._t0) / max(done, 1) * (self.total - step)
            restarted = f"  restart {self.restarts}" if self.restarts > 0 else ""
            self.console.write(
                f"step {step}/{self.total}{restarted}  loss {record['loss']:.4f}  lr {record['lr']:.3g}  "
                f"grad_norm {record['grad_norm']:.3g}  {record['samples_per_s']:.1f} samples/s  ETA {format_eta(eta)}{remote}\n"
            )
            self.console.flush()

    def message(self, text: str) -> None:
        if self.console is None:
            return
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            self.console.write(text + "\n")
            self.console.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class MetricsLogger:
    """Writes each record as one JSON line (rank 0 only), to TensorBoard via `accelerator.log`, and to the run's
    other trackers (train/trackers.py): every tracker gets every record metrics.jsonl gets."""

    def __init__(self, accelerator, path: Path, *, tensorboard: bool, trackers: Trackers | None = None):
        self.accelerator = accelerator
        self.enabled = accelerator.is_main_process
        self.path = path
        self.tensorboard = tensorboard
        self.trackers = trackers if trackers is not None else Trackers(path.parent)  # none: a no-op
        self._file = open(path, "a") if self.enabled else None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tensorboard:
            self.accelerator.log(tracker_values(record), step=record["step"])
        self.trackers.log(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.trackers.close()
