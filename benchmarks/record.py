"""Record a benchmark run written elsewhere in BENCHMARKS.md, as a script records its own run.

The section (`## TITLE (YYYY-MM-DD HH:MM UTC)` and its lines, e.g. from a file a script wrote with `--results FILE`)
goes on top of the runs, the benchmark's previous run moves to BENCHMARKS_HISTORY.md, and its row of the table is
written from the headline given here:

    python benchmarks/record.py /tmp/results.md --title "Simulator evaluation speed" \\
        --headline "1.93x env steps/s, opentau / LeRobot" --target ">= 1.5x" --meets yes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BENCHMARKS_MD, Headline, record_section, run_heading, split_runs  # noqa: E402


def fail(message: str) -> None:
    sys.stderr.write(message + "\n")
    raise SystemExit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("file", type=Path, help="Markdown holding the run's section.")
    parser.add_argument("--title", help="The benchmark to take from FILE (default: its only one); the latest run of it.")
    parser.add_argument("--headline", required=True, help='The figure for the table, e.g. "0.12x async / sync".')
    parser.add_argument("--target", default="none", help='What the figure is held to, e.g. "<= 0.25x" (default: none).')
    parser.add_argument("--meets", choices=("yes", "no", "n/a"), default="n/a", help="Whether the run met the target.")
    parser.add_argument("--commit", help="The commit the run measured, for the table when the section names none.")
    parser.add_argument("--replaces", action="append", default=[], metavar="TITLE",
                        help="An earlier title of this benchmark: its run moves to the history and its row goes too.")
    parser.add_argument("--results", type=Path, default=BENCHMARKS_MD, help="The results file (default: BENCHMARKS.md).")
    args = parser.parse_args()
    try:
        _, runs = split_runs(args.file.read_text())
    except OSError as e:
        fail(f"Cannot read {args.file}: {e.strerror}.")
    if args.title:
        runs = [run for run in runs if run_heading(run)[0] == args.title]
    titles = sorted({run_heading(run)[0] for run in runs})
    if len(titles) != 1:
        fail(f"{args.file} holds no section titled {args.title!r}." if args.title else
             f"{args.file} holds {len(titles)} benchmarks ({'; '.join(titles) or 'no ## section'}): pick one with --title.")
    section = max(runs, key=lambda run: run_heading(run)[1])
    title, date = run_heading(section)
    if date == "not recorded":
        fail(f"The heading of {title!r} in {args.file} has no date: it must end with (YYYY-MM-DD HH:MM UTC).")
    meets = {"yes": True, "no": False, "n/a": None}[args.meets]
    try:
        record_section(section, Headline(args.headline, args.target, meets), args.results, commit_of_run=args.commit,
                       replaces=tuple(args.replaces))
    except ValueError as e:
        fail(f"{e}: nothing recorded.")
    print(f"recorded {title!r} ({date} UTC) in {args.results}")


if __name__ == "__main__":
    main()
