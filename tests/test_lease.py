"""The store's one writer (process/lease.py; docs/ARCHITECTURE.md, "Remote checkpoints"): what the lease relies on
from the real S3 server (SeaweedFS, tests/s3_server.py) and from a directory, and the lease itself on both."""

from __future__ import annotations

import json
import threading
import time

import pytest

from opentau_cli.errors import UserError
from opentau_cli.process import lease
from opentau_cli.store.remote_run import RemoteRun
from opentau_cli.store.storage import LocalStorage, open_storage

pytestmark = pytest.mark.quick


def race(n: int, write) -> list:
    """`write(i)` from n threads released at once; their results in thread order."""
    results, barrier = [None] * n, threading.Barrier(n)

    def go(i: int) -> None:
        barrier.wait()
        results[i] = write(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(params=["s3", "directory"])
def store(request, tmp_path):
    if request.param == "s3":
        server = request.getfixturevalue("s3")
        return open_storage(server.url(f"lease/{tmp_path.name}"), {"concurrency": 16})
    return LocalStorage(tmp_path / "store")


def test_twenty_racing_creates_of_one_key_leave_exactly_one_winner_whose_content_is_stored(store):
    results = race(20, lambda i: store.write_new("key", f"writer {i}".encode()))
    winners = [i for i, version in enumerate(results) if version is not None]
    assert len(winners) == 1
    assert store.read_version("key")[:2] == (f"writer {winners[0]}".encode(), results[winners[0]])


def test_twenty_racing_replaces_of_one_version_leave_exactly_one_winner(store):
    first = store.write_new("key", b"first")
    results = race(20, lambda i: store.write_if("key", f"writer {i}".encode(), first))
    winners = [i for i, version in enumerate(results) if version is not None]
    assert len(winners) == 1
    assert store.read_version("key")[0] == f"writer {winners[0]}".encode()


def test_a_replace_of_a_stale_or_missing_version_is_refused_and_changes_nothing(store):
    old = store.write_new("key", b"one")
    new = store.write_if("key", b"two", old)
    assert new is not None and new != old
    assert store.write_if("key", b"three", old) is None
    assert store.write_if("absent", b"three", new) is None
    assert store.read_version("key")[0] == b"two" and store.read_version("absent") is None
    assert store.write_new("key", b"four") is None


def test_the_s3_servers_conditional_puts_answer_412_to_a_stale_etag(s3, tmp_path):
    """What the lease relies on, asked of the server without opentau: If-None-Match: * and If-Match: <ETag>."""
    import boto3
    import botocore.exceptions

    client = boto3.client("s3")
    key = f"raw/{tmp_path.name}"
    first = client.put_object(Bucket=s3.bucket, Key=key, Body=b"a", IfNoneMatch="*")["ETag"]
    statuses = []
    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": '"0123456789abcdef0123456789abcdef"'}):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            client.put_object(Bucket=s3.bucket, Key=key, Body=b"b", **condition)
        statuses.append(refused.value.response["ResponseMetadata"]["HTTPStatusCode"])
    assert statuses == [412, 412]
    assert client.put_object(Bucket=s3.bucket, Key=key, Body=b"c", IfMatch=first)["ETag"] != first
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"c"


def me(name: str, seconds: float = 60) -> dict:
    return {**lease.identity(f"/runs/{name}", seconds), "host": f"host-{name}"}  # another host: judged by its age


def test_a_second_writer_is_refused_naming_the_holder_and_its_last_heartbeat(store):
    held = lease.acquire(store, me("a"))
    with pytest.raises(UserError) as refused:
        lease.acquire(store, me("b"))
    said = str(refused.value)
    assert "/runs/a" in said and held.record["launch"] in said and "host-a" in said
    assert held.record["heartbeat"] in said and "--break-lock" in said and said.count(".") >= 1
    assert json.loads(store.read_version(lease.LEASE)[0])["run_dir"] == "/runs/a"


def test_a_writer_whose_lease_was_broken_is_fenced_and_the_generation_goes_up(store):
    a = lease.acquire(store, me("a"))
    a.check()  # renewed while it holds it
    b = lease.acquire(store, me("b"), break_lock=True)
    assert (a.record["generation"], b.record["generation"]) == (1, 2)
    remote = RemoteRun(store, fence=a.check)
    with pytest.raises(lease.LeaseLost, match="lost its lease"):
        remote.set_pointer("last", "000040")
    assert "checkpoints/last" not in store.list("")  # nothing written
    with pytest.raises(lease.LeaseLost):
        a.check()  # and from then on, every time
    b.check()


def test_an_expired_lease_is_taken_over_and_a_released_one_at_once(store):
    a = lease.acquire(store, me("a", seconds=2))
    time.sleep(3.2)  # no heartbeat for longer than its seconds (the store's clock, whole seconds)
    b = lease.acquire(store, me("b"), echo=pytest.fail)  # expired: taken at once
    assert b.record["generation"] == 2
    b.release()
    c = lease.acquire(store, me("c"))
    assert c.record["generation"] == 3
    with pytest.raises(lease.LeaseLost):
        a.check()


def test_a_lease_whose_holder_missed_its_heartbeats_is_waited_out_and_taken(store):
    """A requeued job after its node was lost: not refused, it waits until the lease expires, saying so."""
    a = lease.acquire(store, me("a", seconds=12))
    time.sleep(7)  # two of its heartbeats (one per 3 s) missed; 5 s to spare before it expires, on a busy machine
    said = []
    b = lease.acquire(store, me("b"), echo=said.append)
    assert b.record["generation"] == 2 and len(said) == 1 and "missed its heartbeats" in said[0]
    with pytest.raises(lease.LeaseLost):
        a.check()
