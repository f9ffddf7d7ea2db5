"""What a scheduler's environment says about the launch: SLURM's job variables, read, never guessed
(docs/ARCHITECTURE.md, "Schedulers")."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Mapping

from opentau_cli.errors import UserError


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job this process runs in, as its environment describes it."""

    job_id: str
    nodes: int | None  # SLURM_JOB_NUM_NODES (else SLURM_NNODES)
    node_id: int | None  # SLURM_NODEID: this node's index in the job (0 in the batch script)
    nodelist: str | None  # SLURM_JOB_NODELIST, compressed (n[1-2])
    gpus_per_node: int | None  # SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE (`gpu:8` or `8`)

    def describe(self, address: str | None) -> str:
        parts = [f"SLURM job {self.job_id}"]
        if self.nodes is not None:
            parts.append(f"{self.nodes} node{'s' * (self.nodes != 1)}{f' ({self.nodelist})' if self.nodelist else ''}")
        if self.node_id is not None:
            parts.append(f"this is node {self.node_id} (SLURM_NODEID)")
        if address:
            parts.append(f"machine 0's address {address}")
        if self.gpus_per_node is not None:
            parts.append(f"{self.gpus_per_node} GPU{'s' * (self.gpus_per_node != 1)} per node")
        return ", ".join(parts)


def _whole(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if not text:
        return None
    if not text.strip().isdigit():
        raise UserError(f"{name} must be a whole number, got {text!r}.")
    return int(text)


def _gpus(environ: Mapping[str, str]) -> int | None:
    """SLURM_GPUS_ON_NODE (the GPUs this node was given), else SLURM_GPUS_PER_NODE (`8`, `gpu:8`, `a100:8`)."""
    if environ.get("SLURM_GPUS_ON_NODE", "").strip().isdigit():
        return int(environ["SLURM_GPUS_ON_NODE"])
    found = re.fullmatch(r"(?:[\w.-]+:)*(\d+)", environ.get("SLURM_GPUS_PER_NODE", "").strip())
    return int(found.group(1)) if found else None


def slurm_job(environ: Mapping[str, str]) -> SlurmJob | None:
    """The job of SLURM_JOB_ID, or None outside SLURM."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    nodes = _whole(environ, "SLURM_JOB_NUM_NODES")
    return SlurmJob(job_id=job_id, nodes=nodes if nodes is not None else _whole(environ, "SLURM_NNODES"),
                    node_id=_whole(environ, "SLURM_NODEID"),
                    nodelist=environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST"),
                    gpus_per_node=_gpus(environ))


def _scontrol(*args: str) -> str:
    try:
        result = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"`scontrol {' '.join(args)}` failed ({e}): set MASTER_ADDR to machine 0's address, or pass "
                        "--main_process_ip.") from None
    if result.returncode:
        why = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"`scontrol {' '.join(args)}` failed ({why}): set MASTER_ADDR to machine 0's address, or pass "
                        "--main_process_ip.")
    return result.stdout


def first_node_address(nodelist: str) -> tuple[str, str]:
    """The job's first node (`scontrol show hostnames LIST | head -n 1`, as sbatch scripts find it) and the address
    SLURM reaches it at (its NodeAddr, which is its name unless the cluster's slurm.conf says otherwise)."""
    hosts = _scontrol("show", "hostnames", nodelist).split()
    if not hosts:
        raise UserError(f"`scontrol show hostnames {nodelist}` names no host: set MASTER_ADDR to machine 0's address.")
    found = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", "-o", hosts[0]))
    return hosts[0], found.group(1) if found else hosts[0]


# sbatch's --signal: [{R|B}:]SIG[@SECONDS], SECONDS before the time limit; 60 when left out (sbatch(1)).
SIGNAL_DEFAULT_SECONDS = 60
_SIGNAL = re.compile(r"(?:[RB]+:)?(?:SIG)?(\w*)(?:@(\d+))?", re.IGNORECASE)
# `#SBATCH --signal=B:USR1@300` or `#SBATCH --signal B:USR1@300`
_SBATCH_SIGNAL = re.compile(r"#SBATCH\s.*?--signal(?:=|\s+)(\S+)")


def signal_seconds(text: str) -> int | None:
    """The seconds before the time limit that an sbatch `--signal` value gives (`B:USR1@300` -> 300, `USR1` -> 60);
    None when it is not one."""
    found = _SIGNAL.fullmatch(text.strip())
    if not found or not (found.group(1) or found.group(2)):
        return None
    return int(found.group(2)) if found.group(2) else SIGNAL_DEFAULT_SECONDS


def script_signal(script: str) -> str | None:
    """The `--signal` value of a batch script's `#SBATCH` lines (the last one; sbatch stops reading them at the first
    command), or None."""
    value = None
    for line in script.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            break
        found = _SBATCH_SIGNAL.match(line)
        if found:
            value = found.group(1)
    return value


def signal_grace(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(seconds, where they were read) of the job's `--signal`: SBATCH_SIGNAL when the submitter set it (it wins over
    the script, as sbatch takes it), else the job's batch script as `scontrol write batch_script` gives it back (SLURM
    puts the time neither in the job's environment nor in `scontrol show job`). None outside SLURM, for a job without
    --signal, or when scontrol cannot say (an interactive allocation has no batch script)."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    given = environ.get("SBATCH_SIGNAL")
    if given and signal_seconds(given) is not None:
        return signal_seconds(given), f"SBATCH_SIGNAL={given}"
    try:
        result = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = script_signal(result.stdout) if result.returncode == 0 else None
    if value is None or signal_seconds(value) is None:
        return None
    return signal_seconds(value), f"SLURM's --signal={value}"
