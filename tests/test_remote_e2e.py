"""Checkpoints that outlive the machine (docs/ARCHITECTURE.md, "Remote checkpoints"), end to end against a real
S3-compatible server (SeaweedFS): real launches of the installed CLI upload every checkpoint in the background, a run
killed mid-upload leaves only committed checkpoints trusted, and `opentau resume URL` on an empty disk (another HOME,
working directory and cache) continues with losses == the uninterrupted run's, under every backend (the sharded ones in tests/test_remote_backends.py).

Each backend trains 4 steps saving at 2 and 4 (run A: the uninterrupted reference); a second launch on an empty
disk resumes the remote's step 2 and logs steps 3 and 4 again. The single-process run A is SIGKILLed while its
launcher holds the upload of checkpoint 4 after its first file (tests/hooks), so its resume takes the last
committed checkpoint (2) by itself; the others roll the remote back to 2 (`URL:2 --rollback=true`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import EXAMPLES, opentau_bin, own_cache, refused, run_cli_in_process
from opentau_cli.store.layout import CHECKPOINTS, MANIFEST
from remote_runs import TINY, backend_runs, ok

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

@pytest.fixture(scope="module")
def backends(tmp_path_factory, s3_server):
    return backend_runs(tmp_path_factory, s3_server)


def test_a_run_killed_mid_upload_leaves_only_committed_checkpoints_trusted(backends):
    single = backends("single")
    assert single.a_result.returncode == -signal.SIGKILL
    assert single.committed_after_a == ["000002"] and single.partial_after_a == ["000004"]
    assert (single.run_a / CHECKPOINTS / "000004" / MANIFEST).is_file()  # published locally, never committed remotely


def test_resume_from_the_store_on_an_empty_disk_takes_the_last_committed_checkpoint_and_goes_on_uploading(backends, s3_server):
    single = backends("single")
    err = single.b_result.stderr + single.b_result.stdout  # the progress lines are rank 0's, on stdout
    assert f"Downloading checkpoint 000002 of {single.url}" in err
    assert f"Resumed from {single.run_b / CHECKPOINTS / '000002'} at step 2." in err
    remote = single.remote(s3_server)
    assert remote.committed() == ["000002", "000004"] and remote.last() == "000004" and remote.partial() == []
    assert remote.manifest("000004") == json.loads((single.run_b / CHECKPOINTS / "000004" / MANIFEST).read_text())
    assert "Checkpoint 000004 is stored in" in err


@pytest.mark.parametrize("backend", ["single", "ddp"])
def test_a_run_resumed_from_the_store_on_an_empty_disk_logs_the_uninterrupted_losses(backends, backend):
    b = backends(backend)
    assert sorted(b.full) == [1, 2, 3, 4] and sorted(b.resumed) == [1, 2, 3, 4]
    assert {s: b.resumed[s] for s in (3, 4)} == {s: b.full[s] for s in (3, 4)}  # exact: ==
    assert {s: b.resumed[s] for s in (1, 2)} == {s: b.full[s] for s in (1, 2)}  # the history came with the checkpoint


def test_a_rollback_from_the_store_sets_the_newer_remote_checkpoint_aside(backends, s3_server):
    ddp = backends("ddp")
    remote = ddp.remote(s3_server)
    assert remote.committed() == ["000002", "000004"] and remote.last() == "000004"
    aside = [k for k in remote.storage.list("rolled_back") if k.endswith("/000004/" + MANIFEST)]
    assert len(aside) == 1
    assert json.loads(remote.storage.read_bytes(aside[0])) == json.loads((ddp.run_a / CHECKPOINTS / "000004" / MANIFEST).read_text())
    assert "in " + ddp.url + " will move into rolled_back/<time>/ there" in ddp.b_result.stderr


def test_no_byte_the_run_writes_holds_the_secret_key(backends, s3_server):
    secret = s3_server.env["AWS_SECRET_ACCESS_KEY"].encode()
    assert len(secret) >= 16
    for backend in ("single", "ddp"):
        b = backends(backend)
        for machine in (b.a, b.b):
            for path in machine.root.rglob("*"):
                if path.is_file() and not path.is_symlink():
                    assert secret not in path.read_bytes(), path
        remote = b.remote(s3_server)
        for key in remote.storage.list(""):
            assert secret not in remote.storage.read_bytes(key), key
        assert secret.decode() not in b.a_result.stderr + b.a_result.stdout + b.b_result.stderr + b.b_result.stdout


def test_the_offline_tools_read_a_run_in_the_store(backends, s3_server, tmp_path, monkeypatch):
    single = backends("single")
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path / "cache"))
    listed = run_cli_in_process(["checkpoint", "list", single.url])
    ok(listed)
    assert "000002" in listed.stdout and "committed" in listed.stdout
    verified = run_cli_in_process(["checkpoint", "verify", single.url])
    ok(verified)
    assert verified.stdout.count("OK  ") == 2
    shown = run_cli_in_process(["checkpoint", "inspect", f"{single.url}:4", "--json"])
    ok(shown)
    assert json.loads(shown.stdout)["step"] == 4
    exported = run_cli_in_process(["checkpoint", "export", f"{single.url}:4", "--output", str(tmp_path / "exported")])
    ok(exported)
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    evaluated = run_cli_in_process(["eval", f"{single.url}:2", "--output", str(tmp_path / "eval"), "--stride", "8"])
    ok(evaluated)
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["samples"] > 0
    from opentau_cli.cli.common import local_source
    from opentau_cli.tools.serve import load_served

    copy = local_source(f"{single.url}:4")  # what `opentau serve URL:4` serves: the cached, verified copy
    assert copy == str(tmp_path / "cache" / "remote" / Path(copy).parts[-3] / CHECKPOINTS / "000004")
    assert "step 4" in load_served(copy).describe()


@pytest.mark.parametrize("case", ["scheme", "bucket", "credentials", "endpoint", "taken", "itself"])
def test_a_bad_remote_is_refused_before_launch_writing_nothing(backends, s3_server, tmp_path, monkeypatch, case):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    url = {"scheme": "nosuchscheme://bucket/run", "bucket": s3_server.url("x").replace(s3_server.bucket, "no-such-bucket"),
           "credentials": s3_server.url("runs/fresh"), "endpoint": s3_server.url("runs/fresh"),
           "taken": backends("single").url, "itself": out.as_uri()}[case]
    store = backends("single").remote(s3_server).storage
    before = store.list("")
    if case == "credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    if case == "endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    result = run_cli_in_process(["train", f"--config_path={TINY}", f"--output_dir={out}", "--steps", "2",
                                 f"--checkpoint.remote={url}"])
    needle = {"scheme": "nosuchscheme", "bucket": "no-such-bucket", "credentials": "credentials",
              "endpoint": "127.0.0.1:9", "taken": "already holds a run", "itself": "own output_dir"}[case]
    refused(result, needle)
    assert not out.exists()
    assert store.list("") == before  # the client made before the bad settings still reaches the store
    assert store.list("runs/fresh") == []


def test_the_kubernetes_jobs_command_starts_on_an_empty_store_and_continues_from_it_on_a_fresh_disk(s3_server, tmp_path):
    """configs/examples/k8s_job_remote.yaml's container command, run as written by bash with the tiny preset on one
    CPU process substituted (and the step counts appended): the first pod starts the run, the next pod (a new
    emptyDir) continues from the store's checkpoint (tests/test_slurm.py runs the SLURM examples)."""
    import yaml

    job = yaml.safe_load((EXAMPLES / "k8s_job_remote.yaml").read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    script = container["args"][0].replace("configs/examples/pi05_config.json", str(TINY))
    script = script.replace("--accelerate-config=configs/examples/accelerate_ddp_config.yaml", "")
    assert container["command"] == ["/bin/bash", "-c"] and "--resume=auto" in script
    remote = s3_server.url("runs/k8s-job")
    env = {**os.environ, **s3_server.env, "REMOTE": remote, "HF_HOME": str(tmp_path / "hf_home"),
           "OPENTAU_CACHE_DIR": own_cache(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(opentau_bin()).parent}:{os.environ['PATH']}"}
    pods = []
    for pod, steps in (("pod-1", 2), ("pod-2", 4)):
        disk = tmp_path / pod  # each pod's emptyDir
        command = script.replace("/run/pi05", str(disk / "pi05")).rstrip() + f" --steps {steps} --save_freq 2 --log_freq 1"
        pods.append(subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=900))
        assert pods[-1].returncode == 0, pods[-1].stderr[-3000:]
    assert "holds no checkpoint: starting the run" in pods[0].stdout + pods[0].stderr
    assert "Resumed from" in pods[1].stdout + pods[1].stderr and "at step 2" in pods[1].stdout + pods[1].stderr
    records = [json.loads(line) for line in (tmp_path / "pod-2" / "pi05" / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records if record.get("kind") == "train"]
    assert steps == [1, 2, 3, 4]  # the history came from the store; steps 3 and 4 logged once
