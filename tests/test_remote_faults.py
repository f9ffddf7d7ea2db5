"""Remote checkpoints when the store goes away (docs/ARCHITECTURE.md, "Remote checkpoints"): one real launch of the
installed CLI against the test S3 server. The server is stopped while checkpoint 4 uploads (held after its first
file by tests/hooks) and training goes on; started again, the upload resumes and the store's `last` moves only
once a newer checkpoint is complete; stopped again, a SIGTERM makes the run save, wait checkpoint.remote_drain_seconds
for the upload, exit 3 (checkpoints left on this machine only) and name the checkpoints that stay local only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import SINGLE_PROCESS_ENV, opentau_bin
from opentau_cli.process.uploader import read_status
from opentau_cli.store.layout import CHECKPOINTS, METRICS, read_last, step_of
from remote_runs import HOOKS, TINY, losses, wait_for

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]


@pytest.fixture(scope="module")
def outage(tmp_path_factory, s3_server):
    root = tmp_path_factory.mktemp("outage")
    run = root / "run"
    url = s3_server.url("runs/outage")
    env = {**os.environ, **SINGLE_PROCESS_ENV, **s3_server.env, "HOME": str(root / "home"), "HF_HOME": str(root / "hf"),
           "PYTHONPATH": HOOKS, "TEST_UPLOAD_DIR": str(root), "TEST_UPLOAD_HOLD": "#2"}
    env.pop("OPENTAU_DEBUG", None)
    args = ["train", f"--config_path={TINY}", f"--output_dir={run}", "--steps", "400", "--save_freq", "2",
            "--log_freq", "1", "--batch_size", "8", f"--checkpoint.remote={url}", "--checkpoint.remote_drain_seconds=3",
            "--logging.progress_bar=plain"]
    # Files, not pipes: a run of many steps writes more than a pipe holds while nobody reads it.
    out, err = open(root / "stdout", "w"), open(root / "stderr", "w")
    proc = subprocess.Popen([opentau_bin(), *args], cwd=root, env=env, stdout=out, stderr=err, text=True,
                            start_new_session=True)
    facts = {"url": url, "run": run, "root": root}
    try:
        step = lambda: max(losses(run), default=0) if (run / METRICS).exists() else 0  # noqa: E731
        wait_for(lambda: (root / "held").exists(), "the second upload", proc)
        facts["held"] = (root / "held").read_text()
        s3_server.stop()  # the store goes away mid-upload
        facts["stopped_at_step"] = step()
        (root / "release").touch()
        # A request retries for UPLOAD_RETRY_SECONDS, then the upload thread says so and retries with backoff.
        wait_for(lambda: (read_status(run) or {}).get("error"), "the upload to report the store away", proc)
        wait_for(lambda: step() >= facts["stopped_at_step"] + 6, "training to go on without the store", proc)
        facts["status_while_away"] = read_status(run)
        facts["local_last_while_away"] = read_last(run / CHECKPOINTS)
        restarted = time.time()
        s3_server.start()
        facts["restarted"] = restarted
        wait_for(lambda: step_of((read_status(run) or {}).get("remote_last") or "0") > step_of(facts["held"]),
                 "uploads to resume", proc)
        s3_server.stop()  # away again: what is saved from now on stays local
        remote_last = read_status(run)["remote_last"]
        facts["remote_last_before_sigterm"] = remote_last
        wait_for(lambda: step_of(read_last(run / CHECKPOINTS)) > step_of(remote_last), "a save the store cannot take", proc)
        os.kill(proc.pid, signal.SIGTERM)  # a preemption notice, to the opentau process
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close(), err.close()
        if s3_server.proc is None or s3_server.proc.poll() is not None:
            s3_server.start()
    facts["result"] = subprocess.CompletedProcess(proc.args, proc.returncode, (root / "stdout").read_text(),
                                                  (root / "stderr").read_text())
    facts["commits"] = [json.loads(line) for line in (root / "commits.jsonl").read_text().splitlines()]
    return facts


def test_training_goes_on_while_the_store_is_away_and_says_so(outage):
    status = outage["status_while_away"]
    first = outage["commits"][0]["name"]  # the one checkpoint committed before the store went away
    assert status["error"] and status["remote_last"] == first  # last stays on the complete checkpoint
    assert status["uploading"]["name"] == outage["held"]
    assert step_of(outage["local_last_while_away"]) >= 6
    assert "upload retrying" in outage["result"].stdout


def test_uploads_resume_and_the_store_s_last_moves_only_to_complete_checkpoints(outage, s3):
    from opentau_cli.store.remote_run import RemoteRun
    from opentau_cli.store.storage import open_storage

    commits = outage["commits"]
    assert commits[0]["t"] < outage["restarted"] and step_of(commits[0]["name"]) < step_of(outage["held"])
    later = [c for c in commits[1:]]
    assert later and all(c["t"] > outage["restarted"] for c in later)  # nothing committed while the store was away
    assert [step_of(c["name"]) for c in commits] == sorted(step_of(c["name"]) for c in commits)
    remote = RemoteRun(open_storage(outage["url"]))
    assert remote.last() == outage["remote_last_before_sigterm"] == commits[-1]["name"]
    for name in remote.committed():  # every committed checkpoint is whole: its files are the local ones
        manifest = remote.manifest(name)
        assert all(remote.storage.size(f"{CHECKPOINTS}/{name}/{rel}") == e["size"] for rel, e in manifest["files"].items())


def test_a_preemption_notice_saves_waits_for_the_uploads_and_names_what_stays_local_only(outage):
    result = outage["result"]
    assert result.returncode == 3, result.stderr[-3000:]  # saved, but not all in the store: a job script can tell
    local_last = read_last(outage["run"] / CHECKPOINTS)
    assert step_of(local_last) > step_of(outage["remote_last_before_sigterm"])
    assert f"Preempted: saved step {step_of(local_last)}" in result.stdout
    line = next(line for line in result.stderr.splitlines() if "local only" in line)
    assert local_last in line and outage["url"] in line and "after waiting 3 s" in line
    assert f"continues from {outage['remote_last_before_sigterm']}" in line
