"""LeRobot datasets by Hugging Face repo id (`dataset.repo_id`), read offline from a cache that this test lays out
exactly as huggingface_hub's downloads leave it (datasets--org--name/refs, snapshots/<commit> of relative symlinks
into blobs/, the commit's tree listing), from the demo data: a v2.1 and a v3.0 dataset with two video cameras. Files
of the episodes and cameras a run does not select are left out of the cache, so every read of one would fail."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from opentau_cli.config.load import load_config
from opentau_cli.data import build_data, write_synth
from opentau_cli.data.check import check_dataset
from opentau_cli.data.hub import pin_for_resume
from opentau_cli.errors import UserError

pytestmark = [pytest.mark.full, pytest.mark.timeout(300)]

TOP, FRONT = "observation.images.top", "observation.images.front"
V21, V30 = "org/reach_v21", "org/reach_v30"


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out(cache: Path, repo_id: str, folder: Path, revision: str, *, left_out=lambda rel: False) -> str:
    """`folder` as huggingface_hub leaves a download of it in `cache` (repo type dataset), at a commit of its own
    under `refs/<revision>`; the files `left_out` says are listed in the commit's tree but never downloaded.
    Returns the commit."""
    storage = cache / f"datasets--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}@{folder}".encode()).hexdigest()
    tree = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = file.relative_to(folder).as_posix()
        data = file.read_bytes()
        lfs = rel.endswith((".parquet", ".mp4"))  # LeRobot's repos keep these in LFS: blobs named by sha256
        etag = hashlib.sha256(data).hexdigest() if lfs else _blob_id(data)
        tree[rel] = {"size": len(data), "blob_id": _blob_id(data), **({"lfs_sha256": etag, "lfs_size": len(data)} if lfs else {})}
        if left_out(rel):
            continue
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}, indent=1))
    return commit


def unselected(rel: str) -> bool:
    """What a run on episodes 0 and 2, camera 'top' never reads: other episodes' files, the 'front' camera."""
    if FRONT in rel:
        return True
    return "episode_000001" in rel or "episode_000003" in rel


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    import av  # noqa: F401  (a dev dependency: missing, the test fails)
    base = tmp_path_factory.mktemp("hub_src")
    args = dict(episodes=4, steps_per_episode=8, cameras=2, seed=3, video=True)
    return {"v2.1": write_synth(base / "v21", fmt="v2.1", **args), "v3.0": write_synth(base / "v30", fmt="v3.0", **args)}


@pytest.fixture
def cache(tmp_path, monkeypatch, datasets):
    """HF_HUB_OFFLINE=1 over a cache of this test's own holding both datasets (only the selected files), main and
    a tag v3.0 on another commit of the v3.0 one."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    commits = {
        V21: lay_out(cache, V21, datasets["v2.1"], "main", left_out=unselected),
        V30: lay_out(cache, V30, datasets["v3.0"], "main", left_out=unselected),
        V30 + "@v3.0": lay_out(cache, V30, datasets["v3.0"], "v3.0", left_out=unselected),  # a second commit
    }
    return commits


def config(*args: str):
    return load_config(None, [
        "--policy.preset=pi05_tiny", "--policy.chunk_size=4", "--policy.n_action_steps=4", "--policy.max_state_dim=8",
        "--policy.max_action_dim=8", "--policy.image_resolution=[32,32]", "--batch_size=4", "--dataset.num_workers=0",
        "--dataset.num_cameras=1", *args,
    ])


SELECTED = ["--dataset.episodes=[0,2]", f'--dataset.camera_keys={{"{TOP}": "camera0"}}']


@pytest.mark.parametrize("repo", [V21, V30])
def test_a_repo_id_reads_the_selected_episodes_and_cameras_from_the_cache_and_nothing_else(cache, repo):
    cfg = config(f"--dataset.repo_id={repo}", *SELECTED)
    assert check_dataset(cfg) == []  # the pre-launch checks, on the cached files (the others are absent)
    snapshot = Path(os.environ["HF_HUB_CACHE"]) / f"datasets--{repo.replace('/', '--')}" / "snapshots" / cache[repo]
    assert (cfg.dataset.repo_id, cfg.dataset.revision) == (repo, cache[repo])  # the commit is pinned for the launch
    assert not list(snapshot.rglob(f"*{FRONT}*")) and not list(snapshot.rglob("episode_000001*"))
    data = build_data(cfg)  # what a rank does: the cache alone
    try:
        assert data.train_dataset.root == snapshot and sorted(data.train_dataset.episodes) == [0, 2]
        assert data.revisions == {repo.split("/")[1]: {"repo_id": repo, "commit": cache[repo]}}
        batch = next(data.stream)
        assert batch["images"].shape == (4, 1, 3, 32, 32) and batch["images"].float().mean() > 0.01 * 255
        for i in range(len(data.train_dataset)):  # every frame, decoded from the cached videos
            data.train_dataset[i]
    finally:
        data.stream.close()


def test_a_tag_after_the_at_sign_or_in_revision_reads_that_commit(cache):
    for args in ([f"--dataset.repo_id={V30}@v3.0"], [f"--dataset.repo_id={V30}", "--dataset.revision=v3.0"]):
        cfg = config(*args, *SELECTED)
        assert check_dataset(cfg) == []
        assert (cfg.dataset.repo_id, cfg.dataset.revision) == (V30, cache[V30 + "@v3.0"])
    both = config(f"--dataset.repo_id={V30}@v3.0", "--dataset.revision=main", *SELECTED)
    assert check_dataset(both) == [f"dataset.repo_id '{V30}@v3.0' names revision 'v3.0' but dataset.revision is 'main': give the revision once."]


def test_a_mixture_member_by_repo_id_next_to_a_local_one(cache, datasets):
    cfg = config('--dataset.mixture=[{"repo_id": "%s", "episodes": [0, 2], "camera_keys": {"%s": "camera0"}}, '
                 '{"root": "%s", "camera_keys": {"%s": "camera0"}}]' % (V30, TOP, datasets["v2.1"], TOP))
    assert check_dataset(cfg) == []
    assert cfg.dataset.mixture[0].revision == cache[V30] and cfg.dataset.mixture[1].revision is None
    data = build_data(cfg)
    try:
        assert data.names == ["reach_v30", "v21"] and list(data.revisions) == ["reach_v30"]
        next(data.stream)
    finally:
        data.stream.close()


def test_offline_a_missing_revision_repo_or_file_is_one_line_naming_it(cache):
    (problem,) = check_dataset(config(f"--dataset.repo_id={V30}@v9.9", *SELECTED))
    assert problem.startswith(f"dataset.repo_id={V30}@v9.9: revision 'v9.9' of the Hugging Face dataset {V30} is not "
                              "in the Hugging Face cache") and "HF_HUB_OFFLINE is set" in problem and "\n" not in problem
    (problem,) = check_dataset(config("--dataset.repo_id=org/nowhere", *SELECTED))
    assert problem.startswith("dataset.repo_id=org/nowhere: the Hugging Face dataset org/nowhere is not in the Hugging Face cache")
    # Episode 1 was never downloaded: selecting it is a line naming its files, not a failure mid-run.
    (problem,) = check_dataset(config(f"--dataset.repo_id={V21}", "--dataset.episodes=[0,1]",
                                      f'--dataset.camera_keys={{"{TOP}": "camera0"}}'))
    assert problem.startswith(f"dataset.repo_id={V21}: data/chunk-000/episode_000001.parquet, "
                              f"videos/chunk-000/{TOP}/episode_000001.mp4 are not in the Hugging Face cache")
    (problem,) = check_dataset(config(f"--dataset.repo_id={V21}", "--dataset.root=/some/dir", *SELECTED))
    assert problem == "dataset.root and dataset.repo_id are both set: give one (a local dataset, or one on the Hugging Face Hub)."


def test_a_resume_stays_on_the_recorded_commit_and_changes_only_when_told(cache, tmp_path):
    state = {"dataset_revisions": {"reach_v30": {"repo_id": V30, "commit": cache[V30]}}}
    ckpt = tmp_path / "000010"
    # The saved config said main (or a tag), which now points elsewhere: the resume reads the recorded commit.
    cfg = config(f"--dataset.repo_id={V30}@v3.0", *SELECTED)
    (note,) = pin_for_resume(ckpt, cfg, state, {})
    assert (cfg.dataset.repo_id, cfg.dataset.revision) == (V30, cache[V30])
    assert note.startswith(f"dataset: resuming on {V30}@{cache[V30]}, the commit the checkpoint trained on (not v3.0's head now)")
    assert check_dataset(cfg) == [] and cfg.dataset.revision == cache[V30]
    # Told: --dataset.revision=v3.0 on the command line moves it, saying so.
    cfg = config(f"--dataset.repo_id={V30}", "--dataset.revision=v3.0", *SELECTED)
    (note,) = pin_for_resume(ckpt, cfg, state, {"dataset.revision": "v3.0"})
    assert note == f"dataset changes from {V30}@{cache[V30]} (the checkpoint's) to {V30}@v3.0, as the command line says."
    assert check_dataset(cfg) == [] and cfg.dataset.revision == cache[V30 + "@v3.0"]
    # Another dataset without being told: refused, naming both.
    with pytest.raises(UserError, match=f"trained on other data \\(dataset: the checkpoint trained on {V30}@{cache[V30]}, "
                                        f"this resume names {V21}\\)"):
        pin_for_resume(ckpt, config(f"--dataset.repo_id={V21}"), state, {})
    with pytest.raises(UserError, match="this resume names the local dataset @demo"):
        pin_for_resume(ckpt, config(), state, {})


def test_a_resume_says_it_stays_on_the_recorded_commit_when_the_branch_it_started_on_has_moved(cache, tmp_path):
    """The checkpoint's config names the commit (pinned at launch); the launch recorded the branch it was asked at.
    Offline, the cache's record of the branch (its last download) is what can be known, and the line says so."""
    state = {"dataset_revisions": {"reach_v30": {"repo_id": V30, "commit": cache[V30]}}}
    ckpt = tmp_path / "000010"
    cfg = config(f"--dataset.repo_id={V30}", f"--dataset.revision={cache[V30]}", *SELECTED)
    (note,) = pin_for_resume(ckpt, cfg, state, {}, {"reach_v30": "v3.0"})  # started on v3.0, which is elsewhere now
    assert note == (f"dataset: resuming on {V30}@{cache[V30]}, the commit the checkpoint trained on, although v3.0 "
                    f"pointed at, when this machine last downloaded it, {cache[V30 + '@v3.0']}; pass "
                    "--dataset.revision=v3.0 to train on that.")
    assert (cfg.dataset.repo_id, cfg.dataset.revision) == (V30, cache[V30])
    assert pin_for_resume(ckpt, cfg, state, {}, {"reach_v30": "main"}) == []  # main still points at it
    assert pin_for_resume(ckpt, cfg, state, {}, {"reach_v30": cache[V30]}) == []  # started on a commit: nothing moves
    assert pin_for_resume(ckpt, cfg, state, {}) == []  # a launch that recorded no branch: nothing to compare
    mixture = config('--dataset.mixture=[{"repo_id": "%s", "revision": "%s"}]' % (V30, cache[V30]))
    (note,) = pin_for_resume(ckpt, mixture, state, {}, {"reach_v30": "v3.0"})
    assert note.startswith(f"dataset.mixture[0]: resuming on {V30}@{cache[V30]}, the commit the checkpoint trained on, "
                           "although v3.0 pointed at") and note.endswith("pass --dataset.mixture.0.revision=v3.0 to train on that.")


def test_a_resume_asks_the_hub_where_the_branch_points_now(tmp_path, monkeypatch):
    """Online: the Hub's answer for the branch (a local server speaking the Hub's API to the real client)."""
    from huggingface_hub import constants

    from hub_server import HubServer
    from opentau_cli.store.hub import hub_reachable

    server = HubServer().start()
    try:
        first = server.publish("org/reach", write_synth(tmp_path / "v1", episodes=2, steps_per_episode=4, seed=1))
        second = server.publish("org/reach", write_synth(tmp_path / "v2", episodes=2, steps_per_episode=4, seed=2))
        for name, value in (("ENDPOINT", server.url), ("HF_HUB_OFFLINE", False), ("HF_HUB_CACHE", str(tmp_path / "c"))):
            monkeypatch.setattr(constants, name, value)
        hub_reachable.cache_clear()
        state = {"dataset_revisions": {"reach": {"repo_id": "org/reach", "commit": first}}}
        cfg = config("--dataset.repo_id=org/reach", f"--dataset.revision={first}")
        (note,) = pin_for_resume(tmp_path / "000010", cfg, state, {}, {"reach": "main"})
        assert note == (f"dataset: resuming on org/reach@{first}, the commit the checkpoint trained on, although main "
                        f"now points at {second}; pass --dataset.revision=main to train on that.")
        assert cfg.dataset.revision == first
    finally:
        server.stop()
        hub_reachable.cache_clear()


def test_the_hubs_answers_gated_missing_repo_and_missing_revision_are_one_line_each():
    """What the Hub answers (huggingface_hub's own error types, as its client raises them) in one sentence each."""
    import httpx2
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    from opentau_cli.data.hub import _hub_error

    def answer(kind, status):
        return kind("the Hub's text", response=httpx2.Response(status, request=httpx2.Request("GET", "https://hub.test")))

    assert str(_hub_error("dataset", "org/private", None, answer(GatedRepoError, 403), False)) == (
        "dataset.repo_id=org/private: the Hugging Face dataset org/private is gated: accept its conditions on "
        "https://huggingface.co/datasets/org/private and log in with `hf auth login`.")
    assert str(_hub_error("dataset.mixture[1]", "org/nope", None, answer(RepositoryNotFoundError, 404), False)) == (
        "dataset.mixture[1].repo_id=org/nope: there is no Hugging Face dataset org/nope (or it is private: log in "
        "with `hf auth login`).")
    assert str(_hub_error("dataset", "org/data", "v9", answer(RevisionNotFoundError, 404), False)) == (
        "dataset.repo_id=org/data@v9: the Hugging Face dataset org/data has no revision 'v9' (a branch, tag or commit).")
