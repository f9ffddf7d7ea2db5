"""What every benchmark script shares: the machine line, running the CLI, recording results in BENCHMARKS.md.

Benchmarks print ratios against their anchors; they are scripts, never timed tests (CI runs their --smoke mode).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "configs" / "examples"
BENCHMARKS_MD = REPO / "BENCHMARKS.md"
SMALL_CONFIG = REPO / "benchmarks" / "pi05_small_bench.json"
TINY_CONFIG = EXAMPLES / "pi05_tiny_config.json"

HEADER = """# Benchmarks

The latest run of each benchmark: the table gives its headline figure against its target, then the runs follow in
full, newest first. Older runs are in the history file beside this one, newest first. A section's title (its heading
without the date) names its benchmark.
"""
# The table's first line and its separator; a row per benchmark, the latest recorded first.
TABLE_HEAD = ("| benchmark | headline | target | meets target | run (UTC) | commit | machine |",
              "| --- | --- | --- | --- | --- | --- | --- |")
HISTORY_HEADER = """# Benchmark history

The earlier runs of the benchmarks in {latest}, moved here verbatim when a newer run of the same benchmark (the same
section title) was recorded there; newest first.
"""
SECTION_HEADING = re.compile(r"## (?P<title>.+) \((?P<date>\d{4}-\d\d-\d\d \d\d:\d\d) UTC\)")


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


@dataclass(frozen=True)
class Headline:
    """A benchmark's row in the table atop BENCHMARKS.md: the figure the benchmark is about (its ratio against its
    anchor, where it has one), the target that figure is held to ("none" where it has none) and whether the run met it
    (None: no target)."""

    figure: str
    target: str = "none"
    meets: bool | None = None


def ratio_headline(what: str, value: float, target: float, *, higher_is_better: bool = True,
                   digits: int = 2) -> Headline:
    """The usual headline: a ratio against the benchmark's anchor and the bound it must keep."""
    return Headline(f"{value:.{digits}f}x {what}", f"{'>=' if higher_is_better else '<='} {target}x",
                    verdict(value, target, higher_is_better) == "meets target")


def combined(*headlines: Headline) -> Headline:
    """One row for a benchmark held to several targets: the figures and the targets side by side, met when all are."""
    met = [h.meets for h in headlines if h.meets is not None]
    return Headline("; ".join(h.figure for h in headlines),
                    "; ".join(h.target for h in headlines if h.target != "none") or "none", all(met) if met else None)


def commit() -> str:
    """HEAD's short hash, with "+dirty" when tracked files differ from it (the results files aside: recording one
    run must not mark the next); "not recorded" outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)BENCHMARKS.md",
                      ":(exclude)BENCHMARKS_HISTORY.md")
    except (OSError, subprocess.CalledProcessError):
        return "not recorded"
    return head + ("+dirty" if changed else "")


def history_path(path: Path) -> Path:
    """Where the earlier runs of the results file `path` go: BENCHMARKS.md -> BENCHMARKS_HISTORY.md."""
    return path.with_name(f"{path.stem}_HISTORY{path.suffix}")


def split_runs(text: str) -> tuple[str, list[str]]:
    """A results file's header (with the table) and its sections in file order, each ending in one newline."""
    preamble, *runs = re.split(r"^(?=## )", text, flags=re.M)
    return preamble.rstrip("\n") + "\n", [run.rstrip("\n") + "\n" for run in runs]


def join_runs(preamble: str, runs: list[str]) -> str:
    return "\n".join([preamble, *runs])


def run_heading(section: str) -> tuple[str, str]:
    """A section's title and date ("not recorded" for a heading without one)."""
    first = section.split("\n", 1)[0]
    m = SECTION_HEADING.fullmatch(first)
    return (m["title"], m["date"]) if m else (first.removeprefix("## ").strip(), "not recorded")


def table_row(section: str, headline: Headline, commit_of_run: str | None = None) -> str:
    """The table's row for the run `section`: the headline, the run's date, commit and machine (CPUs, GPU, load)."""
    title, date = run_heading(section)
    recorded = re.search(r"^- commit: (\S+)", section, re.M)
    box = re.search(r"^- machine: .*?(\d+ CPUs), (no GPU|GPU [^,;]+)(?:, load avg ([\d.]+))?", section, re.M)
    where = (f"{box[1]}, {box[2]}" + (f", load {box[3]}" if box[3] else "")) if box else "not recorded"
    meets = {True: "yes", False: "no", None: "n/a"}[headline.meets]
    cells = [title, headline.figure, headline.target, meets, date,
             recorded[1] if recorded else commit_of_run or "not recorded", where]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def with_row(preamble: str, titles: set[str], row: str) -> str:
    """The header with `row` atop the table, in place of the rows of `titles`."""
    lines = preamble.rstrip("\n").split("\n")
    if TABLE_HEAD[0] not in lines:
        lines += ["", *TABLE_HEAD]
    start = lines.index(TABLE_HEAD[0]) + 2
    end = start
    while end < len(lines) and lines[end].startswith("| "):
        end += 1
    others = [line for line in lines[start:end] if line.split(" | ", 1)[0].removeprefix("| ") not in titles]
    rows = newest_first([row, *others], lambda line: line.split(" | ")[4])
    return "\n".join([*lines[:start], *rows, *lines[end:]]) + "\n"


def newest_first(items: list[str], date_of) -> list[str]:
    """Newest first by date ("YYYY-MM-DD HH:MM"; "not recorded" last), ties kept in their order: a run recorded
    after a newer one (from a file written earlier) goes below it."""
    return sorted(items, key=lambda item: "" if date_of(item) == "not recorded" else date_of(item), reverse=True)


def write_atomically(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def record_section(section: str, headline: Headline, path: Path | None = None, *,
                   commit_of_run: str | None = None, replaces: tuple[str, ...] = ()) -> Path:
    """Record the run `section` ("## TITLE (DATE UTC)" and its lines) in the results file `path`: on top of the runs,
    the earlier run of TITLE moved verbatim to the top of the history file, TITLE's row of the table rewritten.
    `commit_of_run` fills the row's commit where the section records none; `replaces`: earlier titles of the
    benchmark, whose runs and rows go the same way."""
    path = path or BENCHMARKS_MD
    title, date = run_heading(section)
    titles = {title, *replaces}
    preamble, runs = split_runs(path.read_text() if path.exists() else HEADER)
    older = [run for run in runs if run_heading(run)[0] in titles]
    newer = [d for d in (run_heading(run)[1] for run in older) if d != "not recorded" and d >= date]
    if newer:
        raise ValueError(f"{path.name} already holds a run of {title!r} as new as this one ({newer[0]} UTC)")
    if older:  # the history first: if the second write fails, the run is in both files, never in neither
        history = history_path(path)
        old_preamble, old_runs = split_runs(history.read_text() if history.exists()
                                            else HISTORY_HEADER.format(latest=path.name))
        write_atomically(history, join_runs(old_preamble, newest_first([*older, *old_runs],
                                                                       lambda run: run_heading(run)[1])))
    kept = [run for run in runs if run_heading(run)[0] not in titles]
    row = table_row(section, headline, commit_of_run)
    runs = newest_first([section.rstrip("\n") + "\n", *kept], lambda run: run_heading(run)[1])
    write_atomically(path, join_runs(with_row(preamble, titles, row), runs))
    return path


def record_result(title: str, rows: list[tuple[str, str]], notes: list[str], headline: Headline, *,
                  path: Path | None = None) -> Path:
    """Record this run (date, machine, commit, command, a table, notes) in BENCHMARKS.md (`record_section`)."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## {title} ({now})",
        "",
        f"- machine: {machine()}",
        f"- commit: {commit()}",
        f"- command: `{command_line()}`",
        "",
        "| measure | value |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        *[f"- {n}" for n in notes],
    ]
    return record_section("\n".join(lines) + "\n", headline, path)


def compare_rows(runs: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """Each side's median wall and CPU seconds over its rounds (`wall_s`, `cpu_s`), then the second side's over the
    first's ("cached / built")."""
    median = {side: {k: statistics.median(r[k] for r in rounds) for k in ("wall_s", "cpu_s")} for side, rounds in runs.items()}
    rows = []
    for side, m in median.items():
        rows += [(f"{side}: wall time", f"{m['wall_s']:.2f} s"), (f"{side}: CPU time", f"{m['cpu_s']:.2f} s")]
    (first, a), (second, b) = median.items()
    rows.append((f"{second} / {first}: wall time", f"{b['wall_s'] / a['wall_s']:.2f}x"))
    rows.append((f"{second} / {first}: CPU time", f"{b['cpu_s'] / a['cpu_s']:.2f}x"))
    return rows


def report_compared(args, title: str, command: str, runs: dict[str, list[dict]], what: str) -> None:
    """Print and record a run that compares two sides by their rounds (`wall_s`, `cpu_s`): the command row, then
    compare_rows, every round in a note, and the headline: the second side's CPU time over the first's, `what`."""
    rows = [("command", command), *compare_rows(runs)]
    print_rows(title, rows)
    first, second = runs
    report(args, title, rows, [rounds_note(runs)], Headline(f"{dict(rows)[f'{second} / {first}: CPU time']} {what}"))


def rounds_note(runs: dict[str, list[dict]]) -> str:
    """A run's note listing every round of each side (its `wall_s` / `cpu_s`), for a benchmark that gives medians."""
    return "every side's rounds (wall / CPU s): " + "; ".join(
        f"{side}: " + ", ".join(f"{r['wall_s']:.2f} / {r['cpu_s']:.2f}" for r in rounds) for side, rounds in runs.items())


def report(args, title: str, rows: list[tuple[str, str]], notes: list[str], headline: Headline) -> None:
    """Record the run in args.results unless --no-append; a --smoke run's first note says it is one."""
    if args.no_append:
        return
    if args.smoke:
        notes = ["smoke run: numbers only show the script works", *notes]
    record_result(title, rows, notes, headline, path=args.results)


def base_parser(doc: str):
    import argparse

    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="A few steps on the tiny preset: checks the script works (CI).")
    parser.add_argument("--results", type=Path, default=BENCHMARKS_MD,
                        help="Markdown file the run is recorded in (the benchmark's earlier run moves to <name>_HISTORY.md).")
    parser.add_argument("--config", type=Path, help="Training config (default: benchmarks/pi05_small_bench.json; tiny with --smoke).")
    parser.add_argument("--no-append", action="store_true", help="Print only; record nothing.")
    return parser


def print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    print(title)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
