"""Every measured figure in README.md and the docs/ pages is the one of the latest run of its benchmark, the section
in BENCHMARKS.md (which holds one run per benchmark; the earlier runs are in BENCHMARKS_HISTORY.md, never read here),
and those pages quote no ratio or per-unit cost that this table does not tie to a benchmark."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.full

REPO = Path(__file__).resolve().parents[1]
# The pages a user reads: the README and the reference pages in docs/, less two that are not the user's reference:
# ARCHITECTURE.md (design notes: options measured and not taken, as ranges) and PUBLISHED_MEMORY.md (others'
# published figures, checked by benchmarks/bench_published_memory.py).
NOT_USER_PAGES = ("ARCHITECTURE.md", "PUBLISHED_MEMORY.md")
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in NOT_USER_PAGES)]
PAGES_TEXT = "\n\n".join(p.read_text() for p in PAGES)
# The same with every run of white space one space: a figure's sentence may be wrapped anywhere on any page.
PROSE = " ".join(PAGES_TEXT.split())
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text()
HISTORY = (REPO / "BENCHMARKS_HISTORY.md").read_text()

ASYNC = "Asynchronous checkpoints: training time lost per save, sync vs async_save"
CONSOLIDATE_ZERO3 = "Streaming consolidation vs zero_to_fp32 (direct and two-step), ZeRO-3 at two sizes"
DIRECT = "wall ratio vs direct, 64 layers / 128 layers (target <= 1.0)"
DIRECT_RSS = "RSS ratio vs direct, 64 layers / 128 layers (target <= 0.3)"
UPSTREAM = "wall ratio vs upstream, 64 layers / 128 layers (target <= 0.7)"
LORA = "LoRA rank 16 vs full fine-tuning on 2 CPU processes (opentau profile)"
PLAN = "Memory plan: real CPU peaks and the example pi05 config on 8 GPUs"
STARTUP = "Starting from pretrained weights: build + load vs no init"
RESTART = "Restart: a rank's death to the first step after it (pi05_small_bench, DDP x2, CPU)"
FSDP = "FSDP2 vs ZeRO-3 vs DDP on 2 CPU processes"
DATA_REMOTE = "Datasets in object storage: an epoch from a local S3 server vs from local disk"
REMOTE = "Remote checkpoints: upload, training time lost per save, resume from the store"
REMOTE_TRAINING = "Remote checkpoints, training only"
REMOTE_INTERFERENCE = "Remote checkpoints, interference only"
SPLIT = "rank on core 0, uploader and store on core 1 (a GPU node's host)"
OMP = "OpenMP's wait policy: two single-process trainings at once, default vs PASSIVE"


# A page's figure -> where it comes from: (a pattern of the pages' prose whose group is the figure, the benchmark's
# section title, the row of its table, a pattern of that row's value whose group is the measured number[, a conversion]).
FIGURES = [
    (r"tiny trainings took ([\d.]+) CPU-s with OpenMP's default", OMP, "default: CPU time", r"^([\d.]+) s"),
    (r"default wait policy and ([\d.]+) with PASSIVE", OMP, "passive: CPU time", r"^([\d.]+) s"),
    (r"with PASSIVE \(([\d.]+)x of the CPU\s+time", OMP, "passive / default: CPU time", r"^([\d.]+)x"),
    (r"pi05_small, ([\d.]+) samples/s against [\d.]+ for FSDP2", FSDP, "DDP", r"^([\d.]+) samples/s"),
    (r"samples/s against ([\d.]+) for FSDP2", FSDP, "FSDP2", r"^([\d.]+) samples/s"),
    (r"for FSDP2 and ([\d.]+) for ZeRO-3, `bench_fsdp.py`", FSDP, "ZeRO-3", r"^([\d.]+) samples/s"),
    (r"a lower peak per process \(([\d.]+) MiB", FSDP, "FSDP2", r"peak RSS/rank (\d+) MiB"),
    (r"against ZeRO-3's ([\d.]+) MiB in that run", FSDP, "ZeRO-3", r"peak RSS/rank (\d+) MiB"),
    (r"faster saves \(([\d.]+) s, ZeRO-3", FSDP, "FSDP2", r"saved in ([\d.]+) s"),
    (r"faster saves \([\d.]+ s, ZeRO-3 ([\d.]+) s, DDP", FSDP, "ZeRO-3", r"saved in ([\d.]+) s"),
    (r"ZeRO-3 [\d.]+ s, DDP ([\d.]+) s:\s+every rank writes", FSDP, "DDP", r"saved in ([\d.]+) s"),
    (r"load slower \(([\d.]+) s, ZeRO-3", FSDP, "FSDP2", r"loaded in ([\d.]+) s"),
    (r"load slower \([\d.]+ s, ZeRO-3 ([\d.]+) s, DDP", FSDP, "ZeRO-3", r"loaded in ([\d.]+) s"),
    (r"ZeRO-3 [\d.]+ s, DDP ([\d.]+) s\)\. Prefer ZeRO-3", FSDP, "DDP", r"loaded in ([\d.]+) s"),
    (r"a restart took ([\d.]+) s from the rank's death", RESTART, "total", r"^([\d.]+) s"),
    (r"first step after it: ([\d.]+) s to\s+detect", RESTART, "detection", r"^([\d.]+) s"),
    (r"detect, ([\d.]+) s to start and restore", RESTART, "start-up and restore", r"^([\d.]+) s"),
    (r"(-?[\d.]+) s per asynchronous save", ASYNC, "training time lost per save, async", r"^(-?[\d.]+) s"),
    (r"against ([\d.]+) s per synchronous one", ASYNC, "training time lost per save, sync", r"^([\d.]+) s"),
    (r"(-?[\d.]+) s against [\d.]+ s with a spinning process\s+on every core at nice", ASYNC,
     "niced: training time lost per save, async", r"^(-?[\d.]+) s"),
    (r"-?[\d.]+ s against ([\d.]+) s with a spinning process\s+on every core at nice", ASYNC,
     "niced: training time lost per save, sync", r"^([\d.]+) s"),
    (r"and (-?[\d.]+) s against [\d.]+ s with one at training's own priority", ASYNC,
     "loaded: training time lost per save, async", r"^(-?[\d.]+) s"),
    (r"and -?[\d.]+ s against ([\d.]+) s with one at training's own priority", ASYNC,
     "loaded: training time lost per save, sync", r"^([\d.]+) s"),
    (r"own, ([\d.]+) CPU-seconds per GB", ASYNC, "save CPU per GB, async writer process", r"^([\d.]+) CPU-s/GB"),
    (r"([\d.]+)M and [\d.]+M fp32 values", CONSOLIDATE_ZERO3, "model, 64 layers", r"(\d+)M fp32 values"),
    (r"[\d.]+M and ([\d.]+)M fp32 values", CONSOLIDATE_ZERO3, "model, 128 layers", r"(\d+)M fp32 values"),
    (r"it took ([\d.]+)x and [\d.]+x the time of DeepSpeed's", CONSOLIDATE_ZERO3, DIRECT, r"^([\d.]+)x"),
    (r"it took [\d.]+x and ([\d.]+)x the time of DeepSpeed's", CONSOLIDATE_ZERO3, DIRECT, r"/ ([\d.]+)x"),
    (r"at ([\d.]+)x and [\d.]+x its peak memory", CONSOLIDATE_ZERO3, DIRECT_RSS, r"^([\d.]+)x"),
    (r"at [\d.]+x and ([\d.]+)x its peak memory", CONSOLIDATE_ZERO3, DIRECT_RSS, r"/ ([\d.]+)x"),
    (r"\(([\d.]+)x and [\d.]+x the\s+time of the upstream", CONSOLIDATE_ZERO3, UPSTREAM, r"^([\d.]+)x"),
    (r"\([\d.]+x and ([\d.]+)x the\s+time of the upstream", CONSOLIDATE_ZERO3, UPSTREAM, r"/ ([\d.]+)x"),
    (r"LoRA needs ([\d.]+)x \(DDP\)", LORA, "DDP LoRA / full", r"peak memory ([\d.]+)x"),
    (r"and ([\d.]+)x \(ZeRO-2\) of full fine-tuning's peak memory", LORA, "ZeRO-2 LoRA / full", r"peak memory ([\d.]+)x"),
    (r"ran ([\d.]+)x / [\d.]+x its samples/s", LORA, "DDP LoRA / full", r"samples/s ([\d.]+)x"),
    (r"ran [\d.]+x / ([\d.]+)x its samples/s", LORA, "ZeRO-2 LoRA / full", r"samples/s ([\d.]+)x"),
    (r"needs about ([\d.]+) GiB per GPU", PLAN, "DDP, 8 x 1", r"^([\d.]+) GiB"),
    (r"\| 8 x 1 accumulation \| ([\d.]+) GiB", PLAN, "DDP, 8 x 1", r"^([\d.]+) GiB"),
    (r"\| 4 x 2 accumulation \| ([\d.]+) GiB", PLAN, "DDP, 4 x 2", r"^([\d.]+) GiB"),
    (r"4 x 2 accumulation \| [\d.]+ GiB \| fits, ([\d.]+) MiB margin", PLAN, "DDP, 4 x 2", r"margin ([\d.]+) MiB"),
    (r"\| 2 x 4 accumulation \| ([\d.]+) GiB", PLAN, "DDP, 2 x 4 (the example)", r"^([\d.]+) GiB"),
    (r"2 x 4 accumulation \| [\d.]+ GiB \| fits, ([\d.]+) GiB margin", PLAN, "DDP, 2 x 4 (the example)", r"margin ([\d.]+) GiB"),
    (r"ZeRO-2, bf16 \| 2 x 4 \| ([\d.]+) GiB", PLAN, "ZeRO-2, 2 x 4", r"^([\d.]+) GiB"),
    (r"ZeRO-2, bf16 \| 2 x 4 \| [\d.]+ GiB \| fits, ([\d.]+) GiB margin", PLAN, "ZeRO-2, 2 x 4", r"margin ([\d.]+) GiB"),
    (r"ZeRO-3, bf16 \| 2 x 4 \| ([\d.]+) GiB", PLAN, "ZeRO-3, 2 x 4", r"^([\d.]+) GiB"),
    (r"ZeRO-3, bf16 \| 2 x 4 \| [\d.]+ GiB \| fits, ([\d.]+) GiB margin", PLAN, "ZeRO-3, 2 x 4", r"margin ([\d.]+) GiB"),
    (r"fp32 weights \(([\d.]+) GiB\)", PLAN, "DDP example: weights", r"^([\d.]+) GiB"),
    (r"gradients \(([\d.]+) GiB, in DDP", PLAN, "DDP example: gradients (DDP buckets)", r"^([\d.]+) GiB"),
    (r"fp32 copy of the trained weights\s+\(([\d.]+) GiB\)", PLAN, "DDP example: EMA of the weights (fp32)", r"^([\d.]+) GiB"),
    (r"AdamW's moments \(([\d.]+) GiB\)", PLAN, "DDP example: AdamW state", r"^([\d.]+) GiB"),
    (r"activations \(([\d.]+) GiB at 2 per device\)", PLAN, "DDP example, forward: activations", r"^([\d.]+) GiB"),
    (r"AdamW's temporaries \(([\d.]+) GiB\)", PLAN, "DDP example, optimizer step: AdamW temporaries", r"^([\d.]+) GiB"),
    (r"pi05_small took ([\d.]+) copies of its weights", STARTUP, "no init, no draws: peak RSS above imports", r"\(([\d.]+) copies"),
    (r"against ([\d.]+) when built first and then loaded", STARTUP, "build + load: peak RSS above imports", r"\(([\d.]+) copies"),
    (r"then loaded \(([\d.]+)x, and", STARTUP, "no init, no draws / build + load: peak RSS", r"^([\d.]+)x"),
    (r"and ([\d.]+)x the time, `benchmarks/bench_startup.py`", STARTUP, "no init, no draws / build + load: wall time", r"^([\d.]+)x"),
    (r"checkpoint uploads at ([\d.]+)x the throughput", REMOTE, "upload, checkpoint (0.95 GB): opentau / boto3", r"^([\d.]+)x"),
    (r"a 2.1 GB one at\s+([\d.]+)x", REMOTE, "upload, large checkpoint (2.10 GB): opentau / boto3", r"^([\d.]+)x"),
    (r"on an empty disk takes ([\d.]+)x the", REMOTE, "resume on an empty disk: opentau resume URL / boto3 download + resume", r"^([\d.]+)x"),
    (r"the run takes ([\d.]+)x as long", REMOTE_TRAINING, f"training wall, checkpoint.remote on / off, {SPLIT}", r"^([\d.]+)x"),
    (r"as long, ([\d.]+) s per save \(the target", REMOTE_TRAINING, f"training time lost per save, {SPLIT}", r"^([\d.]+) s"),
    (r"one-thread matmul ([\d.]+)x\.", REMOTE_INTERFERENCE, "the same while core 1 uploads the checkpoint (this process and "
     "the store on core 1)", r"^([\d.]+)x"),
    (r"pays for them: ([\d.]+) s per save on one thread", REMOTE_TRAINING, "training time lost per save, training on one thread", r"^([\d.]+) s"),
    (r"([\d.]+) s per save when the training uses both\s+cores", REMOTE_TRAINING, "training time lost per save, training on every core", r"^([\d.]+) s"),
    (r"g1 dataset ran at\s+([\d.]+)x local disk", DATA_REMOTE, "g1 (AV1 480x640): store, cold cache", r"\(([\d.]+)x local"),
    (r"empty cache and ([\d.]+)x with a warm\s+one", DATA_REMOTE, "g1 (AV1 480x640): store, warm cache", r"\(([\d.]+)x local"),
    (r"every 20 samples\) at ([\d.]+)x cold", DATA_REMOTE, "synthetic H.264 64x64: store, cold cache", r"\(([\d.]+)x local"),
    (r"x cold and ([\d.]+)x warm", DATA_REMOTE, "synthetic H.264 64x64: store, warm cache", r"\(([\d.]+)x local"),
]

# What a measured figure looks like in prose: a ratio ("0.49x"), a cost per unit ("0.5 s per GB", "0.2 CPU-seconds per
# GB") or a pair of times ("0.18 s against 1.98 s").
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?!\w)|\d+(?:\.\d+)? (?:s|CPU-seconds) per \w+|\d+(?:\.\d+)? s against")


def sections(text: str, title: str) -> list[str]:
    """The sections of a results file called `title` (each heading is the title followed by its date)."""
    return [s for s in re.split(r"^## ", text, flags=re.M)
            if re.match(re.escape(title) + r" \(\d{4}-\d\d-\d\d \d\d:\d\d UTC\)\n", s)]


def latest_table(title: str) -> dict[str, str]:
    """The measure -> value table of the latest run of the benchmark `title`: its one section in BENCHMARKS.md."""
    matching = sections(BENCHMARKS, title)
    assert len(matching) == 1, f"BENCHMARKS.md has {len(matching)} sections {title!r}; it holds one run per benchmark"
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", matching[0], flags=re.M)
    return {measure: value for measure, value in rows if measure not in ("measure", "---")}


def _decimals(figure: str) -> int:
    return len(figure.split(".")[1]) if "." in figure else 0


@pytest.mark.parametrize("figure", FIGURES, ids=[f[0] for f in FIGURES])
def test_readme_figure_is_the_latest_benchmark_run(figure):
    page_pattern, title, row, value_pattern, *convert = figure
    found = re.findall(page_pattern, PROSE)
    assert len(found) == 1, f"README.md and docs/: {page_pattern!r} found {len(found)} times"
    table = latest_table(title)
    assert row in table, f"{title}: no row {row!r} in its latest table"
    measured = re.search(value_pattern, table[row])
    assert measured, f"{title} / {row}: {table[row]!r} does not match {value_pattern!r}"
    number = float(measured.group(1))
    for fn in convert:
        number = fn(number)
    assert float(found[0]) == round(number, _decimals(found[0])), (
        f"README.md / docs/ say {found[0]} where the latest {title!r} run measured {number} ({row})")


def test_every_measured_figure_in_the_readme_and_docs_is_tied_to_a_benchmark():
    covered = [m.span(1) for pattern, *_ in FIGURES for m in re.finditer(pattern, PROSE)]
    untied = [m.group(0) for m in MEASURED.finditer(PROSE)
              if not any(start <= m.start() < end for start, end in covered)]
    assert not untied, f"README.md / docs/ quote measurements no benchmark in FIGURES backs: {untied}"


def test_latest_table_reads_the_run_in_benchmarks_md_never_the_history():
    # The README's figures come from the current consolidation title; three older titles' runs are in the history.
    assert latest_table(CONSOLIDATE_ZERO3)[UPSTREAM].startswith("0.23x / 0.20x")
    assert latest_table(ASYNC)["async / sync"].startswith("0.12x")  # the tenth of ten runs, the nine others in the history
    assert latest_table(ASYNC)["loaded: async / sync"].startswith("0.19x")
    older = sections(HISTORY, ASYNC)
    assert len(older) == 9 and sections(BENCHMARKS, ASYNC)[0] not in older
    dates = [re.match(r".+ \((.+) UTC\)\n", s)[1] for s in older]
    assert dates == sorted(dates, reverse=True) and dates[0] == "2026-12-01 20:46"  # newest first
    assert re.search(r"^\| async / sync \| (\S+)", older[0], re.M)[1] == "0.10x"


# The README's "what fits where" table, row by row: the launch's Accelerate YAML.
TABLE_LAUNCHES = {"DDP, bf16 autocast": "accelerate_ddp_config.yaml", "DeepSpeed ZeRO-2, bf16": "accelerate_deepspeed_config.yaml",
                  "DeepSpeed ZeRO-3, bf16": "accelerate_deepspeed_zero3_config.yaml"}
TABLE_ROW = re.compile(r"^\| (DDP, bf16 autocast|DeepSpeed ZeRO-[23], bf16)(?: \(the example\))? \| (\d+) x (\d+)(?: accumulation)? "
                       r"\| ([\d.]+) GiB \| (fits, ([\d.]+) (GiB|MiB) margin|refused)", flags=re.M)


@pytest.mark.slow
def test_the_what_fits_where_table_is_a_fresh_plan_of_the_example_config(one_thread):
    """Each row of the table computed again now: the README cannot keep figures of an older plan, whatever
    BENCHMARKS.md recorded. Its step measurements may come from the suite's cache, which keys each by everything it
    depends on (the code measured, torch, transformers and peft), so a cached one is what measuring again gives."""
    from opentau_cli.config import load_config, resolve_accelerate_config
    from opentau_cli.plan.memory import plan_memory

    rows = TABLE_ROW.findall(PAGES_TEXT)
    assert len(rows) == 5, rows
    card = 80 * 2**30  # a card sold as 80 GB: 81920 MiB in nvidia-smi
    examples = REPO / "configs" / "examples"
    for launch, per_device, accumulation, peak, verdict, margin, unit in rows:
        cfg = load_config(examples / "pi05_config.json", [
            f"--per_device_batch_size={per_device}", f"--gradient_accumulation_steps={accumulation}",
            "--policy.pretrained_path=null", "--policy.tokenizer_path=null"], environ={})
        plan = plan_memory(cfg, resolve_accelerate_config(examples / TABLE_LAUNCHES[launch]))
        assert float(peak) == round(plan.total / 2**30, 1), (launch, per_device, plan.describe(card))
        assert verdict.startswith("fits") == plan.fits(card), (launch, per_device)
        if margin:
            assert float(margin) == round((card - plan.total) / (2**30 if unit == "GiB" else 2**20), 1 if unit == "GiB" else 0)
