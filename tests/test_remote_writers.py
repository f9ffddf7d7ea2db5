"""One writer per store prefix (docs/ARCHITECTURE.md, "Remote checkpoints"): real launches of the installed CLI
against the real S3 server (SeaweedFS) that try to write one prefix twice. In each case, every checkpoint any command
called stored is still in the store with its manifest's content (in `checkpoints/`, or in `rolled_back/` after an
explicit rollback), or was never called stored.

One sequence on one prefix: two fresh runs launched together (one is refused naming the holder); machine B rolls
the store back to 2 and goes on; the old machine A then resumes its own directory (refused: its 4 is not the store's);
two resumes of the store at once (one refused). On a second prefix a writer is SIGSTOPped past its lease's expiry,
another takes over, and the first, continued, changes nothing. On a server of its own, the store goes away at the end
of a run (exit 3, naming what is local only), then `opentau checkpoint push` uploads it once the store is back.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import SINGLE_PROCESS_ENV, opentau_bin, refused
from opentau_cli.store.layout import CHECKPOINTS, MANIFEST, read_last
from opentau_cli.store.remote_run import RemoteRun
from opentau_cli.store.storage import open_storage
from remote_runs import HOOKS, TINY, losses, ok, wait_for

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

COMMON = ["--save_freq", "2", "--log_freq", "1", "--batch_size", "8", "--scheduler.warmup_steps", "2",
          "--logging.progress_bar=plain"]
STORED = re.compile(r"Checkpoint (\d{6}) is stored in (\S+)\.")


class Launch:
    """One command of the installed CLI in a directory of its own (its output in files: a pipe nobody reads fills)."""

    def __init__(self, root: Path, server, args: list[str], **env):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        full = {**os.environ, **SINGLE_PROCESS_ENV, **server.env, "HOME": str(root / "home"),
                "HF_HOME": str(root / "hf"), "PYTHONPATH": HOOKS, "TEST_UPLOAD_DIR": str(root), **env}
        full.pop("OPENTAU_DEBUG", None)
        self.out, self.err = open(root / "stdout", "w"), open(root / "stderr", "w")
        self.proc = subprocess.Popen([opentau_bin(), *args], cwd=root, env=full, stdout=self.out, stderr=self.err,
                                     text=True, start_new_session=True)

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.out.close(), self.err.close()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, (self.root / "stdout").read_text(),
                                           (self.root / "stderr").read_text())


def remote_of(server, url: str) -> RemoteRun:
    saved = {name: os.environ.get(name) for name in server.env}
    os.environ.update(server.env)
    try:
        return RemoteRun(open_storage(url))
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def called_stored(result, run_dir: Path) -> list[tuple[str, dict]]:
    """(name, the run directory's manifest of it) for each checkpoint the command said is stored."""
    names = sorted({m.group(1) for m in STORED.finditer(result.stdout + result.stderr)})
    return [(name, json.loads((run_dir / CHECKPOINTS / name / MANIFEST).read_text())) for name in names]


def assert_still_stored(remote: RemoteRun, claims: list[tuple[str, dict]]) -> None:
    """Every checkpoint called stored is in the store with that manifest: committed, or set aside by a rollback."""
    for name, manifest in claims:
        places = [f"{CHECKPOINTS}/{name}/{MANIFEST}"] + [k for k in remote.storage.list("rolled_back")
                                                         if k.endswith(f"/{CHECKPOINTS}/{name}/{MANIFEST}")]
        found = []
        for key in places:
            try:
                found.append(json.loads(remote.storage.read_bytes(key)))
            except FileNotFoundError:
                continue
        assert manifest in found, (name, places)
        for rel, entry in manifest["files"].items():  # and its files, at their sizes
            key = places[[json.dumps(f, sort_keys=True) for f in found].index(json.dumps(manifest, sort_keys=True))]
            assert remote.storage.size(key.removesuffix(MANIFEST) + rel) == entry["size"], (name, rel)


@pytest.fixture(scope="module")
def one_prefix(tmp_path_factory, s3_server):
    """The sequence on one prefix (see the module doc): results by name, and every claim of a stored checkpoint."""
    tmp = tmp_path_factory.mktemp("writers")
    url = s3_server.url("runs/writers")
    facts = {"url": url, "claims": []}
    # Two fresh runs of the same job script, launched together.
    pair = [Launch(tmp / name, s3_server, ["train", f"--config_path={TINY}", f"--output_dir={tmp / name / 'run'}",
                                           "--steps", "4", *COMMON, f"--checkpoint.remote={url}"],
                   TEST_UPLOAD_PACE="000002") for name in ("first", "second")]
    results = [launch.wait() for launch in pair]
    winner = next(i for i, r in enumerate(results) if r.returncode == 0)
    facts["fresh"] = results
    facts["a"] = a = tmp / ("first", "second")[winner] / "run"
    facts["loser_dir"] = tmp / ("first", "second")[1 - winner] / "run"
    facts["claims"] += [(a, c) for c in called_stored(results[winner], a)]
    facts["after_fresh"] = remote_of(s3_server, url).committed()
    # Machine B rolls the store back to 2 and goes on to 4.
    b = tmp / "b" / "run"
    facts["rollback"] = Launch(tmp / "b", s3_server,
                               ["resume", f"{url}:2", "--rollback=true", f"--output_dir={b}"]).wait()
    ok(facts["rollback"])
    facts["b"] = b
    facts["claims"] += [(b, c) for c in called_stored(facts["rollback"], b)]
    # The old machine A resumes its own directory, whose 4 is not the store's any more.
    facts["stale"] = Launch(tmp / "stale", s3_server, ["resume", str(a), "--steps", "6"]).wait()
    # Two resumes of the store at once (a requeued job started while the old one still runs).
    both = [Launch(tmp / name, s3_server, ["resume", url, f"--output_dir={tmp / name / 'run'}", "--steps", "6"])
            for name in ("c", "d")]
    facts["resumes"] = [launch.wait() for launch in both]
    for name, result in zip(("c", "d"), facts["resumes"]):
        if result.returncode == 0:
            facts["claims"] += [(tmp / name / "run", c) for c in called_stored(result, tmp / name / "run")]
    return facts


def test_two_fresh_runs_on_one_prefix_one_is_refused_naming_the_holder(one_prefix):
    codes = sorted(r.returncode for r in one_prefix["fresh"])
    assert codes == [0, 2], [r.stderr[-2000:] for r in one_prefix["fresh"]]
    loser = next(r for r in one_prefix["fresh"] if r.returncode == 2)
    refused(loser, one_prefix["url"], "is being written by", str(one_prefix["a"]), "last heartbeat")
    assert not one_prefix["loser_dir"].exists()  # nothing written
    assert one_prefix["after_fresh"] == ["000002", "000004"]


def test_the_old_machine_resuming_after_a_rollback_elsewhere_is_refused_and_overwrites_nothing(one_prefix, s3_server):
    refused(one_prefix["stale"], "holds another checkpoint 000004", f"opentau resume {one_prefix['url']}")
    remote = remote_of(s3_server, one_prefix["url"])
    b4 = json.loads((one_prefix["b"] / CHECKPOINTS / "000004" / MANIFEST).read_text())
    a4 = json.loads((one_prefix["a"] / CHECKPOINTS / "000004" / MANIFEST).read_text())
    assert a4 != b4
    assert_still_stored(remote, [("000004", a4)])  # A's 4 set aside by B's explicit rollback, whole
    assert read_last(one_prefix["a"] / CHECKPOINTS) == "000004"
    assert not (one_prefix["a"] / CHECKPOINTS / "000006").exists()


def test_two_resumes_of_the_store_at_once_one_is_refused(one_prefix, s3_server):
    codes = sorted(r.returncode for r in one_prefix["resumes"])
    assert codes == [0, 2], [r.stderr[-2000:] for r in one_prefix["resumes"]]
    loser = next(r for r in one_prefix["resumes"] if r.returncode == 2)
    # Refused at the plan, or by the launch's atomic step if both passed it at once (after its download then).
    last = loser.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "Traceback" not in loser.stderr
    assert one_prefix["url"] in last and "is being written by" in last and "last heartbeat" in last
    remote = remote_of(s3_server, one_prefix["url"])
    assert remote.last() == "000006"


def test_every_checkpoint_called_stored_on_the_shared_prefix_is_still_there(one_prefix, s3_server):
    remote = remote_of(s3_server, one_prefix["url"])
    claims = [claim for _, claim in one_prefix["claims"]]
    assert {name for name, _ in claims} >= {"000004", "000006"}
    assert_still_stored(remote, claims)


@pytest.fixture(scope="module")
def paused(tmp_path_factory, s3_server):
    """Writer A holds the upload of its 4 (tests/hooks) and is SIGSTOPped past its lease's expiry (3 s); B
    resumes the store (taking the expired lease) and runs to 6; then A is continued and let go."""
    tmp = tmp_path_factory.mktemp("paused")
    url = s3_server.url("runs/paused")
    lease = "--checkpoint.remote_lease_seconds=3"
    a = Launch(tmp / "a", s3_server, ["train", f"--config_path={TINY}", f"--output_dir={tmp / 'a' / 'run'}", "--steps",
                                      "6", *COMMON, f"--checkpoint.remote={url}", lease,
                                      "--checkpoint.remote_drain_seconds=5"],
               TEST_UPLOAD_HOLD="#2", TEST_UPLOAD_PACE="000002")
    wait_for((tmp / "a" / "held").exists, "its upload of 000002 to be held", a.proc, 300)
    os.killpg(a.proc.pid, signal.SIGSTOP)
    time.sleep(5)  # past its lease's 3 s without a heartbeat
    # B's save of 6 waits until its 4 is committed: a fast run could otherwise publish 6 before the uploader takes up 4,
    # which then (rightly, newest next) stays local only
    b = Launch(tmp / "b", s3_server, ["resume", url, f"--output_dir={tmp / 'b' / 'run'}", "--steps", "6", lease],
               TEST_UPLOAD_PACE="000004").wait()
    os.killpg(a.proc.pid, signal.SIGCONT)
    (tmp / "a" / "release").touch()
    return {"url": url, "a": a.wait(), "b": b, "a_dir": tmp / "a" / "run", "b_dir": tmp / "b" / "run"}


def test_a_writer_paused_past_its_lease_is_fenced_once_continued_and_says_so(paused, s3_server):
    ok(paused["b"])
    a = paused["a"]
    assert a.returncode == 3, a.stderr[-3000:]
    assert "lost its lease" in a.stderr and paused["url"] in a.stderr
    said = f"Checkpoints 000004, 000006 are local only (this launch may not write to {paused['url']} any more)"
    assert said in a.stderr
    assert "Traceback" not in a.stderr + a.stdout
    remote = remote_of(s3_server, paused["url"])
    b6 = json.loads((paused["b_dir"] / CHECKPOINTS / "000006" / MANIFEST).read_text())
    assert remote.last() == "000006" and remote.manifest("000006") == b6
    assert remote.manifest("000004") == json.loads((paused["b_dir"] / CHECKPOINTS / "000004" / MANIFEST).read_text())
    claims = called_stored(paused["b"], paused["b_dir"]) + called_stored(a, paused["a_dir"])
    assert [name for name, _ in called_stored(a, paused["a_dir"])] == ["000002"]
    assert_still_stored(remote, claims)
    assert sorted(losses(paused["a_dir"])) == [1, 2, 3, 4, 5, 6]  # training went on; only the store was closed to it


@pytest.fixture(scope="module")
def store_gone(tmp_path_factory):
    """A run whose store goes away while its second checkpoint uploads and stays away to the end; then the store
    comes back, `opentau resume RUN` (nothing left to train) uploads what is local only, and `opentau checkpoint push
    RUN` finds nothing more to upload (its uploads: tests/test_uploader.py)."""
    from s3_server import S3Server

    tmp = tmp_path_factory.mktemp("gone")
    server = S3Server(tmp / "s3").start()
    try:
        url = server.url("runs/gone")
        run = tmp / "a" / "run"
        a = Launch(tmp / "a", server, ["train", f"--config_path={TINY}", f"--output_dir={run}", "--steps", "6",
                                       *COMMON, f"--checkpoint.remote={url}", "--checkpoint.remote_drain_seconds=4"],
                   TEST_UPLOAD_HOLD="#2", TEST_UPLOAD_PACE="000002")
        wait_for((tmp / "a" / "held").exists, "its upload of 000002 to be held", a.proc, 300)
        server.kill()  # mid-upload, as a crashed store
        (tmp / "a" / "release").touch()
        ended = a.wait()
        server.start()
        pushed = Launch(tmp / "push", server, ["resume", str(run)]).wait()  # nothing left to train: uploads the rest
        again = Launch(tmp / "again", server, ["checkpoint", "push", str(run)]).wait()
        remote = remote_of(server, url)
        return {"url": url, "run": run, "ended": ended, "pushed": pushed, "again": again,
                "committed": remote.committed(), "last": remote.last(),
                "manifests": {n: remote.manifest(n) for n in remote.committed()}}
    finally:
        server.stop()


def test_a_run_that_ends_with_checkpoints_local_only_exits_3_naming_them(store_gone):
    ended = store_gone["ended"]
    assert ended.returncode == 3, ended.stderr[-3000:]
    line = next(line for line in ended.stderr.splitlines() if "local only" in line)
    assert "Checkpoints 000004, 000006 are local only" in line
    assert f"opentau checkpoint push {store_gone['run']}" in line
    assert f"Waiting up to 4 s for checkpoint 000006 to be stored in {store_gone['url']}" in ended.stderr
    assert "Traceback" not in ended.stderr + ended.stdout and "CancelledError" not in ended.stderr + ended.stdout


def test_a_resume_with_nothing_to_train_uploads_what_is_local_only_once_the_store_is_back(store_gone):
    ok(store_gone["pushed"])
    run = store_gone["run"]
    assert store_gone["committed"] == ["000002", "000004", "000006"] and store_gone["last"] == "000006"
    for name in ("000002", "000004", "000006"):
        assert store_gone["manifests"][name] == json.loads((run / CHECKPOINTS / name / MANIFEST).read_text())
    assert "Checkpoint 000006 is stored in" in store_gone["pushed"].stderr
    assert "Nothing to do" in store_gone["pushed"].stderr
    ok(store_gone["again"])
    said = f"Every checkpoint of {run} is in {store_gone['url']} already (newest: 000006)."
    assert said in store_gone["again"].stderr
    claims = called_stored(store_gone["ended"], run) + called_stored(store_gone["pushed"], run)
    assert {name for name, _ in claims} == {"000002", "000004", "000006"}
    assert all(store_gone["manifests"][name] == manifest for name, manifest in claims)
