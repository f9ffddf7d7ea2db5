"""Every measured figure in README.md is the one of the latest run of its benchmark recorded in BENCHMARKS.md (the
scripts in benchmarks/ append a dated section per run, never rewriting the earlier ones), and the README quotes no
ratio or per-unit cost that this table does not tie to a benchmark."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text()

ASYNC = "Asynchronous checkpoints: training time lost per save, sync vs async_save"
CONSOLIDATE_ZERO3 = "Streaming consolidation vs zero_to_fp32 (two-step and direct), ZeRO-3"
LORA = "LoRA rank 16 vs full fine-tuning on 2 CPU processes (opentau profile)"
PLAN = "Memory plan of the example pi05 config on 8 GPUs"
STARTUP = "Starting from pretrained weights: build + load vs no init"


def _mb_fp32_to_million_parameters(mb: float) -> float:
    return mb * 1e6 / 4 / 1e6


# README figure -> where it comes from: (a pattern of README.md whose group is the figure, the benchmark's section
# title, the row of its table, a pattern of that row's value whose group is the measured number[, a conversion]).
FIGURES = [
    (r"(-?[\d.]+) s per asynchronous save", ASYNC, "training time lost per save, async", r"^(-?[\d.]+) s"),
    (r"against ([\d.]+) s per synchronous one", ASYNC, "training time lost per save, sync", r"^([\d.]+) s"),
    (r"and (-?[\d.]+) s against [\d.]+ s with a spinning", ASYNC, "loaded: training time lost per save, async", r"^(-?[\d.]+) s"),
    (r"and -?[\d.]+ s against ([\d.]+) s with a spinning", ASYNC, "loaded: training time lost per save, sync", r"^([\d.]+) s"),
    (r"own, ([\d.]+) CPU-seconds per GB written", ASYNC, "save CPU per GB, async writer process", r"^([\d.]+) CPU-s/GB"),
    (r"on a ([\d.]+)M-parameter ZeRO-3 checkpoint", CONSOLIDATE_ZERO3, "model", r"([\d.]+) MB fp32", _mb_fp32_to_million_parameters),
    (r"ZeRO-3 checkpoint it used ([\d.]+)x the memory", CONSOLIDATE_ZERO3, "RSS ratio vs upstream (target <= 0.3)", r"^([\d.]+)x"),
    (r"the memory and ([\d.]+)x the time of the upstream", CONSOLIDATE_ZERO3, "wall ratio vs upstream (target <= 0.7)", r"^([\d.]+)x"),
    (r"LoRA needs ([\d.]+)x \(DDP\)", LORA, "DDP LoRA / full", r"peak memory ([\d.]+)x"),
    (r"and ([\d.]+)x \(ZeRO-2\) of full fine-tuning's peak memory", LORA, "ZeRO-2 LoRA / full", r"peak memory ([\d.]+)x"),
    (r"ran ([\d.]+)x / [\d.]+x its samples/s", LORA, "DDP LoRA / full", r"samples/s ([\d.]+)x"),
    (r"ran [\d.]+x / ([\d.]+)x its samples/s", LORA, "ZeRO-2 LoRA / full", r"samples/s ([\d.]+)x"),
    (r"needs about ([\d.]+) GB per GPU", PLAN, "DDP, 8 x 1", r"^([\d.]+) GB"),
    (r"\| 8 x 1 accumulation \| ([\d.]+) GB", PLAN, "DDP, 8 x 1", r"^([\d.]+) GB"),
    (r"\| 4 x 2 accumulation \| ([\d.]+) GB", PLAN, "DDP, 4 x 2 (the example)", r"^([\d.]+) GB"),
    (r"4 x 2 accumulation \| [\d.]+ GB \| fits, ([\d.]+) GB margin", PLAN, "DDP, 4 x 2 (the example)", r"margin ([\d.]+) GB"),
    (r"ZeRO-2, bf16 \| 4 x 2 \| ([\d.]+) GB", PLAN, "ZeRO-2, 4 x 2", r"^([\d.]+) GB"),
    (r"ZeRO-2, bf16 \| 4 x 2 \| [\d.]+ GB \| fits, ([\d.]+) GB margin", PLAN, "ZeRO-2, 4 x 2", r"margin ([\d.]+) GB"),
    (r"ZeRO-3, bf16 \| 4 x 2 \| ([\d.]+) GB", PLAN, "ZeRO-3, 4 x 2", r"^([\d.]+) GB"),
    (r"ZeRO-3, bf16 \| 4 x 2 \| [\d.]+ GB \| fits, ([\d.]+) GB margin", PLAN, "ZeRO-3, 4 x 2", r"margin ([\d.]+) GB"),
    (r"fp32 weights \(([\d.]+) GB\)", PLAN, "DDP example: weights", r"^([\d.]+) GB"),
    (r"gradients \(([\d.]+) GB, kept in DDP", PLAN, "DDP example: gradients", r"^([\d.]+) GB"),
    (r"fp32 copy of the trained weights\s+\(([\d.]+) GB\)", PLAN, "DDP example: EMA of the weights (fp32)", r"^([\d.]+) GB"),
    (r"AdamW's moments \(([\d.]+) GB\)", PLAN, "DDP example: AdamW state", r"^([\d.]+) GB"),
    (r"pi05_small took ([\d.]+) copies of its weights", STARTUP, "no init, no draws: peak RSS above imports", r"\(([\d.]+) copies"),
    (r"against ([\d.]+) when built first and then loaded", STARTUP, "build + load: peak RSS above imports", r"\(([\d.]+) copies"),
    (r"then loaded \(([\d.]+)x, and", STARTUP, "no init, no draws / build + load: peak RSS", r"^([\d.]+)x"),
    (r"and ([\d.]+)x the time, `benchmarks/bench_startup.py`", STARTUP, "no init, no draws / build + load: wall time", r"^([\d.]+)x"),
]

# What a measured figure looks like in prose: a ratio ("0.49x"), a cost per unit ("0.5 s per GB", "0.2 CPU-seconds per
# GB") or a pair of times ("0.18 s against 1.98 s").
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?!\w)|\d+(?:\.\d+)? (?:s|CPU-seconds) per \w+|\d+(?:\.\d+)? s against")


def latest_table(title: str) -> dict[str, str]:
    """The measure -> value table of the newest BENCHMARKS.md section called `title` (sections are appended in time
    order; each heading is the title followed by its date)."""
    sections = re.split(r"^## ", BENCHMARKS, flags=re.M)
    matching = [s for s in sections if re.match(re.escape(title) + r" \(\d{4}-\d\d-\d\d \d\d:\d\d UTC\)\n", s)]
    assert matching, f"BENCHMARKS.md has no section {title!r}"
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", matching[-1], flags=re.M)
    return {measure: value for measure, value in rows if measure not in ("measure", "---")}


def _decimals(figure: str) -> int:
    return len(figure.split(".")[1]) if "." in figure else 0


@pytest.mark.parametrize("figure", FIGURES, ids=[f[0] for f in FIGURES])
def test_readme_figure_is_the_latest_benchmark_run(figure):
    readme_pattern, title, row, value_pattern, *convert = figure
    found = re.findall(readme_pattern, README)
    assert len(found) == 1, f"README.md: {readme_pattern!r} found {len(found)} times"
    table = latest_table(title)
    assert row in table, f"{title}: no row {row!r} in its latest table"
    measured = re.search(value_pattern, table[row])
    assert measured, f"{title} / {row}: {table[row]!r} does not match {value_pattern!r}"
    number = float(measured.group(1))
    for fn in convert:
        number = fn(number)
    assert float(found[0]) == round(number, _decimals(found[0])), (
        f"README.md says {found[0]} where the latest {title!r} run measured {number} ({row})")


def test_every_measured_figure_in_the_readme_is_tied_to_a_benchmark():
    covered = [m.span(1) for pattern, *_ in FIGURES for m in re.finditer(pattern, README)]
    untied = [m.group(0) for m in MEASURED.finditer(README)
              if not any(start <= m.start() < end for start, end in covered)]
    assert not untied, f"README.md quotes measurements no benchmark in FIGURES backs: {untied}"


def test_latest_table_reads_the_newest_section_of_a_benchmark():
    # Two consolidation benchmarks ran before the current title; the README's figures come from the current one.
    assert latest_table(CONSOLIDATE_ZERO3)["wall ratio vs upstream (target <= 0.7)"].startswith("0.49x")
    assert latest_table(ASYNC)["async / sync"].startswith("0.10x")  # the ninth of nine runs
