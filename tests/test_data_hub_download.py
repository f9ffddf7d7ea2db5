"""A dataset by repo id, downloaded for real: the real `huggingface_hub` client in the CLI's own processes talks to a
local server that answers the Hub's API and file routes (tests/hub_server.py) for a LeRobot dataset with two video
cameras. One run through the CLI shows: meta/ comes first and only the selected episodes' and camera's files are ever
asked for (the server's log); the resolved commit is what the checkpoint records; a resume stays on that commit after
the branch moved; and with the server gone, the cached files still train."""

from __future__ import annotations

import json
import os

import pytest

from conftest import EXAMPLES, run_cli
from hub_server import HubServer
from opentau_cli.data import write_synth

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.timeout(600)]

REPO_ID = "org/reach"
TOP, FRONT = "observation.images.top", "observation.images.front"
ARGS = [
    f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--dataset.repo_id={REPO_ID}", "--dataset.episodes=[0,2]",
    f'--dataset.camera_keys={{"{TOP}": "camera0"}}', "--dataset.num_cameras=1", "--validation.val_split=0", "--validation.val_freq=0",
    "--batch_size=2", "--log_freq=1",
]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The server with the dataset on `main`, a cache of this module's own, and the run's directory."""
    base = tmp_path_factory.mktemp("hub_download")
    data = write_synth(base / "v1", episodes=4, steps_per_episode=8, cameras=2, seed=3, video=True, fmt="v2.1")
    server = HubServer().start()
    first = server.publish(REPO_ID, data)
    env = {"HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(base / "hf_cache"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    yield {"server": server, "first": first, "env": env, "base": base, "run": base / "run"}
    server.stop()


def _cli(hub, *args):
    result = run_cli(list(args), env=hub["env"])
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _recorded_commit(ckpt) -> str:
    state = json.loads((ckpt / "training_state.json").read_text())
    (entry,) = state["dataset_revisions"].values()
    assert entry["repo_id"] == REPO_ID
    config = json.loads((ckpt / "train_config.json").read_text())["dataset"]
    assert (config["repo_id"], config["revision"]) == (REPO_ID, entry["commit"])
    return entry["commit"]


def test_download_reads_meta_first_then_only_the_selected_files_and_the_run_keeps_its_commit(hub):
    server, first = hub["server"], hub["first"]
    _cli(hub, "train", *ARGS, f"--output_dir={hub['run']}", "--steps=2", "--save_freq=2")
    downloaded = [p.split(f"/resolve/{first}/", 1)[1] for p in server.requested("GET") if "/resolve/" in p]
    meta = [f for f in downloaded if f.startswith("meta/")]
    assert meta and downloaded[:len(meta)] == meta, downloaded  # meta/ first: it says which files the run reads
    assert sorted(downloaded[len(meta):]) == sorted([
        "data/chunk-000/episode_000000.parquet", "data/chunk-000/episode_000002.parquet",
        f"videos/chunk-000/{TOP}/episode_000000.mp4", f"videos/chunk-000/{TOP}/episode_000002.mp4"])
    asked = " ".join(server.requested("GET") + server.requested("HEAD"))
    assert FRONT not in asked and "episode_000001" not in asked and "episode_000003" not in asked
    assert _recorded_commit(hub["run"] / "checkpoints" / "000002") == first
    snapshot = hub["base"] / "hf_cache" / "datasets--org--reach" / "snapshots" / first
    assert (snapshot / "data/chunk-000/episode_000002.parquet").is_file()
    assert not (snapshot / "data/chunk-000/episode_000001.parquet").exists()

    # The branch moves (new data pushed): the resume stays on the commit its checkpoint trained on.
    moved = hub["base"] / "v2"
    write_synth(moved, episodes=4, steps_per_episode=8, cameras=2, seed=9, video=True, fmt="v2.1")
    second = server.publish(REPO_ID, moved)
    assert second != first
    before = len(server.log)
    resumed = _cli(hub, "resume", str(hub["run"]), "--steps=4", "--save_freq=2")
    assert f"resuming on {REPO_ID}@{first}, the commit the checkpoint trained on, although main now points at {second}" \
        in resumed.stderr, resumed.stderr
    assert _recorded_commit(hub["run"] / "checkpoints" / "000004") == first
    assert not any(f"/resolve/{second}/" in p for _, p in server.log[before:])  # the new commit's files never read

    # The server goes away: the cached files still train, without a network error.
    server.stop()
    _cli(hub, "resume", str(hub["run"]), "--steps=6", "--save_freq=2")
    assert _recorded_commit(hub["run"] / "checkpoints" / "000006") == first
    metrics = [json.loads(line) for line in (hub["run"] / "metrics.jsonl").read_text().splitlines()]
    assert sorted({m["step"] for m in metrics if "loss" in m}) == [1, 2, 3, 4, 5, 6]
    assert os.path.isdir(snapshot)
