"""benchmarks/bench_augment.py: its report arithmetic on canned numbers, and one smoke run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_augment  # noqa: E402

pytestmark = pytest.mark.full


def report(step_s: float, data_s: float) -> dict:
    return {"step_time_s": step_s, "phases": {"data": {"median_s": data_s}}}


def test_the_report_on_canned_numbers_takes_medians_over_rounds_and_the_data_phase_difference_as_the_cost():
    rows = dict(bench_augment.compare_rows({
        "without": [report(1.0, 0.010), report(1.2, 0.012), report(1.1, 0.011)],
        "with": [report(1.2, 0.060), report(1.1, 0.050), report(1.5, 0.070)],
    }))
    assert rows["step time with / without"] == "1.091x"  # 1.2 / 1.1
    assert rows["augmentation per step"] == "49.0 ms (4.5% of a step)"  # (0.060 - 0.011) s of a 1.1 s step


def test_the_augmentation_benchmark_smoke_run_appends_both_sides(tmp_path):
    results = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_augment.py"), "--smoke", "--results", str(results)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = results.read_text()
    assert "The cost of openpi's image augmentation" in text and "with dataset.augment=openpi" in text
    assert "step time with / without" in text and "smoke run" in text

