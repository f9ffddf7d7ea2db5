"""Checkpoints that outlive the machine (docs/ARCHITECTURE.md, "Remote checkpoints"), end to end against a real
S3-compatible server (SeaweedFS): real launches of the installed CLI upload every checkpoint in the background, a run
killed mid-upload leaves only committed checkpoints trusted, and `opentau resume URL` on an empty disk (another HOME,
working directory and cache) continues with losses == the uninterrupted run's, under every backend.

Each backend trains 4 steps saving at 2 and 4 (run A: the uninterrupted reference); a second launch on an empty
disk resumes the remote's step 2 and logs steps 3 and 4 again. The single-process run A is SIGKILLed while its
launcher holds the upload of checkpoint 4 after its first file (tests/upload_hook), so its resume takes the last
committed checkpoint (2) by itself; the others roll the remote back to 2 (`URL:2 --rollback=true`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import EXAMPLES, REPO, SINGLE_PROCESS_ENV, opentau_bin, refused, run_cli, run_cli_in_process
from opentau_cli.store.layout import CHECKPOINTS, MANIFEST, METRICS
from opentau_cli.store.remote_run import RemoteRun
from opentau_cli.store.storage import open_storage

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
YAML = {
    "single": None,
    "ddp": str(EXAMPLES / "accelerate_cpu_ddp_config.yaml"),
    "zero2": str(EXAMPLES / "accelerate_cpu_deepspeed_config.yaml"),
    "zero3": str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"),
    "fsdp2": str(EXAMPLES / "accelerate_cpu_fsdp2_config.yaml"),
}
COMMON = ["--steps", "4", "--save_freq", "2", "--log_freq", "1", "--scheduler.warmup_steps", "2"]
HOOK = str(REPO / "tests" / "upload_hook")


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / METRICS).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"


class Machine:
    """A machine of its own: HOME, working directory and opentau cache, with the store's endpoint and credentials
    in its environment (the standard AWS variables, as a user sets them)."""

    def __init__(self, root: Path, server, single: bool):
        self.root = root
        for part in ("home", "work", "cache"):
            (root / part).mkdir(parents=True, exist_ok=True)
        self.env = {"HOME": str(root / "home"), "HF_HOME": str(root / "home" / "hf"), "OPENTAU_CACHE_DIR": str(root / "cache"),
                    **server.env, "PYTHONPATH": HOOK, "TEST_UPLOAD_DIR": str(root)}
        if single:
            self.env.update(SINGLE_PROCESS_ENV)

    def run(self, args: list[str], **env) -> subprocess.CompletedProcess:
        return run_cli(args, cwd=self.root / "work", env={**self.env, **env})


class Backend:
    def __init__(self, backend: str, tmp: Path, server):
        self.backend, self.url = backend, server.url(f"runs/{backend}")
        single = backend == "single"
        self.a = Machine(tmp / backend / "a", server, single)
        self.run_a = self.a.root / "work" / "run"
        args = ["train", f"--config_path={TINY}", f"--output_dir={self.run_a}", *COMMON, "--batch_size",
                "8" if single else "4", f"--checkpoint.remote={self.url}"]
        if YAML[backend]:
            args.append(f"--accelerate-config={YAML[backend]}")
        if single:
            self.a_result = self._killed_mid_upload(args)
        else:
            self.a_result = self.a.run(args)
            ok(self.a_result)
        self.full = losses(self.run_a)
        self.remote_after_a = self.remote(server)
        self.committed_after_a, self.partial_after_a = self.remote_after_a.committed(), self.remote_after_a.partial()
        # Another machine with an empty disk continues the run from the store.
        self.b = Machine(tmp / backend / "b", server, single)
        self.run_b = self.b.root / "work" / "run"
        target = self.url if single else f"{self.url}:2"
        self.b_result = self.b.run(["resume", target, f"--output_dir={self.run_b}"] + ([] if single else ["--rollback=true"]))
        ok(self.b_result)
        self.resumed = losses(self.run_b)

    def remote(self, server) -> RemoteRun:
        """The store as this process sees it (a boto3 client reads the AWS variables once, when it is made)."""
        saved = {name: os.environ.get(name) for name in server.env}
        os.environ.update(server.env)
        try:
            return RemoteRun(open_storage(self.url))
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)

    def _killed_mid_upload(self, args: list[str]):
        """Run A with the upload of checkpoint 4 held after its first file; once training is over (step 4 logged),
        SIGKILL the whole run, launcher included: the store keeps checkpoint 2 committed and 4 half uploaded."""
        env = {**os.environ, **self.a.env, "TEST_UPLOAD_HOLD": "000004"}
        env.pop("OPENTAU_DEBUG", None)
        proc = subprocess.Popen([opentau_bin(), *args], cwd=self.a.root / "work", env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (self.a.root / "held").exists() and 4 in (losses(self.run_a) if (self.run_a / METRICS).exists() else {}):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        time.sleep(1.0)  # the ranks finish their last save and leave; the launcher waits on the held upload
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def backends(tmp_path_factory, s3_server):
    tmp = tmp_path_factory.mktemp("remote")
    made: dict[str, Backend] = {}

    def get(name: str) -> Backend:
        if name not in made:
            made[name] = Backend(name, tmp, s3_server)
        return made[name]

    return get


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


@pytest.mark.parametrize("backend", ["single", "ddp", "zero2", "zero3", "fsdp2"])
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
    zero2 = backends("zero2")
    merged = run_cli_in_process(["checkpoint", "consolidate", f"{zero2.url}:4", "--output", str(tmp_path / "merged")])
    ok(merged)
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    inplace = run_cli_in_process(["checkpoint", "consolidate", f"{zero2.url}:4"])
    refused(inplace, "pass --output DIR")


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


def test_the_requeue_examples_start_on_an_empty_store_and_resume_one_that_holds_a_checkpoint(backends, s3_server):
    """configs/examples/slurm_spot_remote.sbatch and k8s_job_remote.yaml choose between train and resume with the
    same test: run as written against the store."""
    single = backends("single")
    env = {**os.environ, **s3_server.env, "PATH": f"{Path(opentau_bin()).parent}:{os.environ['PATH']}"}
    for example in ("slurm_spot_remote.sbatch", "k8s_job_remote.yaml"):
        line = next(line for line in (EXAMPLES / example).read_text().splitlines() if "grep -q" in line)
        test = line.strip().removeprefix("if ").split("; then")[0]
        for remote, holds in ((s3_server.url("runs/nothing-here"), False), (single.url, True)):
            done = subprocess.run(["bash", "-c", test], env={**env, "REMOTE": remote}, capture_output=True, text=True)
            assert (done.returncode == 0) == holds, (example, remote, done.stderr)
