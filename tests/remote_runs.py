"""Real launches against the test S3 server for the remote-checkpoint tests (tests/test_remote_*.py): each backend
trains 4 steps saving at 2 and 4 (the uninterrupted reference; its save of 4 waits until 2 is in the store, so a
fast run cannot publish 4 before the uploader first looks and leave 2 local only, as the uploader's policy says), then a machine with an empty disk resumes it from the
store. Not a test module: the modules share it so that pytest-xdist spreads their launches over its workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import EXAMPLES, REPO, SINGLE_PROCESS_ENV, opentau_bin, own_cache, run_cli
from opentau_cli.store.layout import METRICS
from opentau_cli.store.remote_run import RemoteRun
from opentau_cli.store.storage import open_storage

TINY = str(EXAMPLES / "pi05_tiny_config.json")
YAML = {
    "single": None,
    "ddp": str(EXAMPLES / "accelerate_cpu_ddp_config.yaml"),
    "zero2": str(EXAMPLES / "accelerate_cpu_deepspeed_config.yaml"),
    "zero3": str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml"),
    "fsdp2": str(EXAMPLES / "accelerate_cpu_fsdp2_config.yaml"),
}
COMMON = ["--steps", "4", "--save_freq", "2", "--log_freq", "1", "--scheduler.warmup_steps", "2"]
HOOKS = str(REPO / "tests" / "hooks")  # the fault-injection helper: TEST_UPLOAD_DIR holds and records uploads
# DeepSpeed's CPU op, built once for every machine: a new HOME would rebuild it (30-60 s) at each launch, which is
# not what these tests are about.
TORCH_EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")


def wait_for(condition, what: str, proc, seconds: float = 180) -> None:
    """Until `condition()` holds, while the launch `proc` is still running, for at most `seconds` (a guard, no timing)."""
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) while waiting for {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def losses(run_dir: Path) -> dict[int, float]:
    """Train losses by step, from the complete lines only: a running launch may be half-way through appending one."""
    out, text = {}, (run_dir / METRICS).read_text()
    for line in text[:text.rfind("\n") + 1].splitlines():
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
        self.env = {"HOME": str(root / "home"), "HF_HOME": str(root / "home" / "hf"), "OPENTAU_CACHE_DIR": own_cache(root / "cache"),
                    **server.env, "PYTHONPATH": HOOKS, "TEST_UPLOAD_DIR": str(root), "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS}
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
            self.a_result = self.a.run(args, TEST_UPLOAD_PACE="000002")
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
        env = {**os.environ, **self.a.env, "TEST_UPLOAD_HOLD": "000004", "TEST_UPLOAD_PACE": "000002"}
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


def backend_runs(tmp_path_factory, s3_server):
    """A getter of each backend's Backend, each made once per module."""
    tmp = tmp_path_factory.mktemp("remote")
    made: dict[str, Backend] = {}

    def get(name: str) -> Backend:
        if name not in made:
            made[name] = Backend(name, tmp, s3_server)
        return made[name]

    return get
