"""A real SLURM cluster for tests: Debian's slurmctld, two slurmd (nodes n1 and n2) on this host and munge, all
configured under a directory of the caller's and started as the test's user (root: slurmd runs jobs as their
submitter). A test fixture, not product code; `scripts/setup_slurm.sh` installs the packages.

    cluster = SlurmCluster(tmp_path / "slurm")   # writes slurm.conf and a munge key; nothing runs yet
    cluster.start()                               # munged, slurmctld, slurmd -N n1, slurmd -N n2; waits until idle
    job = cluster.sbatch(script, "--nodes=1")     # as a user submits (cluster.env: SLURM_CONF for any client)
    cluster.wait(job, "RUNNING")
    cluster.stop()                                # cancels jobs, shuts the daemons down, kills what is left

Settings that make requeue and preemption quick (measured on a 2-core VM): KillWait=5, cred_expire=5,
sched_interval=2, so that a requeued job runs again within about 10 s (its begin time is cred_expire + 1 s later:
`scontrol update StartTime=now` before then makes slurmd refuse it, "Job N already killed"). Two partitions: `main`
(the default, PriorityTier 1, preempted jobs requeued after GraceTime=10) and `urgent` (PriorityTier 10), whose jobs
preempt main's; `preempt_send_user_signal` sends a job's --signal at preemption.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge",
            "mungekey": "munge"}
NODES = ("n1", "n2")
# What the examples ask of a node (--cpus-per-task=64), so that they are submitted as written: more CPUs than this
# host has (config_overrides). GPUs are not declared (slurmd 22.05 here registers no count-only GPU: the node goes
# INVAL), so a test submits an example with `--gpus-per-node=0` on sbatch's command line, which wins over #SBATCH.
CPUS_PER_NODE = 64


class SlurmMissing(RuntimeError):
    """A SLURM or munge program is not installed."""


def missing_programs() -> list[str]:
    """The Debian packages whose programs are not on PATH (daemons live in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return sorted({pkg for tool, pkg in PACKAGES.items() if shutil.which(tool, path=path) is None})


def _free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports, free now: held open together while the system picks them."""
    held = [socket.socket() for _ in range(count)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin") or name


class SlurmCluster:
    def __init__(self, root: Path):
        missing = missing_programs()
        if missing:
            raise SlurmMissing(f"SLURM is not installed ({', '.join(missing)} missing); run scripts/setup_slurm.sh")
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"  # the key, 0700
        # The socket: in a 0755 folder of its own whose every parent others may enter (munged insists; pytest's
        # temporary directories are 0700), removed by stop().
        self.munge_run = Path(tempfile.mkdtemp(prefix="opentau-munge-"))
        self.socket = self.munge_run / "munge.socket"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._write_config()
        self._procs: list[subprocess.Popen] = []

    # Set-up.

    def _write_config(self) -> None:
        for folder in ("state", "spool", "log", "run"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        for name in NODES:  # SlurmdSpoolDir=spool/%n: slurmd makes no folder of its own there
            (self.root / "spool" / name).mkdir(exist_ok=True)
        self.munge_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.munge_run, 0o755)
        os.chmod(self.root, 0o755)
        key = self.munge_dir / "munge.key"
        if not key.exists():
            subprocess.run([_sbin("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        r = self.root
        nodes = "\n".join(f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                          f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for name, port in zip(NODES, node_ports))
        self.conf.write_text(f"""\
ClusterName=opentau-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
MailProg=/bin/true
SlurmdParameters=config_overrides
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=main Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=10
PartitionName=urgent Nodes={",".join(NODES)} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
""")

    def _daemon(self, argv: list[str]) -> None:
        subprocess.run(argv, check=True, capture_output=True, env={**os.environ, **self.env}, timeout=60)

    def start(self, timeout: float = 60) -> "SlurmCluster":
        try:
            self._daemon([_sbin("munged"), f"--key-file={self.munge_dir / 'munge.key'}", f"--socket={self.socket}",
                          f"--log-file={self.root / 'log' / 'munged.log'}", f"--pid-file={self.root / 'run' / 'munged.pid'}",
                          f"--seed-file={self.munge_dir / 'munge.seed'}"])
            self._daemon([_sbin("slurmctld"), "-c"])
            for name in NODES:
                self._daemon([_sbin("slurmd"), "-N", name])
            deadline = time.monotonic() + timeout
            while True:
                states = self.node_states()
                if states and all(s == "idle" for s in states.values()):
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SLURM nodes not idle after {timeout} s: {states}\n{self.logs()}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((self.root / "log").glob("*.log")))

    # What a user runs.

    def run(self, *argv: str, check: bool = True, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM client command (sinfo, squeue, scontrol, scancel, ...) against this cluster."""
        return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout,
                              env={**os.environ, **(env or {}), **self.env})

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def sbatch(self, script: Path | str, *options: str, cwd: Path | None = None, env: dict | None = None) -> str:
        """Submit `script` (a path) as `sbatch OPTIONS SCRIPT` from `cwd` with `env` on top of this process's
        environment (sbatch passes it on to the job); returns the job id."""
        result = subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True, text=True,
                                cwd=cwd, env={**os.environ, **(env or {}), **self.env}, timeout=60)
        if result.returncode:
            raise RuntimeError(f"sbatch failed: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job -o JOB` as {key: value} (the record lasts MinJobAge after the job ends)."""
        out = self.run("scontrol", "show", "job", "-o", job, check=False).stdout
        fields = {}
        for token in out.split():
            if "=" in token:
                key, value = token.split("=", 1)
                fields[key] = value
        return fields

    def state(self, job: str) -> str:
        return self.job(job).get("JobState", "UNKNOWN")

    def wait(self, job: str, *states: str, timeout: float = 600) -> dict[str, str]:
        """Poll until the job is in one of `states`; returns its record. A job that ends in another state fails."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            state = info.get("JobState")
            if state in states:
                return info
            if state in final - set(states) or time.monotonic() > deadline:
                raise AssertionError(f"job {job} is {state}, waited for {states}: {info}")
            time.sleep(0.5)

    # Tear-down.

    def _pids(self) -> set[int]:
        pids = set()
        for job in self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
            out = self.run("scontrol", "listpids", job, check=False).stdout
            pids.update(int(line.split()[0]) for line in out.splitlines()[1:] if line.split() and line.split()[0].isdigit())
        return pids

    def stop(self) -> None:
        """Cancel every job, shut the daemons down and kill what is left of them and of the jobs; safe to call on a
        cluster that never (fully) started."""
        pids = set()
        if (self.root / "run" / "slurmctld.pid").exists():
            pids = self._pids()
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
            self.run("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 30
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
            self.run("scontrol", "shutdown", check=False)
        daemons = [self.root / "run" / f"slurmd-{n}.pid" for n in NODES] + [self.root / "run" / "slurmctld.pid"]
        deadline = time.monotonic() + 15
        for pid_file in daemons:
            pid = _read_pid(pid_file)
            while pid and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:  # linuxproc does not kill what a job left behind
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        munged = _read_pid(self.root / "run" / "munged.pid")
        if munged and _alive(munged):
            os.kill(munged, signal.SIGTERM)
        shutil.rmtree(self.munge_run, ignore_errors=True)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a daemon whose parent has not reaped it is gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
