"""Profile statistics and rendering, from hand-made per-rank timings (no launch)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from opentau_cli.profiling.render import compare_table, fmt_bytes, print_report
from opentau_cli.profiling.stats import (
    REPORT_FIELDS,
    REPORT_PHASES,
    compare_row,
    peak_memory,
    percentile,
    phase_stats,
    rank_result,
    summarize,
)
from opentau_cli.train.timing import PHASES

pytestmark = pytest.mark.quick


def _step(total: float, **phases: float) -> dict:
    return {**{p: 0.0 for p in PHASES}, **phases, "total": total}


def _rank(rank: int, totals: list[float], memory: int = 1 << 30) -> dict:
    steps = [_step(t, data=0.1 * t, forward=0.3 * t, backward=0.5 * t) for t in totals]
    return {"rank": rank, "steps": steps, "peak_memory": {"bytes": memory, "kind": "process_peak_rss"}, "device": "cpu"}


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 95) == pytest.approx(95.0)
    assert percentile([7.0], 95) == 7.0


def test_phase_stats_shares_include_other_and_sum_to_one():
    steps = [_step(1.0, data=0.1, forward=0.3, backward=0.4), _step(2.0, data=0.2, forward=0.6, backward=0.8)]
    stats = phase_stats(steps)
    assert set(stats) == set(REPORT_PHASES)
    assert stats["total"]["share"] == pytest.approx(1.0)
    assert stats["other"]["mean_s"] == pytest.approx(0.3)  # (0.2 + 0.4) / 2 outside any phase
    assert sum(stats[p]["share"] for p in REPORT_PHASES if p != "total") == pytest.approx(1.0)
    assert stats["forward"]["median_s"] == pytest.approx(0.45)


def test_throughput_uses_the_slowest_rank():
    fast, slow = _rank(0, [1.0, 1.0]), _rank(1, [2.0, 2.0], memory=2 << 30)
    report = summarize([slow, fast], global_batch_size=16, backend="ddp")
    assert report["slowest_rank"] == 1
    assert report["steps_per_s"] == pytest.approx(0.5)
    assert report["samples_per_s"] == pytest.approx(8.0)
    assert report["step_time_s"] == pytest.approx(2.0)
    assert [m["rank"] for m in report["peak_memory"]] == [0, 1]
    assert report["peak_memory"][1]["bytes"] == 2 << 30


def test_mfu_is_none_without_known_flops_and_computed_when_known():
    ranks = [_rank(0, [1.0]), _rank(1, [1.0])]
    assert summarize(ranks, global_batch_size=8)["mfu"] is None
    report = summarize(ranks, global_batch_size=8, flops_per_sample=1e12, peak_flops_per_device=100e12)
    # 8 samples/s * 1 TFLOP / (2 devices * 100 TFLOP/s) = 4%
    assert report["mfu"] == pytest.approx(0.04)


def test_known_gpu_names_give_a_peak_and_cpu_does_not():
    ranks = [{**_rank(0, [1.0]), "device": "NVIDIA H100 80GB HBM3"}]
    assert summarize(ranks, global_batch_size=1, flops_per_sample=1e12)["mfu"] == pytest.approx(1e12 / 989e12)
    assert summarize([_rank(0, [1.0])], global_batch_size=1, flops_per_sample=1e12)["mfu"] is None


def test_report_has_every_field_and_is_json_serialisable():
    report = summarize([_rank(0, [1.0, 1.2])], global_batch_size=8, backend="deepspeed", run={"backend_label": "DeepSpeed ZeRO-2"})
    assert set(report) == set(REPORT_FIELDS)
    assert "engine.step" in report["accounting"] and "reduce-scatter" in report["accounting"]
    assert json.loads(json.dumps(report)) == report


def test_summarize_refuses_a_rank_without_steps():
    with pytest.raises(ValueError):
        summarize([_rank(0, [])], global_batch_size=1)


def test_compare_rows_report_speedup_against_the_first_config():
    ddp = summarize([_rank(0, [1.0]), _rank(1, [1.0])], global_batch_size=8, backend="ddp", run={"backend_label": "DDP"})
    zero = summarize([_rank(0, [2.0]), _rank(1, [2.0], memory=3 << 30)], global_batch_size=8, backend="deepspeed")
    rows = [compare_row("ddp.yaml", ddp, ddp), compare_row("zero.yaml", zero, ddp)]
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(0.5)
    assert rows[1]["peak_memory_bytes"] == 3 << 30
    assert rows[0]["backend"] == "DDP"


def test_rendered_table_names_every_phase_and_the_headline_numbers():
    report = summarize([_rank(0, [0.5, 0.5])], global_batch_size=4, backend="deepspeed")
    buf = io.StringIO()
    print_report(report, Console(file=buf, width=200))
    text = buf.getvalue()
    for label in ("data wait", "forward", "backward", "optimizer step", "zero-grad + scheduler", "metric gather / sync", "total step"):
        assert label in text
    assert "2.000 steps/s, 8.00 global samples/s" in text
    assert "MFU: n/a" in text and "engine.step" in text
    buf = io.StringIO()
    Console(file=buf, width=200).print(compare_table([compare_row("a.yaml", report, report)]))
    assert "a.yaml" in buf.getvalue() and "1.00x" in buf.getvalue()


def test_peak_memory_on_cpu_is_the_process_peak_rss():
    mem = peak_memory()
    assert mem["kind"] == "process_peak_rss"
    assert mem["bytes"] > 10 * 1024 * 1024  # a Python process with torch imported is far above 10 MiB
    assert rank_result(3, [_step(1.0)])["rank"] == 3


def test_fmt_bytes():
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(3 << 30) == "3.00 GiB"


@pytest.mark.parametrize("fits_up_to, limit, expected", [(37, 256, (37, 38)), (1, 256, (1, 2)), (0, 256, (0, 1)),
                                                         (300, 256, (256, None)), (100, 100, (100, None)), (99, 100, (99, 100))])
def test_max_batch_search_finds_the_largest_batch_that_fits(fits_up_to, limit, expected):
    from opentau_cli.profiling.run import search_max_batch

    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= fits_up_to

    assert search_max_batch(fits, limit) == expected
    assert len(tried) == len(set(tried))  # never runs the same trial twice
    assert len(tried) <= 2 * limit.bit_length() + 1
