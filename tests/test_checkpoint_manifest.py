"""The manifest vouches for exactly the files a save wrote: sizes and hashes, and nothing else."""

from __future__ import annotations

import json

import pytest

from opentau_cli.store.layout import DS_MODEL_STATES, DS_TAG, MANIFEST, MODEL_WEIGHTS, TRAIN_CONFIG, tmp_dir
from opentau_cli.store.manifest import add_to_manifest, is_complete, verify_manifest, write_manifest

pytestmark = pytest.mark.quick

SHARD = f"{DS_TAG}/global_step2/{DS_MODEL_STATES}"


def _make_ckpt(d):
    (d / SHARD).parent.mkdir(parents=True)
    (d / MODEL_WEIGHTS).write_bytes(b"\x01" * 1000)
    (d / TRAIN_CONFIG).write_text('{"steps": 4}')
    (d / SHARD).write_bytes(bytes(range(256)) * 10)
    return d


def test_manifest_lists_every_file_with_size_and_relative_path(tmp_path):
    d = _make_ckpt(tmp_path / "000002")
    path = write_manifest(d)
    data = json.loads(path.read_text())
    assert path.name == MANIFEST
    assert sorted(data["files"]) == sorted([MODEL_WEIGHTS, SHARD, TRAIN_CONFIG])
    assert data["files"][MODEL_WEIGHTS]["size"] == 1000
    assert data["files"][SHARD]["size"] == 2560
    assert len(data["files"][TRAIN_CONFIG]["hash"]) == 32
    assert sorted(p.name for p in d.iterdir()) == sorted([MANIFEST, MODEL_WEIGHTS, DS_TAG, TRAIN_CONFIG])  # no temp file
    assert verify_manifest(d) == [] and is_complete(d)


def test_verify_reports_missing_extra_truncated_and_altered_files(tmp_path):
    d = _make_ckpt(tmp_path / "000002")
    write_manifest(d)
    (d / TRAIN_CONFIG).unlink()
    (d / "stray.bin").write_bytes(b"x")
    (d / MODEL_WEIGHTS).write_bytes(b"\x01" * 500)
    shard = d / SHARD
    data = bytearray(shard.read_bytes())
    data[7] ^= 0xFF  # same size, one flipped byte
    shard.write_bytes(bytes(data))

    problems = {(p.kind, p.path) for p in verify_manifest(d)}
    assert problems == {
        ("missing", TRAIN_CONFIG),
        ("extra", "stray.bin"),
        ("truncated", MODEL_WEIGHTS),
        ("altered", SHARD),
    }
    assert not is_complete(d)


def test_directory_without_manifest_is_not_complete(tmp_path):
    d = _make_ckpt(tmp_dir(tmp_path, "000002", "abc"))
    problems = verify_manifest(d)
    assert [(p.kind, p.path) for p in problems] == [("missing", MANIFEST)]
    assert not is_complete(d)


def test_corrupt_manifest_is_reported_not_trusted(tmp_path):
    d = _make_ckpt(tmp_path / "000002")
    write_manifest(d)
    (d / MANIFEST).write_text('{"files": ')
    assert [(p.kind, p.path) for p in verify_manifest(d)] == [("altered", MANIFEST)]


def test_is_complete_skips_rehash_but_verify_catches_same_size_change(tmp_path):
    d = _make_ckpt(tmp_path / "000002")
    write_manifest(d)
    (d / MODEL_WEIGHTS).write_bytes(b"\x02" * 1000)
    assert is_complete(d)  # cheap check: sizes only
    assert [(p.kind, p.path) for p in verify_manifest(d)] == [("altered", MODEL_WEIGHTS)]


def test_added_file_becomes_vouched_for(tmp_path):
    d = _make_ckpt(tmp_path / "000002")
    write_manifest(d)
    (d / "consolidated.safetensors").write_bytes(b"abc")
    assert [p.kind for p in verify_manifest(d)] == ["extra"]
    add_to_manifest(d, ["consolidated.safetensors"])
    assert verify_manifest(d) == []


def test_durable_manifest_fsyncs_every_file_it_vouches_for(tmp_path, monkeypatch):
    import os

    from opentau_cli.store import manifest as manifest_mod

    (tmp_path / "a.bin").write_bytes(b"a" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"b" * 20)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(manifest_mod.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    manifest_mod.write_manifest(tmp_path, fsync=True)
    assert str(tmp_path / "a.bin") in synced and str(tmp_path / "sub" / "b.bin") in synced


def test_manifest_records_the_checkpoint_format_and_the_release_that_wrote_it(tmp_path):
    from opentau_cli import __version__
    from opentau_cli.store.format import FORMAT_VERSION, read_version

    d = _make_ckpt(tmp_path / "000002")
    data = json.loads(write_manifest(d).read_text())
    assert data["format_version"] == FORMAT_VERSION == 2 and data["opentau_version"] == __version__
    assert read_version(d) == 2  # no training_state.json: the manifest says it
    add_to_manifest(d, [TRAIN_CONFIG])  # vouching for a file added later keeps what the save recorded
    assert json.loads((d / MANIFEST).read_text())["format_version"] == 2
