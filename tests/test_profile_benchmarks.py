"""Each benchmark's --smoke mode runs end to end and records a dated section in the results file it is given
(how a run is recorded: tests/test_benchmarks_record.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.full, pytest.mark.slow]  # a minute or more: starts first (tests/conftest.py)

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # see test_profile_cli.py: busy 2-core CI boxes


def run_benchmark(script: str, results, timeout: float = 600) -> str:
    env = {**os.environ, **ONE_THREAD}
    env.pop("OPENTAU_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--results", str(results)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = results.read_text()
    assert text.startswith("# Benchmarks")
    assert re.search(r"^## .+ \(\d{4}-\d\d-\d\d \d\d:\d\d UTC\)$", text, re.M)
    assert "- machine: " in text and "CPUs" in text and "- command: `" in text and "--smoke" in text
    assert re.search(r"^- commit: ([0-9a-f]{7,}(\+dirty)?|not recorded)$", text, re.M)  # not recorded: no git checkout
    return proc.stdout


def test_overhead_benchmark_smoke_prints_the_median_pair_ratio_at_each_run_length_and_each_phase_of_both_sides(tmp_path):
    out = run_benchmark("bench_overhead.py", tmp_path / "B.md")
    for n in (1, 2):  # the smoke run's lengths, timed in the same runs
        m = re.search(rf"{n} steps: ratio opentau / hand-written\s+(\d+\.\d+) median of 1 pair \(min (\d+\.\d+), "
                      r"IQR (\d+\.\d+)-(\d+\.\d+), max (\d+\.\d+)", out)
        assert m, out
        median, low, q1, q3, high = map(float, m.groups())
        assert median > 0 and low == q1 == median == q3 == high  # one pair: its ratio is the whole spread
        ours = float(re.search(rf"{n} steps: opentau train steps/s per pair\s+(\d+\.\d+)", out).group(1))
        anchor = float(re.search(rf"{n} steps: hand-written Accelerate loop steps/s per pair\s+(\d+\.\d+)", out).group(1))
        assert median == pytest.approx(ours / anchor, rel=5e-3)
    assert re.search(r"load average \(1 min\) before / after\s+\d+\.\d\d / \d+\.\d\d", out)
    phases = {name: tuple(map(float, values)) for name, *values in re.findall(
        r"phase (.+?) \(median ms, share of step\)\s+opentau (\d+\.\d) \((\d+\.\d)%\), "
        r"hand-written (\d+\.\d) \((\d+\.\d)%\), difference ([+-]\d+\.\d)", out)}
    assert set(phases) >= {"data", "forward", "backward", "optimizer (clip + step)", "total step"}
    for name, (a, _, b, _, diff) in phases.items():
        assert abs(a - b - diff) <= 0.11, name
    assert phases["forward"][0] > 0 and phases["forward"][2] > 0
    assert phases["total step"][0] >= phases["forward"][0] + phases["backward"][0]
    assert phases["total step"][1] == phases["total step"][3] == 100.0
    assert 0 < phases["backward"][1] < 100 and 0 < phases["backward"][3] < 100
    assert "target >= 0.97" in (tmp_path / "B.md").read_text()


def test_checkpoint_benchmark_smoke_prints_bandwidth_and_launch_ratios(tmp_path):
    out = run_benchmark("bench_checkpoint.py", tmp_path / "B.md")
    assert re.search(r"save bandwidth / plain bandwidth\s+\d+\.\d+x", out)
    assert re.search(r"resume / fresh\s+\d+\.\d+x", out)


def test_backends_benchmark_smoke_compares_ddp_zero2_zero3(tmp_path):
    results = tmp_path / "B.md"
    run_benchmark("bench_backends.py", results)
    text = results.read_text()
    for backend in ("| DDP |", "| DeepSpeed ZeRO-2 |", "| DeepSpeed ZeRO-3 |"):
        assert backend in text
    assert "1.00x vs DDP" in text


def test_dataloader_benchmark_smoke_sets_a_video_mixtures_decode_ceiling_against_training(tmp_path):
    out = run_benchmark("bench_dataloader.py", tmp_path / "B.md")
    ceiling = float(re.search(r"decode ceiling \(profile --dataloader-only\)\s+(\d+\.\d) samples/s", out).group(1))
    consumed = float(re.search(r"training consumption \(profile\)\s+(\d+\.\d+) samples/s", out).group(1))
    ratio = float(re.search(r"ceiling / consumption\s+(\d+\.\d)x", out).group(1))
    assert ceiling > 0 and consumed > 0 and ratio == pytest.approx(ceiling / consumed, abs=0.06 + 0.01 * ratio)
    assert "reach_v21_video" in out and "reach_v30_video" in out


def test_lora_benchmark_smoke_tabulates_both_sides_and_their_ratios(tmp_path):
    results = tmp_path / "B.md"
    run_benchmark("bench_lora.py", results)
    table = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", results.read_text(), re.M))
    full_params, lora_params = (int(n.replace(",", "")) for n in re.fullmatch(
        r"full ([\d,]+); LoRA rank 16 ([\d,]+) \(\d+\.\d%\)", table["trainable parameters"]).groups())
    assert 0 < lora_params < full_params

    def side(name):
        m = re.fullmatch(r"(\d+\.\d{3}) samples/s; peak memory rank 0 (\d+) MiB, rank 1 (\d+) MiB", table[name])
        assert m, table[name]
        speed, *peaks = map(float, m.groups())
        assert speed > 0 and min(peaks) > 0
        return speed, max(peaks)

    (full_speed, full_peak), (lora_speed, lora_peak) = side("DDP full fine-tuning"), side("DDP LoRA rank 16")
    memory, speed = map(float, re.fullmatch(r"peak memory (\d+\.\d{3})x, samples/s (\d+\.\d{3})x", table["DDP LoRA / full"]).groups())
    assert memory == pytest.approx(lora_peak / full_peak, rel=5e-3)
    assert speed == pytest.approx(lora_speed / full_speed, rel=5e-3)
    assert "ZeRO-2 LoRA / full" not in table  # the smoke run is one DDP pair


def test_async_save_benchmark_smoke_gives_the_time_lost_per_save_of_both_modes_and_their_ratio(tmp_path):
    out = run_benchmark("bench_async_save.py", tmp_path / "B.md")
    seconds = {kind: float(re.search(rf"segment, {label} \(median s\)\s+(\d+\.\d+)", out).group(1))
               for kind, label in (("none", "no save"), ("sync", "starts with a sync save"),
                                   ("async", "starts with an async save, ends when it is published"))}
    lost = {mode: float(re.search(rf"training time lost per save, {mode}\s+(-?\d+\.\d+) s", out).group(1))
            for mode in ("sync", "async")}
    for mode in lost:  # the report's arithmetic, not a speed: one round's lost time is its segment difference
        assert lost[mode] == pytest.approx(seconds[mode] - seconds["none"], abs=0.011)
    assert re.search(r"async / sync\s+(-?\d+\.\d\d|nan)x \(target", out)  # nan when sync lost nothing (tiny, noisy)
    snapshot = int(re.search(r"async snapshot in host memory\s+(\d+) MiB", out).group(1))
    assert snapshot > 16  # the tiny preset's weights and AdamW state, and the 16 MiB write buffer
    peaks = re.search(r"peak host memory \(process RSS\)\s+sync saves (\d+) MiB, async saves (\d+) MiB", out)
    assert peaks and min(map(int, peaks.groups())) > 0
    assert "target <= 0.25x" in (tmp_path / "B.md").read_text()


# The report arithmetic of the benchmarks on canned numbers (the smoke runs above check that each script runs).


def _benchmark_module(name: str):
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_verdicts_and_ratio_rows_compare_with_the_target_in_the_right_direction():
    common, consolidate = _benchmark_module("_common"), _benchmark_module("bench_consolidate")
    assert common.verdict(0.97, 0.97) == "meets target" and common.verdict(0.96, 0.97) == "BELOW target"
    assert common.verdict(0.25, 0.25, higher_is_better=False) == "meets target"
    assert common.verdict(0.26, 0.25, higher_is_better=False) == "ABOVE target"
    assert consolidate.ratio_row("wall ratio vs upstream", [0.4913, 0.3949], 0.7) == (
        "wall ratio vs upstream (target <= 0.7)", "0.49x / 0.39x meets target")
    assert consolidate.ratio_row("RSS ratio vs upstream", [0.11, 0.31], 0.3) == (
        "RSS ratio vs upstream (target <= 0.3)", "0.11x / 0.31x ABOVE target")


def test_overhead_quartiles_of_the_pair_ratios():
    overhead = _benchmark_module("bench_overhead")
    assert overhead.quartiles([1.027, 0.993, 0.985, 0.921, 1.085]) == pytest.approx((0.985, 1.027))  # BENCHMARKS.md's run
    assert overhead.quartiles([0.9]) == (0.9, 0.9)
    assert overhead.listed([0.3791, 0.366]) == "0.379, 0.366"


def test_lora_side_takes_the_median_over_repeats_of_speed_and_of_each_rank_s_peak():
    lora = _benchmark_module("bench_lora")
    mib = 1024 * 1024
    reports = [{"samples_per_s": s, "peak_memory": [{"rank": 0, "bytes": a * mib}, {"rank": 1, "bytes": b * mib}]}
               for s, a, b in ((2.0, 1100, 1150), (1.0, 1000, 1300), (3.0, 1200, 1140))]
    side = lora.side(reports)
    assert side["samples_per_s"] == 2.0 and side["runs"] == [2.0, 1.0, 3.0] and side["peaks_mib"] == [1100, 1150]
    assert lora.describe(side) == "2.000 samples/s (median of 3: 2.000, 1.000, 3.000); peak memory rank 0 1100 MiB, rank 1 1150 MiB"


def test_imports_benchmark_smoke_times_the_rank_imports_each_way_and_the_paused_side_collects_nothing(tmp_path):
    out = run_benchmark("bench_imports.py", tmp_path / "B.md")
    assert re.search(r"paused / running: wall time\s+\d+\.\d\dx", out) and re.search(r"paused / running: CPU time\s+\d+\.\d\dx", out)
    assert re.search(r"collector running: full collections\s+[1-9]\d*$", out, re.M)  # the imports do trigger them
    assert re.search(r"collector paused: full collections\s+0$", out, re.M)
    assert re.search(r"DeepSpeed kept out / MLflow kept out: CPU time\s+\d+\.\d\dx", out)


def test_imports_rows_are_the_medians_of_each_side_and_their_ratios():
    imports = _benchmark_module("bench_imports")
    rows = dict(imports.compare_rows({
        "collector running": [{"wall_s": 4.0, "cpu_s": 4.4, "full_collections": 5}, {"wall_s": 3.0, "cpu_s": 3.3, "full_collections": 4},
                              {"wall_s": 5.0, "cpu_s": 5.5, "full_collections": 4}],
        "collector paused": [{"wall_s": 3.0, "cpu_s": 3.3, "full_collections": 0}, {"wall_s": 2.0, "cpu_s": 2.2, "full_collections": 0},
                             {"wall_s": 9.0, "cpu_s": 9.9, "full_collections": 0}]}))
    assert rows["collector running: wall time"] == "4.00 s" and rows["collector paused: CPU time"] == "3.30 s"
    assert rows["collector running: full collections"] == "4" and rows["collector paused: full collections"] == "0"
    assert rows["paused / running: wall time"] == "0.75x" and rows["paused / running: CPU time"] == "0.75x"


def test_remote_benchmark_smoke_compares_uploads_and_the_resume_from_the_store_with_boto3(tmp_path):
    results = tmp_path / "results.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_remote.py"), "--smoke", "--results", str(results),
                           "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    table = results.read_text()
    for row in ("upload, checkpoint", "upload, large checkpoint", "resume on an empty disk",
                "bytes uploaded per checkpoint, full fine-tuning"):
        assert f"| {row}" in table, table


def test_data_remote_benchmark_smoke_compares_cold_and_warm_epochs_from_the_store_with_local_disk(tmp_path):
    out = run_benchmark("bench_data_remote.py", tmp_path / "B.md")
    for side in ("cold cache", "warm cache"):
        m = re.search(rf"store, {side}\s+(\d+\.\d) samples/s \((\d+\.\d\d)x local", out)
        assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out
    peak, cap = map(float, re.search(r"cache peak on disk\s+(\d+\.\d\d) MB, cap (\d+\.\d\d) MB \(within the cap\)", out).groups())
    assert 0 < peak <= cap
    assert re.search(r"cap = half the dataset\s+\d+\.\d samples/s .*\(within the cap\)", out), out


def test_plan_benchmark_smoke_times_planning_with_the_policys_sizes_built_and_cached(tmp_path):
    out = run_benchmark("bench_plan.py", tmp_path / "B.md")
    for side in ("built", "cached"):
        assert re.search(rf"{side}: CPU time\s+\d+\.\d\d s$", out, re.M)
    assert re.search(r"cached / built: CPU time\s+\d+\.\d\dx$", out, re.M)


def test_omp_wait_benchmark_smoke_times_two_concurrent_trainings_under_each_wait_policy(tmp_path):
    out = run_benchmark("bench_omp_wait.py", tmp_path / "B.md")
    for side in ("default", "passive"):
        assert re.search(rf"{side}: CPU time\s+\d+\.\d\d s$", out, re.M)
    assert re.search(r"passive / default: CPU time\s+\d+\.\d\dx$", out, re.M)


def test_side_by_side_rows_are_the_medians_of_each_side_and_their_ratios():
    common = _benchmark_module("_common")  # bench_plan's and bench_omp_wait's table
    rows = dict(common.compare_rows({"built": [{"wall_s": 6.0, "cpu_s": 4.0}, {"wall_s": 5.0, "cpu_s": 3.0}, {"wall_s": 9.0, "cpu_s": 5.0}],
                                   "cached": [{"wall_s": 3.0, "cpu_s": 1.5}, {"wall_s": 2.0, "cpu_s": 2.0}, {"wall_s": 2.5, "cpu_s": 1.0}]}))
    assert rows["built: wall time"] == "6.00 s" and rows["built: CPU time"] == "4.00 s"
    assert rows["cached: wall time"] == "2.50 s" and rows["cached: CPU time"] == "1.50 s"
    assert rows["cached / built: wall time"] == "0.42x" and rows["cached / built: CPU time"] == "0.38x"
