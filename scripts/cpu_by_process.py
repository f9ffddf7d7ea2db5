"""Where the test suite's CPU goes, by kind of process: scripts/test.sh starts this beside pytest and stops it with
SIGTERM when the tests end; it then prints one table (docs/development.md, "Reading the timing print").

On CI's two cores the suite keeps both busy, so its minutes are CPU seconds; most of them are spent by the processes
the tests start (ranks, launchers, `opentau` commands), which pytest's per-module times do not separate. Every
process is read (psutil) five times a second: its CPU (user + system) when last seen, counted from when this began
for a process that was already running, the test that started it (PYTEST_CURRENT_TEST in its environment) and, for
an `opentau` command, its subcommand. A process that lives less than a fifth of a second may be missed: it costs
less than that.

    python scripts/cpu_by_process.py     (until SIGTERM)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter

import psutil

PERIOD = 0.2
# (kind, what its command line holds), first match wins: a launcher's names the ranks' module too.
KINDS = [
    ("Accelerate's launchers", ("opentau_cli.process.accelerate_launcher", "accelerate.commands.launch")),
    ("ranks (train and profile workers)", ("opentau_cli.train.worker", "opentau_cli.profiling.worker")),
    ("evaluations during training", ("opentau_cli.sim.watch",)),
    ("asynchronous checkpoint writers", ("opentau_cli.train.async_save",)),
    (COMMANDS := "`opentau` commands (train, resume, eval, ...)", ("bin/opentau ", "bin/opentau-train ")),
    ("pytest and its workers (the tests that run in-process)", ("exec(eval(sys.stdin.readline()))", "-m pytest ")),
]


# The commands that take a subcommand of their own (`opentau checkpoint list`).
GROUPS = ("checkpoint", "config", "dataset")


def subcommand(cmdline: list[str]) -> str:
    """`train`, `checkpoint list`, ...: the words after the console script (python, then its path) up to the first
    option; the script's name where none (`opentau-train`)."""
    words = []
    for word in cmdline[2:]:
        if word.startswith("-") or (words and words[0] not in GROUPS) or len(words) == 2:
            break
        words.append(word)
    return " ".join(words) or os.path.basename(cmdline[1] if len(cmdline) > 1 else cmdline[0])


def kind_of(cmdline: str, comm: str) -> str:
    for kind, marks in KINDS:
        if any(mark in cmdline for mark in marks):
            return kind
    if comm.startswith("python"):
        return "other Python (test drivers, peers' code, benchmarks)"
    if comm in ("weed",):
        return "S3 server (SeaweedFS)"
    if comm.startswith("slurm") or comm == "munged":
        return "SLURM and munge"
    return "other programs (compilers, git, ffmpeg, ...)"


class Watch:
    def __init__(self):
        self.started = time.time()
        # psutil.Process compares by pid and creation time, so a reused pid is another process. None: not counted.
        self.seen: dict[psutil.Process, dict | None] = {}

    def sample(self) -> None:
        for proc in psutil.process_iter():
            try:
                if proc not in self.seen:
                    self.seen[proc] = self._describe(proc)
                record = self.seen[proc]
                if record is not None:
                    times = proc.cpu_times()
                    record["cpu"] = times.user + times.system
            except psutil.Error:
                continue  # gone meanwhile

    def _describe(self, proc: psutil.Process) -> dict | None:
        if proc.pid in (2, os.getpid()) or proc.ppid() == 2:
            return None  # this watcher, or a kernel thread
        times = proc.cpu_times()
        before = times.user + times.system if proc.create_time() < self.started else 0.0
        try:
            test = proc.environ().get("PYTEST_CURRENT_TEST", "").split("::")[0]
        except psutil.AccessDenied:
            test = ""
        cmdline = proc.cmdline()
        kind = kind_of(" ".join(cmdline), proc.name())
        return {"kind": kind, "test": test, "before": before, "cpu": before,
                "command": subcommand(cmdline) if kind == COMMANDS else ""}

    def report(self) -> str:
        cpu, count, modules, commands, command_count = Counter(), Counter(), Counter(), Counter(), Counter()
        for record in filter(None, self.seen.values()):
            used = max(0.0, record["cpu"] - record["before"])
            if used <= 0:
                continue
            cpu[record["kind"]] += used
            count[record["kind"]] += 1
            if record["test"]:
                modules[record["test"]] += used
            if record["command"]:
                commands[record["command"]] += used
                command_count[record["command"]] += 1
        total = sum(cpu.values())
        if not total:
            return ""
        lines = [f"CPU by kind of process, {total:.0f} CPU-s in all:"]
        for kind, seconds in cpu.most_common():
            share, each = 100 * seconds / total, seconds / count[kind]
            lines.append(f"{seconds:8.0f} s {share:3.0f}%  {count[kind]:5d} x {each:5.1f} s  {kind}")
        if commands:
            lines.append("the `opentau` commands that used the most CPU:")
            lines += [f"{seconds:8.0f} s  {command_count[name]:5d} x {seconds / command_count[name]:5.1f} s  {name}"
                      for name, seconds in commands.most_common(10)]
        if modules:
            lines.append("the modules whose started processes used the most CPU:")
            lines += [f"{seconds:8.0f} s  {module}" for module, seconds in modules.most_common(10)]
        return "\n".join(lines)


def main() -> int:
    watch = Watch()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # Ctrl-C reaches this process with the tests: it still prints once scripts/test.sh asks. If the script itself is
    # gone (killed), it leaves at once without printing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    while not stopping:
        if os.getppid() != parent:
            return 0
        watch.sample()
        time.sleep(PERIOD)
    watch.sample()
    print(watch.report(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
