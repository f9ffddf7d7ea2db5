"""The launcher's uploads (process/uploader.py) on a real directory store: one upload at a time, the newest waiting
checkpoint next, local retention free to delete a checkpoint while it uploads, failures retried, and a drain that
names what stays local only. The store is wrapped only to hold or fail a write at a chosen moment."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from opentau_cli.process.uploader import Uploader, read_status
from opentau_cli.store.layout import CHECKPOINTS, MANIFEST, point_last
from opentau_cli.store.manifest import write_manifest
from opentau_cli.store.remote_run import RemoteRun
from opentau_cli.store.storage import LocalStorage

pytestmark = pytest.mark.quick


def publish(run: Path, step: int) -> Path:
    ckpt = run / CHECKPOINTS / f"{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(bytes([step]) * 200_000)
    (ckpt / "training_state.json").write_text(json.dumps({"step": step}))
    write_manifest(ckpt)
    point_last(run / CHECKPOINTS, ckpt.name)
    return ckpt


class Gate(LocalStorage):
    """A directory store whose puts of one checkpoint's files wait for `release`, or fail `failures` times."""

    def __init__(self, root: Path, hold: str | None = None, failures: int = 0):
        super().__init__(root)
        self.hold, self.failures = hold, failures
        self.holding, self.release = threading.Event(), threading.Event()

    def put_file(self, local, key):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the store went away")
        if self.hold and f"/{self.hold}/" in key:
            self.holding.set()
            assert self.release.wait(30)
        return super().put_file(local, key)


def wait_for(condition, seconds: float = 120) -> None:  # a guard: the upload thread runs at a lower priority
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_one_upload_at_a_time_and_the_newest_waiting_checkpoint_goes_next(tmp_path):
    run, store = tmp_path / "run", Gate(tmp_path / "remote", hold="000004")
    remote = RemoteRun(store)
    up = Uploader(run, remote, keep_last=None, poll_seconds=0.05).start()
    publish(run, 2)
    wait_for(lambda: remote.committed() == ["000002"])
    publish(run, 4)
    assert store.holding.wait(20)
    publish(run, 6)
    publish(run, 8)  # 6 and 8 wait; only the newest is uploaded next
    assert read_status(run)["uploading"]["name"] == "000004"
    store.release.set()
    wait_for(lambda: remote.committed() == ["000002", "000004", "000008"])
    assert up.drain(5) == []
    assert remote.last() == "000008"
    assert read_status(run)["checkpoints"] == {"000002": "remote", "000004": "remote", "000006": "local", "000008": "remote"}


def test_a_checkpoint_deleted_locally_while_it_uploads_is_still_committed_whole(tmp_path):
    run, store = tmp_path / "run", Gate(tmp_path / "remote", hold="000002")
    remote = RemoteRun(store)
    up = Uploader(run, remote, keep_last=None, poll_seconds=0.05).start()
    ckpt = publish(run, 2)
    expected = (ckpt / "model.safetensors").read_bytes()
    assert store.holding.wait(20)
    shutil.rmtree(ckpt)  # local retention after a newer save
    store.release.set()
    wait_for(lambda: remote.committed() == ["000002"])
    up.drain(5)
    assert remote.storage.read_bytes(f"{CHECKPOINTS}/000002/model.safetensors") == expected
    assert not (run / ".uploading").exists() or not any((run / ".uploading").iterdir())


def test_a_failing_store_is_retried_and_the_checkpoint_commits_once_it_answers(tmp_path):
    run, store = tmp_path / "run", Gate(tmp_path / "remote", failures=2)
    remote = RemoteRun(store)
    up = Uploader(run, remote, keep_last=None, poll_seconds=0.05)
    up.backoff = (0.05,)
    up.start()
    publish(run, 2)
    wait_for(lambda: remote.committed() == ["000002"])
    assert up.drain(5) == []
    assert read_status(run)["error"] is None


@pytest.mark.timeout(120)  # a drain that waited for the store, which never answers here, fails instead of hanging
def test_a_drain_against_a_store_that_stays_away_names_what_is_local_only(tmp_path):
    run, store = tmp_path / "run", Gate(tmp_path / "remote", failures=10**6)
    up = Uploader(run, RemoteRun(store), keep_last=None, poll_seconds=0.05)
    up.backoff = (0.05,)
    up.start()
    publish(run, 2)
    publish(run, 4)
    wait_for(lambda: (read_status(run) or {}).get("error"))  # it has tried (at a lower priority: a busy machine waits)
    assert up.drain(1.0) == ["000002", "000004"]  # gives up after its 1 s: the store never answers (the timeout mark)
    status = read_status(run)
    assert "ConnectionError" in status["error"] and status["checkpoints"] == {"000002": "local", "000004": "local"}


def test_remote_retention_keeps_keep_last_and_the_checkpoint_the_launch_resumed_from(tmp_path):
    run = tmp_path / "run"
    remote = RemoteRun(LocalStorage(tmp_path / "remote"))
    up = Uploader(run, remote, keep_last=1, protect="000002", poll_seconds=0.05).start()
    for step in (2, 4, 6):
        publish(run, step)
        wait_for(lambda: f"{step:06d}" in remote.committed())
    up.drain(5)
    assert remote.committed() == ["000002", "000006"] and remote.last() == "000006"
    assert (remote.storage.root / CHECKPOINTS / "000004").exists() is False
    assert all((run / CHECKPOINTS / n / MANIFEST).is_file() for n in ("000002", "000004", "000006"))  # local untouched


def test_a_same_named_checkpoint_committed_with_other_content_is_never_written_over(tmp_path):
    """Another machine's 000002 is committed (the run went on elsewhere): this launch stops uploading, says why,
    and the store keeps the other checkpoint byte for byte."""
    other, run = tmp_path / "other", tmp_path / "run"
    remote = RemoteRun(LocalStorage(tmp_path / "remote"))
    theirs = Uploader(other, remote, keep_last=None, poll_seconds=0.05).start()
    publish(other, 2)
    wait_for(lambda: remote.committed() == ["000002"])
    theirs.drain(5)
    stored = {key: remote.storage.read_bytes(key) for key in remote.storage.list(CHECKPOINTS)}
    said = []
    mine = Uploader(run, remote, keep_last=None, poll_seconds=0.05, echo=said.append).start()
    ckpt = publish(run, 2)
    (ckpt / "model.safetensors").write_bytes(b"other content" * 1000)
    write_manifest(ckpt)
    wait_for(lambda: mine.stopped is not None)
    assert mine.drain(1) == []  # nothing newer than the store's 000002: the name is taken, not left behind
    assert {key: remote.storage.read_bytes(key) for key in remote.storage.list(CHECKPOINTS)} == stored
    assert said == [mine.stopped] and "holds another checkpoint 000002" in mine.stopped
    assert read_status(run)["stopped"] == mine.stopped


def test_the_upload_reports_the_bytes_as_the_client_sends_them(s3, tmp_path):
    """What moves the progress line's percentage: S3 transfers report bytes as they go, in many steps."""
    from opentau_cli.store.storage import open_storage

    local = tmp_path / "big.bin"
    local.write_bytes(bytes(range(256)) * (40 * 4096))  # 40 MiB: three 16 MiB parts
    calls = []
    open_storage(s3.url(f"progress/{tmp_path.name}")).put_files([(local, "big.bin")], calls.append)
    assert sum(calls) == local.stat().st_size and len(calls) > 3


def test_checkpoint_push_commits_what_is_local_only_oldest_first_holding_the_lease(tmp_path):
    from opentau_cli.errors import UserError
    from opentau_cli.process import lease
    from opentau_cli.process.uploader import push

    run, store = tmp_path / "run", LocalStorage(tmp_path / "remote")
    remote = RemoteRun(store)
    up = Uploader(run, remote, keep_last=None, poll_seconds=0.05).start()
    publish(run, 2)
    wait_for(lambda: remote.committed() == ["000002"])
    up.drain(5)
    publish(run, 4)
    publish(run, 6)  # saved after the launch: local only
    settings = {"remote": store.url, "keep_last": None}
    held = lease.acquire(store, {**lease.identity("/elsewhere", 60), "host": "another-host"})
    with pytest.raises(UserError, match="is being written by run /elsewhere"):
        push(run, settings, echo=lambda line: None)
    assert remote.committed() == ["000002"]
    held.release()
    said = []
    assert push(run, settings, echo=said.append) == ["000004", "000006"]
    assert remote.committed() == ["000002", "000004", "000006"] and remote.last() == "000006"
    for name in ("000004", "000006"):
        assert remote.manifest(name) == json.loads((run / CHECKPOINTS / name / MANIFEST).read_text())
    assert said[-1] == f"Checkpoint 000006 is stored in {store.url}."
    assert push(run, settings, echo=said.append) == []
