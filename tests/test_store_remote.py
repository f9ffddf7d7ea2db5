"""The storage seam's remote side (store/remote.py) against a real S3 server (SeaweedFS, tests/s3_server.py) and a
real directory behind a file:// URL. What the store holds is checked with a plain boto3 client or by reading the
directory, never through the code under test; checksums are compared with the values the server itself computed and
checked (it refuses an upload whose checksum does not match the bytes)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from conftest import REPO, s3_environment
from s3_server import ACCESS_KEY, SECRET_KEY, S3Server

from opentau_cli.errors import UserError
from opentau_cli.store.remote import RemoteError, open_remote, preflight

pytestmark = pytest.mark.full

MB = 1 << 20


def plain_client(server: S3Server):
    """An independent S3 client (no opentau code) for what the store holds."""
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name="us-east-1", config=Config(retries={"max_attempts": 1}))


def random_file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def test_every_operation_on_s3_leaves_in_the_store_exactly_what_a_plain_client_reads(s3, tmp_path):
    run = f"ops-{os.getpid()}/run"
    remote = open_remote(s3.url(run), {"part_mb": 5})  # 5 MiB parts: the 12 MB file goes in three
    plain = plain_client(s3)
    small, large = random_file(tmp_path / "small.json", 1234), random_file(tmp_path / "large.bin", 12 * MB + 7)

    sent_small = remote.put_file(small, "checkpoints/000010/training_state.json")
    sent_large = remote.put_file(large, "checkpoints/000010/model.safetensors")
    remote.write_bytes("checkpoints/last", b"000010\n")

    def stored(key):
        return plain.get_object(Bucket=s3.bucket, Key=f"{run}/{key}")["Body"].read()

    assert stored("checkpoints/000010/training_state.json") == small.read_bytes()
    assert stored("checkpoints/000010/model.safetensors") == large.read_bytes()
    assert stored("checkpoints/last") == b"000010\n"
    head = plain.head_object(Bucket=s3.bucket, Key=f"{run}/checkpoints/000010/model.safetensors", ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-3")  # it went as a multipart upload
    # The server computed the full-object CRC64NVME of what it received and checked it against the one sent.
    assert head["ChecksumType"] == "FULL_OBJECT" and sent_large == f"crc64nvme:{head['ChecksumCRC64NVME']}"
    assert remote.checksum("checkpoints/000010/model.safetensors") == sent_large
    assert remote.checksum("checkpoints/000010/training_state.json") == sent_small != sent_large
    assert remote.checksum("checkpoints/000099/missing") is None

    assert remote.list() == ["checkpoints/000010/model.safetensors", "checkpoints/000010/training_state.json",
                             "checkpoints/last"]
    assert remote.list("checkpoints/000010") == remote.list("checkpoints/000010/") == remote.list()[:2]
    assert remote.list("checkpoints/00001") == []  # a folder, not a name prefix
    assert remote.sizes("checkpoints") == {"checkpoints/000010/model.safetensors": 12 * MB + 7,
                                          "checkpoints/000010/training_state.json": 1234, "checkpoints/last": 7}
    assert remote.size("checkpoints/000010/model.safetensors") == 12 * MB + 7
    assert remote.size("checkpoints/000020/model.safetensors") is None and not remote.exists("checkpoints/000020")
    assert remote.read_bytes("checkpoints/last") == b"000010\n"

    remote.get_file("checkpoints/000010/model.safetensors", tmp_path / "back" / "model.safetensors")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == large.read_bytes()
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["model.safetensors"]  # no temp file left
    with pytest.raises(FileNotFoundError):
        remote.get_file("checkpoints/000020/model.safetensors", tmp_path / "back" / "missing")
    with pytest.raises(FileNotFoundError):
        remote.read_bytes("checkpoints/000020/last")

    remote.copy("checkpoints/000010/model.safetensors", "rolled_back/x/model.safetensors")
    assert stored("rolled_back/x/model.safetensors") == large.read_bytes()
    assert remote.checksum("rolled_back/x/model.safetensors") == sent_large

    remote.delete(["checkpoints/000010/model.safetensors", "checkpoints/000099/never-there"])
    listed = plain.list_objects_v2(Bucket=s3.bucket, Prefix=f"{run}/")["Contents"]
    assert sorted(o["Key"][len(run) + 1:] for o in listed) == [
        "checkpoints/000010/training_state.json", "checkpoints/last", "rolled_back/x/model.safetensors"]

    # A checkpoint's files at once: the same objects, checksums and downloads as one by one.
    many = {f"checkpoints/000020/{name}": random_file(tmp_path / "many" / name, size)
            for name, size in (("model.safetensors", 11 * MB), ("optimizer.bin", 6 * MB + 1), ("rng.pkl", 99))}
    sent = remote.put_files([(local, key) for key, local in many.items()])
    for key, local in many.items():
        head = plain.head_object(Bucket=s3.bucket, Key=f"{run}/{key}", ChecksumMode="ENABLED")
        assert stored(key) == local.read_bytes() and sent[key] == f"crc64nvme:{head['ChecksumCRC64NVME']}"
    remote.get_files([(key, tmp_path / "many_back" / key) for key in many])
    assert all((tmp_path / "many_back" / key).read_bytes() == local.read_bytes() for key, local in many.items())


def test_a_process_ends_without_sending_the_rest_of_a_cancelled_upload_and_sends_it_all_when_not_cancelled(s3, tmp_path):
    """The client's transfer threads are ones Python waits for at exit: a run that gave up on an upload (its drain
    time spent) would otherwise go on sending the whole queued checkpoint before the process could end."""
    files = [random_file(tmp_path / f"f{i:02d}.bin", 6 * MB) for i in range(16)]
    script = """if True:
        import sys, threading, time
        from pathlib import Path
        from opentau_cli.store.remote import open_remote
        url, cancel, files = sys.argv[1], sys.argv[2] == "cancel", sys.argv[3:]
        remote = open_remote(url, {"part_mb": 5, "concurrency": 1})
        threading.Thread(target=remote.put_files, args=([(Path(f), Path(f).name) for f in files],), daemon=True).start()
        while not remote.list(""):  # the first file is stored: the rest are queued or under way
            time.sleep(0.005)
        if cancel:
            remote.cancel()
    """
    stored = {}
    for how in ("cancel", "keep"):
        url = s3.url(f"cancel-{os.getpid()}/{how}")
        done = subprocess.run([sys.executable, "-c", script, url, how, *map(str, files)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        listing = plain_client(s3).list_objects_v2(Bucket=s3.bucket, Prefix=f"cancel-{os.getpid()}/{how}/")
        stored[how] = len(listing.get("Contents", []))
    assert stored["keep"] == len(files)  # without cancel, the exit waited for every queued file
    assert 1 <= stored["cancel"] < len(files) // 2


def test_a_checksum_of_an_object_written_without_one_is_computed_from_the_store_s_bytes(s3, tmp_path):
    """Another tool's upload carries no checksum: the store's bytes are read back and hashed the same way, and the
    value equals what the server computes for the same bytes."""
    plain = plain_client(s3)
    data = os.urandom(3 * MB)
    base = f"foreign-{os.getpid()}"
    bare = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name="us-east-1", config=Config(request_checksum_calculation="when_required"))
    bare.put_object(Bucket=s3.bucket, Key=f"{base}/bare.bin", Body=data)
    assert "ChecksumCRC64NVME" not in plain.head_object(Bucket=s3.bucket, Key=f"{base}/bare.bin", ChecksumMode="ENABLED")
    plain.put_object(Bucket=s3.bucket, Key=f"{base}/with.bin", Body=data, ChecksumAlgorithm="CRC64NVME")
    by_server = plain.head_object(Bucket=s3.bucket, Key=f"{base}/with.bin", ChecksumMode="ENABLED")["ChecksumCRC64NVME"]

    assert open_remote(s3.url(base)).checksum("bare.bin") == f"crc64nvme:{by_server}"


def test_a_file_url_is_a_directory_written_atomically(tmp_path):
    root = tmp_path / "share" / "run"
    remote = open_remote(root.as_uri())
    large = random_file(tmp_path / "large.bin", 3 * MB)
    sent = remote.put_file(large, "checkpoints/000010/model.safetensors")
    remote.write_bytes("checkpoints/last", b"000010\n")

    assert (root / "checkpoints/000010/model.safetensors").read_bytes() == large.read_bytes()
    assert (root / "checkpoints/last").read_bytes() == b"000010\n"
    import xxhash

    assert sent == remote.checksum("checkpoints/000010/model.safetensors") == \
        f"xxh3_128:{xxhash.xxh3_128(large.read_bytes()).hexdigest()}"
    assert remote.list() == ["checkpoints/000010/model.safetensors", "checkpoints/last"]
    assert remote.sizes("checkpoints/000010") == {"checkpoints/000010/model.safetensors": 3 * MB}
    remote.copy("checkpoints/000010/model.safetensors", "rolled_back/model.safetensors")
    remote.delete(["checkpoints/last", "checkpoints/missing"])
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "checkpoints/000010/model.safetensors", "rolled_back/model.safetensors"]  # no temp files either
    assert remote.size("checkpoints/last") is None and remote.checksum("checkpoints/last") is None
    assert preflight(root.as_uri()) is None



def test_another_fsspec_url_is_served_by_its_own_backend(tmp_path):
    """memory:// (fsspec's in-memory filesystem) stands for the backends users install (gs://, az://, ...)."""
    import fsspec

    remote = open_remote(f"memory://opentau-{os.getpid()}/run")
    large = random_file(tmp_path / "large.bin", 2 * MB)
    sent = remote.put_file(large, "checkpoints/000010/model.safetensors")
    remote.write_bytes("checkpoints/last", b"000010\n")
    memory = fsspec.filesystem("memory")
    assert memory.cat_file(f"/opentau-{os.getpid()}/run/checkpoints/000010/model.safetensors") == large.read_bytes()
    assert remote.checksum("checkpoints/000010/model.safetensors") == sent
    assert remote.list() == ["checkpoints/000010/model.safetensors", "checkpoints/last"]
    remote.get_file("checkpoints/000010/model.safetensors", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == large.read_bytes()
    remote.delete(["checkpoints/last", "checkpoints/none"])
    assert remote.list("checkpoints") == ["checkpoints/000010/model.safetensors"]
    assert remote.size("checkpoints/last") is None

def test_an_upload_and_a_download_go_on_through_the_store_killed_and_started_again(tmp_path, monkeypatch):
    """The store dies (SIGKILL) while a multipart upload is under way and comes back 2 s later: the same put_file
    call finishes, and the store holds the file's bytes; likewise a download. Leftover multipart uploads of the
    interrupted attempts are then removed by abort_uploads."""
    server = S3Server(tmp_path / "store").start()
    try:
        s3_environment(monkeypatch, server)
        plain = plain_client(server)
        remote = open_remote(server.url("faults"), {"part_mb": 5, "concurrency": 1})
        big = random_file(tmp_path / "optimizer.bin", 60 * MB)

        def interrupt_while(work, busy) -> dict:
            outcome = {}

            def go():
                try:
                    outcome["value"] = work()
                except BaseException as e:  # noqa: BLE001 (reported below)
                    outcome["error"] = e
            thread = threading.Thread(target=go)
            thread.start()
            deadline = time.monotonic() + 60
            while not busy() and time.monotonic() < deadline:
                time.sleep(0.02)
            server.kill()
            outcome["interrupted"] = thread.is_alive()  # the call had not returned when the store died
            time.sleep(2)
            server.start()
            thread.join(180)
            return outcome

        def part_stored():
            uploads = plain.list_multipart_uploads(Bucket=server.bucket).get("Uploads", [])
            return any(plain.list_parts(Bucket=server.bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
                       for u in uploads)

        up = interrupt_while(lambda: remote.put_file(big, "ckpt/optimizer.bin"), part_stored)
        assert up["interrupted"] and "error" not in up, up
        stored = plain.get_object(Bucket=server.bucket, Key="faults/ckpt/optimizer.bin")["Body"].read()
        assert stored == big.read_bytes()
        assert up["value"] == remote.checksum("ckpt/optimizer.bin")

        local = tmp_path / "down" / "optimizer.bin"
        local.parent.mkdir()
        down = interrupt_while(lambda: remote.get_file("ckpt/optimizer.bin", local),
                               lambda: any(p.stat().st_size > 0 for p in local.parent.iterdir()))
        assert down["interrupted"] and "error" not in down, down
        assert local.read_bytes() == big.read_bytes()

        remote.abort_uploads()
        assert plain.list_multipart_uploads(Bucket=server.bucket).get("Uploads", []) == []
    finally:
        server.stop()


def test_an_operation_fails_with_one_sentence_once_its_retry_time_is_spent(tmp_path, monkeypatch):
    server = S3Server(tmp_path / "store").start()
    try:
        s3_environment(monkeypatch, server)
        remote = open_remote(server.url("gone"), {"retry_seconds": 3})
        server.kill()
        with pytest.raises(RemoteError) as caught:
            remote.write_bytes("checkpoints/last", b"000010\n")
        assert str(caught.value).startswith("Write of s3://opentau-test/gone/checkpoints/last failed: ")
        assert "\n" not in str(caught.value) and caught.value.__cause__ is None
    finally:
        server.stop()


def test_preflight_says_in_one_sentence_what_is_wrong(s3, monkeypatch):
    def one_sentence(text):
        assert text and "\n" not in text and text.endswith("."), text
        return text

    assert preflight(s3.url("fine/run")) is None
    assert "unknown scheme nosuch://" in one_sentence(preflight("nosuch://bucket/run"))
    assert "names no bucket" in one_sentence(preflight("s3:///run"))
    assert "The bucket 'no-such-bucket' does not exist" in one_sentence(preflight("s3://no-such-bucket/run"))
    unreachable = one_sentence(preflight(s3.url("run"), {"endpoint_url": "http://127.0.0.1:9"}))
    assert "cannot be reached" in unreachable and "AWS_ENDPOINT_URL" in unreachable
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    wrong = one_sentence(preflight(s3.url("run")))
    assert "refused the credentials" in wrong and "SignatureDoesNotMatch" in wrong
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key-id")
    assert "InvalidAccessKeyId" in one_sentence(preflight(s3.url("run")))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert "No credentials for" in one_sentence(preflight(s3.url("run")))


@pytest.mark.parametrize("name", ["key", "secret", "token", "aws_access_key_id", "aws_secret_access_key",
                                  "aws_session_token", "password", "account_key", "client_kwargs_credentials"])
def test_credentials_in_the_options_are_refused_without_repeating_them(name, tmp_path):
    for url in ("s3://bucket/run", (tmp_path / "run").as_uri()):
        for options in ({name: "hunter2-value"}, {"client_kwargs": {"config": {name: "hunter2-value"}}}):
            with pytest.raises(UserError) as caught:
                open_remote(url, options)
            message = str(caught.value)
            assert f"({name!r})" in message and "hunter2" not in message and "\n" not in message
    assert "hunter2" not in preflight("s3://bucket/run", {name: "hunter2-value"})
    assert not (tmp_path / "run").exists()


def test_no_message_or_repr_ever_holds_the_credentials(s3, monkeypatch, tmp_path):
    """Every failure a wrong secret causes, and the objects themselves, shown whole (chained causes included)."""
    secret, key_id = "wrong-secret-0123456789abcdef", "AKIAWRONGKEYID12345"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    texts = []
    for key_id_now in (ACCESS_KEY, key_id):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id_now)
        remote = open_remote(s3.url("secret-check"), {"retry_seconds": 1})
        texts += [repr(remote), str(remote.__dict__), preflight(s3.url("secret-check"))]
        for call in (lambda: remote.read_bytes("a"), lambda: remote.write_bytes("a", b"x"), lambda: remote.list(),
                     lambda: remote.put_file(random_file(tmp_path / "f", 10), "f"), lambda: remote.size("a"),
                     lambda: remote.get_file("a", tmp_path / "g"), lambda: remote.delete(["a"])):
            with pytest.raises(RemoteError) as caught:
                call()
            texts += [str(caught.value), repr(caught.value), "".join(traceback.format_exception(caught.value))]
    whole = "\n".join(texts)
    assert "refused the credentials" in whole and "InvalidAccessKeyId" in whole
    for credential in (secret, key_id, SECRET_KEY, ACCESS_KEY):
        assert credential not in whole


def test_the_client_benchmark_smoke_run_compares_the_clients_and_opentau_s_own(s3_server, tmp_path):
    results = tmp_path / "results.md"
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_remote_clients.py"), "--smoke",
                          "--clients", "boto3,opentau", "--results", str(results), "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = results.read_text()
    for row in ("checkpoint upload: boto3", "checkpoint upload: opentau", "big file download: opentau",
                "checkpoint upload: opentau / boto3", "big file download: opentau / boto3"):
        assert f"| {row} |" in text and "x the fastest" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.md"]  # files and servers removed
