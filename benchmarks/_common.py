"""What every benchmark script shares: the machine line, running the CLI, appending results to BENCHMARKS.md.

Benchmarks print ratios against their anchors; they are scripts, never timed tests (CI runs their --smoke mode).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "configs" / "examples"
BENCHMARKS_MD = REPO / "BENCHMARKS.md"
SMALL_CONFIG = REPO / "benchmarks" / "pi05_small_bench.json"
TINY_CONFIG = EXAMPLES / "pi05_tiny_config.json"

HEADER = """# Benchmarks

Results appended by the scripts in `benchmarks/` (one section per run; never rewritten). Each section says when, on
what machine and with which command it ran. Numbers from a shared or noisy machine say so.
"""


def opentau_bin() -> str:
    candidate = Path(sys.executable).parent / "opentau"
    return str(candidate) if candidate.exists() else "opentau"


def machine() -> str:
    import torch

    cpus = os.cpu_count()
    load = ", load avg %.1f/%.1f/%.1f" % os.getloadavg() if hasattr(os, "getloadavg") else ""
    gpu = f", GPU {torch.cuda.get_device_name()} x{torch.cuda.device_count()}" if torch.cuda.is_available() else ", no GPU"
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (f"{platform.platform()}, {platform.processor() or platform.machine()}, {cpus} CPUs{gpu}{load}; "
            f"OMP_NUM_THREADS={threads}; python {platform.python_version()}, torch {torch.__version__}")


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def env() -> dict:
    e = dict(os.environ)
    e.setdefault("OPENTAU_CACHE_DIR", str(REPO / ".cache" / "opentau"))
    e.pop("OPENTAU_DEBUG", None)
    return e


def run(args: list[str], *, timeout: float = 3600, check: bool = True, extra_env: dict | None = None,
        ok: tuple[int, ...] = (0,)) -> tuple[subprocess.CompletedProcess, float]:
    """Run a command (usually the installed CLI), with `extra_env` on top of this process's variables; returns the
    result and its wall time in seconds. `ok`: the exit codes that count as success when `check`."""
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env={**env(), **(extra_env or {})}, cwd=REPO,
                          timeout=timeout)
    wall = time.perf_counter() - start
    if check and proc.returncode not in ok:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(args)}")
    return proc, wall


def profile(args: list[str], json_path: Path, *, timeout: float = 3600) -> tuple[dict, subprocess.CompletedProcess, float]:
    """`opentau profile ARGS --json JSON_PATH`: its report (the JSON it wrote), the process and its wall time."""
    proc, wall = run([opentau_bin(), "profile", *args, "--json", str(json_path)], timeout=timeout)
    return json.loads(Path(json_path).read_text()), proc, wall


def p99(ordered: list[float]) -> float:
    """The 99th percentile of sorted values (the nearest rank; the largest value below 100 of them)."""
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def verdict(value: float, target: float, higher_is_better: bool = True) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "meets target" if ok else "BELOW target" if higher_is_better else "ABOVE target"


def append_result(title: str, rows: list[tuple[str, str]], notes: list[str], *, path: Path | None = None) -> Path:
    """Append one section (date, machine, command, a table, notes) to BENCHMARKS.md; never rewrites earlier ones."""
    path = path or BENCHMARKS_MD
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "",
        f"## {title} ({now})",
        "",
        f"- machine: {machine()}",
        f"- command: `{command_line()}`",
        "",
        "| measure | value |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        *[f"- {n}" for n in notes],
    ]
    if not path.exists():
        path.write_text(HEADER)
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")
    return path


def report(args, title: str, rows: list[tuple[str, str]], notes: list[str]) -> None:
    """Append the section to args.results unless --no-append; a --smoke run's first note says it is one."""
    if args.no_append:
        return
    if args.smoke:
        notes = ["smoke run: numbers only show the script works", *notes]
    append_result(title, rows, notes, path=args.results)


def base_parser(doc: str):
    import argparse

    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="A few steps on the tiny preset: checks the script works (CI).")
    parser.add_argument("--results", type=Path, default=BENCHMARKS_MD, help="Markdown file the result is appended to.")
    parser.add_argument("--config", type=Path, help="Training config (default: benchmarks/pi05_small_bench.json; tiny with --smoke).")
    parser.add_argument("--no-append", action="store_true", help="Print only; do not append to the results file.")
    return parser


def print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    print(title)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
