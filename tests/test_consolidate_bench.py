"""The consolidation benchmark script runs end to end (tiny model) and checks both outputs are identical."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_bench_consolidate_smoke_runs_both_paths_and_reports_ratios(tmp_path):
    results = tmp_path / "BENCH.md"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_consolidate.py"), "--smoke", "--results", str(results)],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "RSS ratio" in res.stdout and "wall ratio" in res.stdout and "identical" in res.stdout
    text = results.read_text()
    assert "Streaming consolidation vs zero_to_fp32" in text and "| upstream peak RSS |" in text and "command:" in text
