"""`opentau dataset synth | info` through the installed CLI, and the @demo dataset generated once, race-safe."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import run_cli
from opentau_cli.data import LeRobotDataset, write_synth
from opentau_cli.data.meta import read_meta
from opentau_cli.data.synth import DEMO_SETTINGS, DEMO_VERSION

pytestmark = [pytest.mark.full, pytest.mark.timeout(300)]  # a hung data worker fails the test instead of stalling CI


def test_synth_then_info_describe_the_written_v30_dataset(tmp_path):
    out = tmp_path / "reach"
    r = run_cli(["dataset", "synth", str(out), "--episodes", "4", "--steps-per-episode", "7", "--cameras", "2",
                 "--format", "v3.0", "--seed", "9"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "meta/episodes/chunk-000/file-000.parquet").is_file() and (out / "meta/tasks.parquet").is_file()
    assert (out / "data/chunk-000/file-000.parquet").is_file() and (out / "meta/stats.json").is_file()
    r = run_cli(["dataset", "info", str(out), "--json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["codebase_version"], info["episodes"], info["frames"], info["fps"]) == ("v3.0", 4, 28, 10.0)
    assert info["cameras"] == ["observation.images.top", "observation.images.front"]
    assert info["features"]["action"] == {"dtype": "float32", "shape": [2]}
    ds = LeRobotDataset(out, chunk_size=1, image_resolution=(8, 8), num_cameras=2)
    actions = [ds[i]["actions"][0].tolist() for i in range(len(ds))]
    mean = [sum(a[d] for a in actions) / len(actions) for d in range(2)]
    assert all(abs(m - s) < 1e-5 for m, s in zip(mean, info["stats"]["action"]["mean"]))


def test_info_prints_features_episodes_frames_fps_and_stats(tmp_path):
    out = write_synth(tmp_path / "reach", episodes=2, steps_per_episode=5)
    r = run_cli(["dataset", "info", str(out)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for line in ("Episodes  2", "Frames    10", "FPS       10", "observation.images.top", "Layout    LeRobot v2.1", "action mean ["):
        assert line in r.stdout, line
    assert read_meta(out).info["total_frames"] == 10
    r = run_cli(["dataset", "info", str(out), "--verify"], cwd=tmp_path)
    assert r.returncode == 0 and "Verified: all 10 frames of 2 episodes" in r.stderr


def test_racing_processes_generate_the_demo_once_and_both_read_it(tmp_path):
    env_code = (
        "import os, sys; os.environ['OPENTAU_CACHE_DIR'] = sys.argv[1]\n"
        "from opentau_cli.data import resolve_dataset_root\n"
        "print(resolve_dataset_root('@demo'))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", env_code, str(tmp_path)], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    roots = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert roots[0] == roots[1] == str(tmp_path / f"demo-{DEMO_VERSION}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"demo-{DEMO_VERSION}"]  # no temp dir left behind
    meta = read_meta(roots[0])
    n = DEMO_SETTINGS["episodes"]
    assert meta.info["total_episodes"] == n and len(meta.episodes) == n and meta.version == "v2.1"
