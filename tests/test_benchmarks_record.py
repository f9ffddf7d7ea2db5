"""Recording a benchmark run (benchmarks/_common.py, benchmarks/record.py): the run lands on top of the runs with its
commit and machine, the previous run of the same benchmark moves verbatim to the history file, the benchmark's row of
the table is rewritten, and nothing else in either file changes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.quick

sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import _common
finally:
    sys.path.pop(0)

# A results file as the layout has it, written out by hand: two benchmarks, a table row each, one run each.
TABLE = """| benchmark | headline | target | meets target | run (UTC) | commit | machine |
| --- | --- | --- | --- | --- | --- | --- |
| Saving | 0.50x async / sync | <= 0.25x | no | 2026-12-02 10:00 | abc1234 | 2 CPUs, no GPU, load 1.0 |
| Loading | 3.00 s per load | none | n/a | 2026-12-01 09:00 | not recorded | 2 CPUs, no GPU, load 2.0 |
"""
SAVING = """## Saving (2026-12-02 10:00 UTC)

- machine: Linux, x86_64, 2 CPUs, no GPU, load avg 1.0/1.0/1.0; OMP_NUM_THREADS=unset; python 3.11.7, torch 2.13.0+cpu
- commit: abc1234
- command: `python benchmarks/bench_saving.py`

| measure | value |
| --- | --- |
| async / sync | 0.50x |

- an old note
"""
LOADING = """## Loading (2026-12-01 09:00 UTC)

- machine: Linux, x86_64, 2 CPUs, no GPU, load avg 2.0/2.0/2.0; python 3.11.7, torch 2.13.0+cpu
- command: `python benchmarks/bench_loading.py`

| measure | value |
| --- | --- |
| load | 3.00 s |
"""
HEAD = "# Benchmarks\n\nThe header a person wrote.\n\n"
HISTORY_HEAD = "# Benchmark history\n\nThe header of the history.\n"
OLDEST_SAVING = SAVING.replace("2026-12-02 10:00", "2026-11-30 08:00").replace("0.50x", "0.90x")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def sections(text: str) -> list[str]:
    """A results file's runs, each without the blank line that parts it from the next."""
    return [s.rstrip("\n") + "\n" for s in re.split(r"^(?=## )", text, flags=re.M)[1:]]


def with_new_row(row: str, replaced: str) -> str:
    """TABLE with `row` on top in place of the row of the benchmark `replaced`."""
    head, rows = TABLE.splitlines()[:2], TABLE.splitlines()[2:]
    return "\n".join([*head, row, *(line for line in rows if not line.startswith(f"| {replaced} |"))]) + "\n"


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(HEAD + TABLE + "\n" + SAVING + "\n" + LOADING)
    (tmp_path / "BENCHMARKS_HISTORY.md").write_text(HISTORY_HEAD + "\n" + OLDEST_SAVING)
    return path


def test_a_new_run_lands_on_top_the_old_one_moves_to_the_history_and_only_its_table_row_changes(results):
    _common.record_result("Saving", [("async / sync", "0.12x")], ["a new note"],
                          _common.ratio_headline("async / sync", 0.12, 0.25, higher_is_better=False), path=results)
    after = results.read_text()
    new_run, loading = sections(after)
    assert loading == LOADING  # the other benchmark's run: untouched
    date = re.fullmatch(r"## Saving \((\d{4}-\d\d-\d\d \d\d:\d\d) UTC\)\n", new_run.split("\n", 1)[0] + "\n")[1]
    assert "| async / sync | 0.12x |" in new_run and "- a new note" in new_run
    assert re.search(r"^- machine: .*\b\d+ CPUs, (no GPU|GPU .+), load avg [\d.]+/", new_run, re.M)
    head = git("rev-parse", "--short", "HEAD")
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":!BENCHMARKS.md", ":!BENCHMARKS_HISTORY.md"],
                             cwd=REPO).returncode == 1
    commit = head + ("+dirty" if changed else "")
    assert f"\n- commit: {commit}\n" in new_run
    cpus, gpu, load = re.search(r"^- machine: .*?(\d+ CPUs), (no GPU|GPU [^,;]+), load avg ([\d.]+)", new_run, re.M).groups()
    row = f"| Saving | 0.12x async / sync | <= 0.25x | yes | {date} | {commit} | {cpus}, {gpu}, load {load} |"
    assert after == HEAD + with_new_row(row, "Saving") + "\n" + new_run + "\n" + LOADING  # the row and the run on top
    history = (results.parent / "BENCHMARKS_HISTORY.md").read_text()
    assert history == HISTORY_HEAD + "\n" + SAVING + "\n" + OLDEST_SAVING  # moved verbatim, newest first


def test_the_first_run_of_a_benchmark_adds_its_row_and_moves_nothing(results):
    history = (results.parent / "BENCHMARKS_HISTORY.md").read_text()
    _common.record_result("Serving", [("req/s", "9.0")], [], _common.Headline("9.0 req/s"), path=results)
    text = results.read_text()
    assert re.match(r"## Serving \(\d{4}-", sections(text)[0]) and sections(text)[1:] == [SAVING, LOADING]
    rows = [line for line in text.split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    assert rows[2].startswith("| Serving | 9.0 req/s | none | n/a | ") and rows[3:] == TABLE.splitlines()[2:]
    assert (results.parent / "BENCHMARKS_HISTORY.md").read_text() == history


def test_a_run_recorded_after_a_newer_one_goes_below_it_in_the_runs_and_the_table(results):
    """A section written earlier and recorded by hand later (record.py) keeps the runs newest first."""
    serving = "## Serving (2026-12-01 12:00 UTC)\n\n- machine: Linux, x86_64, 2 CPUs, no GPU, load avg 3.0/3.0/3.0\n"
    _common.record_section(serving, _common.Headline("9.0 req/s"), results)
    text = results.read_text()
    assert sections(text) == [SAVING, serving, LOADING]
    rows = [line for line in text.split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[2:]] == ["| Saving", "| Serving", "| Loading"]


def test_a_fresh_results_file_gets_the_header_the_table_and_no_history(tmp_path):
    path = tmp_path / "fresh.md"
    _common.record_result("Serving", [("req/s", "9.0")], ["a note"], _common.Headline("9.0 req/s"), path=path)
    text = path.read_text()
    assert text.startswith(_common.HEADER) and "\n".join(_common.TABLE_HEAD) in text
    assert len(sections(text)) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["fresh.md"]


def test_headlines_give_the_ratio_its_bound_and_whether_it_was_met():
    assert _common.ratio_headline("opentau / hand-written", 0.9812, 0.97, digits=3) == _common.Headline(
        "0.981x opentau / hand-written", ">= 0.97x", True)
    assert _common.ratio_headline("async / sync", 0.26, 0.25, higher_is_better=False).meets is False
    both = _common.combined(_common.Headline("1.75x save", ">= 0.8x", True), _common.Headline("1.30x resume", "<= 1.2x", False),
                            _common.Headline("12 MiB"))
    assert both == _common.Headline("1.75x save; 1.30x resume; 12 MiB", ">= 0.8x; <= 1.2x", False)
    assert _common.combined(_common.Headline("9.0 req/s")).meets is None


def record_by_hand(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "record.py"), *args], capture_output=True, text=True,
                          timeout=120)


LOADING_AGAIN = LOADING.replace("2026-12-01 09:00", "2026-12-06 08:00").replace("3.00 s", "2.00 s")
LOADING_RENAMED = LOADING.replace("## Loading (2026-12-01 09:00", "## Loading, cold and warm (2026-12-06 08:00")


@pytest.mark.parametrize("elsewhere, args, run, row", [
    # A file a script wrote with --results before this layout (a header, no table), two benchmarks in it.
    ("# Benchmarks\n\nResults appended by the scripts.\n\n" + LOADING_AGAIN + "\n" + SAVING,
     ["--title", "Loading", "--headline", "2.00 s per load", "--commit", "def5678"], LOADING_AGAIN,
     "| Loading | 2.00 s per load | none | n/a | 2026-12-06 08:00 | def5678 | 2 CPUs, no GPU, load 2.0 |"),
    # The benchmark renamed: its run under the old title goes to the history, its old row goes.
    (LOADING_RENAMED, ["--headline", "3.00 s per load", "--replaces", "Loading"], LOADING_RENAMED,
     "| Loading, cold and warm | 3.00 s per load | none | n/a | 2026-12-06 08:00 | not recorded | 2 CPUs, no GPU, load 2.0 |"),
], ids=["picked-by-title", "renamed"])
def test_record_py_adds_a_section_written_elsewhere_as_a_script_records_its_own(results, tmp_path, elsewhere, args, run,
                                                                                row):
    (tmp_path / "elsewhere.md").write_text(elsewhere)
    done = record_by_hand(str(tmp_path / "elsewhere.md"), *args, "--results", str(results))
    assert done.returncode == 0, done.stderr
    assert results.read_text() == HEAD + with_new_row(row, "Loading") + "\n" + run + "\n" + SAVING
    assert (tmp_path / "BENCHMARKS_HISTORY.md").read_text() == HISTORY_HEAD + "\n" + LOADING + "\n" + OLDEST_SAVING


@pytest.mark.parametrize("args, says", [
    (["--headline", "x"], "holds 2 benchmarks (Loading; Saving): pick one with --title"),
    (["--title", "Serving", "--headline", "x"], "holds no section titled 'Serving'"),
    (["--title", "Saving", "--headline", "x"], "already holds a run of 'Saving' as new as this one (2026-12-02 10:00 UTC)"),
])
def test_record_py_mistakes_exit_2_in_one_sentence_and_write_nothing(results, tmp_path, args, says):
    elsewhere = tmp_path / "other.md"
    elsewhere.write_text(LOADING + "\n" + SAVING)  # Saving's run is the one results already holds
    files = {p: p.read_text() for p in tmp_path.iterdir()}
    done = record_by_hand(str(elsewhere), *args, "--results", str(results))
    assert done.returncode == 2 and says in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert {p: p.read_text() for p in tmp_path.iterdir()} == files


def test_benchmarks_md_holds_one_run_per_benchmark_each_with_its_row_and_the_history_keeps_the_rest():
    text = (REPO / "BENCHMARKS.md").read_text()
    runs = [re.match(r"## (.+) \((\d{4}-\d\d-\d\d \d\d:\d\d) UTC\)\n", s).groups() for s in sections(text)]
    titles = [title for title, _ in runs]
    assert len(titles) == len(set(titles))
    rows = [line.split(" | ") for line in text.split("\n## ", 1)[0].splitlines() if line.startswith("| ")][2:]
    assert [(cells[0].removeprefix("| "), cells[4]) for cells in rows] == runs  # a row per run, in the runs' order
    assert [date for _, date in runs] == sorted((date for _, date in runs), reverse=True)  # newest first
    history = (REPO / "BENCHMARKS_HISTORY.md").read_text()
    older = [re.match(r"## .+ \((\d{4}-\d\d-\d\d \d\d:\d\d) UTC\)\n", s)[1] for s in sections(history)]
    assert older == sorted(older, reverse=True) and not set(sections(history)) & set(sections(text))
