"""Where the test suite's CPU goes, by kind of process: scripts/test.sh starts this beside pytest and stops it with
SIGTERM when the tests end; it then prints one table (docs/development.md, "How long the suite takes").

On CI's two cores the suite keeps both busy, so its minutes are CPU seconds; most of them are spent by the processes
the tests start (ranks, launchers, `opentau` commands), which pytest's per-module times do not separate. Every
process is read from /proc five times a second: its CPU (user + system) when last seen, counted from when this began
for a process that was already running, and the test that started it (PYTEST_CURRENT_TEST in its environment). A
process that lives less than a fifth of a second may be missed: it costs less than that. Linux only; elsewhere it
prints nothing.

    python scripts/cpu_by_process.py     (until SIGTERM)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter

PERIOD = 0.2
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# (kind, what its command line holds), first match wins: a launcher's names the ranks' module too.
KINDS = [
    ("Accelerate's launchers", ("opentau_cli.process.accelerate_launcher", "accelerate.commands.launch")),
    ("ranks (train and profile workers)", ("opentau_cli.train.worker", "opentau_cli.profiling.worker")),
    ("evaluations during training", ("opentau_cli.sim.watch",)),
    ("asynchronous checkpoint writers", ("opentau_cli.train.async_save",)),
    ("`opentau` commands (train, resume, eval, ...)", ("bin/opentau ", "bin/opentau-train ")),
    ("pytest and its workers (the tests that run in-process)", ("exec(eval(sys.stdin.readline()))", "-m pytest ")),
]


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
        self.me = os.getpid()
        self.seen: dict[tuple[int, int], dict] = {}
        self.first = True

    def sample(self) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == self.me:
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rindex(")") + 2:].split()
                ppid, cpu, start = int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[19])
                if ppid == 2 or int(name) == 2:
                    continue  # a kernel thread
                key = (int(name), start)
                proc = self.seen.get(key)
                if proc is None:
                    proc = self.seen[key] = self._describe(name, stat, cpu if self.first else 0.0)
                proc["cpu"] = cpu
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        self.first = False

    @staticmethod
    def _describe(pid: str, stat: str, before: float) -> dict:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        test = ""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for item in f.read().split(b"\0"):
                    if item.startswith(b"PYTEST_CURRENT_TEST="):
                        test = item.split(b"=", 1)[1].decode(errors="replace").split("::")[0]
        except OSError:
            pass
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        return {"kind": kind_of(cmdline, comm), "test": test, "before": before, "cpu": before}

    def report(self) -> str:
        cpu, count, modules = Counter(), Counter(), Counter()
        for proc in self.seen.values():
            used = max(0.0, proc["cpu"] - proc["before"])
            if used <= 0:
                continue
            cpu[proc["kind"]] += used
            count[proc["kind"]] += 1
            if proc["test"]:
                modules[proc["test"]] += used
        total = sum(cpu.values())
        if not total:
            return ""
        lines = [f"CPU by kind of process, {total:.0f} CPU-s in all:"]
        for kind, seconds in cpu.most_common():
            share, each = 100 * seconds / total, seconds / count[kind]
            lines.append(f"{seconds:8.0f} s {share:3.0f}%  {count[kind]:5d} x {each:5.1f} s  {kind}")
        if modules:
            lines.append("the modules whose started processes used the most CPU:")
            lines += [f"{seconds:8.0f} s  {module}" for module, seconds in modules.most_common(10)]
        return "\n".join(lines)


def main() -> int:
    if not os.path.isdir("/proc/self"):
        return 0
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
