"""The remote commit protocol (store/remote_run.py) on a real store: a directory (file://) and SeaweedFS (s3://).

A checkpoint counts remotely only once every file of its manifest is stored and checked, then its manifest, then
`last`; readers never take a folder without a manifest; retention and rollback never touch `last`; a download is
checked against the manifest before it lands. The checkpoints here are files on disk with a manifest written by the
product's own `write_manifest` (the protocol under test is the remote one)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from opentau_cli.errors import RunError, UserError
from opentau_cli.store.layout import CHECKPOINTS, MANIFEST, point_last
from opentau_cli.store.manifest import verify_manifest, write_manifest
from opentau_cli.store.remote_run import RemoteRun, choose, history_files, split_target
from opentau_cli.store.storage import open_storage

pytestmark = pytest.mark.quick


def make_checkpoint(run: Path, step: int, seed: int = 0) -> Path:
    """A published checkpoint of `step` with two files of random bytes and a manifest, `last` pointing at it."""
    ckpt = run / CHECKPOINTS / f"{step:06d}"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(os.urandom(300_000 + seed))
    (ckpt / "sub" / "optimizer.bin").write_bytes(os.urandom(1000 + step))
    (ckpt / "training_state.json").write_text(json.dumps({"step": step}))
    write_manifest(ckpt)
    point_last(run / CHECKPOINTS, ckpt.name)
    (run / "metrics.jsonl").open("a").write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
    return ckpt


def files_of(ckpt: Path) -> dict[str, Path]:
    manifest = json.loads((ckpt / MANIFEST).read_text())
    return {rel: ckpt / rel for rel in manifest["files"]}


def upload_and_commit(remote: RemoteRun, run: Path, ckpt: Path) -> None:
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert remote.upload(ckpt.name, files_of(ckpt), manifest)
    remote.commit(ckpt.name, ckpt / MANIFEST, history_files(run))


@pytest.fixture(params=["file", "s3"])
def remote(request, tmp_path, monkeypatch):
    if request.param == "file":
        yield RemoteRun(open_storage((tmp_path / "share" / "run").as_uri()))
        return
    server = request.getfixturevalue("s3_server")
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    yield RemoteRun(open_storage(server.url(f"runs/{request.node.name}")))


def test_a_checkpoint_counts_only_once_its_manifest_and_last_are_written(remote, tmp_path):
    run = tmp_path / "run"
    ckpt = make_checkpoint(run, 2)
    assert remote.upload(ckpt.name, files_of(ckpt), json.loads((ckpt / MANIFEST).read_text()))
    # every file is stored, none is trusted yet
    assert remote.committed() == [] and remote.last() is None and remote.partial() == ["000002"]
    remote.commit(ckpt.name, ckpt / MANIFEST, history_files(run))
    assert remote.committed() == ["000002"] and remote.last() == "000002" and remote.partial() == []
    assert remote.storage.read_bytes("metrics.jsonl") == (run / "metrics.jsonl").read_bytes()

    copy = tmp_path / "elsewhere"
    got = remote.fetch("000002", copy)
    assert got == copy / CHECKPOINTS / "000002"
    assert verify_manifest(got) == []
    assert {rel: p.read_bytes() for rel, p in files_of(got).items()} == {rel: p.read_bytes() for rel, p in files_of(ckpt).items()}
    assert (copy / CHECKPOINTS / "last").resolve() == got.resolve()
    assert (copy / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()


def test_last_naming_a_checkpoint_without_its_manifest_is_not_taken(remote, tmp_path):
    run = tmp_path / "run"
    upload_and_commit(remote, run, make_checkpoint(run, 2))
    ckpt = make_checkpoint(run, 4)
    remote.upload(ckpt.name, files_of(ckpt), json.loads((ckpt / MANIFEST).read_text()))
    remote.storage.write_bytes(f"{CHECKPOINTS}/last", b"000004\n")  # a pointer written before its manifest (a bug)
    assert remote.last() is None  # never a partial checkpoint
    assert choose(remote, None) == "000002"  # readers go by the manifests: `last` is only a hint
    found = remote.survey()
    assert found.committed == ["000002"] and found.partial == ["000004"] and found.last == "000004"
    assert found.last_problem == ("checkpoints/last names 000004, which is not committed (no manifest); readers "
                                  "continue from 000002, the newest committed checkpoint")
    assert remote.repair_last("000002") == "000002" and remote.last() == "000002" and remote.survey().last_problem is None
    assert remote.repair_last("000002") is None  # sound now: nothing written


def test_a_file_changed_after_its_manifest_is_never_uploaded(remote, tmp_path):
    run = tmp_path / "run"
    ckpt = make_checkpoint(run, 2)
    (ckpt / "sub" / "optimizer.bin").write_bytes(os.urandom(1002))  # same size, other bytes
    with pytest.raises(RunError, match="no longer matches"):
        remote.upload(ckpt.name, files_of(ckpt), json.loads((ckpt / MANIFEST).read_text()))
    assert remote.committed() == []


def test_leftovers_of_an_interrupted_upload_go_at_the_next_commit_and_retention_keeps_last_and_best(remote, tmp_path):
    run = tmp_path / "run"
    for step in (2, 4, 6):
        upload_and_commit(remote, run, make_checkpoint(run, step))
    remote.storage.write_bytes(f"{CHECKPOINTS}/best", b"000002\n")
    broken = make_checkpoint(run, 8)
    stopped = iter([False, True])
    assert not remote.upload(broken.name, files_of(broken), json.loads((broken / MANIFEST).read_text()),
                             cancelled=lambda: next(stopped))
    assert remote.partial() == ["000008"] and remote.last() == "000006"

    assert remote.remove_partial(busy={"000010"}) == ["000008"]
    assert remote.retain({"000006"}) == ["000004"]  # 000002 is best, 000006 is last
    assert remote.committed() == ["000002", "000006"] and remote.partial() == []
    assert remote.storage.list(f"{CHECKPOINTS}/000004") == []


def test_a_rollback_sets_newer_remote_checkpoints_aside_where_no_reader_takes_them(remote, tmp_path):
    run = tmp_path / "run"
    for step in (2, 4, 6):
        upload_and_commit(remote, run, make_checkpoint(run, step))
    before = {k: remote.storage.read_bytes(k) for k in remote.storage.list(f"{CHECKPOINTS}/000006")}
    remote.set_aside(["000004", "000006"], "20261204-120000")
    assert remote.committed() == ["000002"] and remote.last() is None
    kept = {k.removeprefix("rolled_back/20261204-120000/"): remote.storage.read_bytes(k)
            for k in remote.storage.list("rolled_back/20261204-120000/checkpoints/000006")}
    assert kept == before


def test_a_download_that_does_not_match_the_manifest_lands_nothing(remote, tmp_path):
    run = tmp_path / "run"
    ckpt = make_checkpoint(run, 2)
    upload_and_commit(remote, run, ckpt)
    key = f"{CHECKPOINTS}/000002/model.safetensors"
    data = bytearray(remote.storage.read_bytes(key))
    data[1000] ^= 0xFF
    remote.storage.write_bytes(key, bytes(data))  # rot in the store after the commit
    with pytest.raises(UserError) as refused:
        remote.fetch("000002", tmp_path / "copy")
    assert str(refused.value) == (f"Checkpoint 000002 in {remote.url} is damaged (checkpoints/000002/model.safetensors "
                                  "does not match its manifest's hash) and nothing was written locally: no earlier "
                                  "checkpoint there is intact; restore the file, or start the run again with "
                                  "`opentau train`.")
    assert not (tmp_path / "copy").exists()


@pytest.mark.parametrize("text, expected", [
    ("s3://b/run", ("s3://b/run", None)), ("s3://b/run:last", ("s3://b/run", None)),
    ("s3://b/run:best", ("s3://b/run", "best")), ("s3://b/run:000040", ("s3://b/run", "000040")),
    ("file:///mnt/share/run:40", ("file:///mnt/share/run", "40")), ("s3://b/weird:name", ("s3://b/weird:name", None)),
])
def test_a_remote_target_names_its_checkpoint_after_the_last_colon(text, expected):
    assert split_target(text) == expected
