"""Build and run `accelerate launch` on a per-rank worker (train's or profile's): CPU recipes, logs, exit codes and signals.

The launcher is the only process the user talks to. It runs a `RunPlan` that `opentau_cli.plan.run_plan` decided (every
rule and resume check, the same as `config validate`) before anything is spawned, writes the resolved config and an Accelerate YAML with the CPU recipes of
docs/ARCHITECTURE.md "CPU recipes" applied into `<output_dir>/logs/<timestamp>/`, then runs the workers and maps their outcome to
exit codes: 0 done (or preempted and saved), 1 a worker failed (with the log path), 2 a user error a rank found late,
3 done but checkpoints are left on this machine only (not yet in checkpoint.remote), 130 Ctrl-C.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from opentau_cli.config import AccelerateSetup, TrainConfig, Validated
from opentau_cli.config.model import DistributedConfig
from opentau_cli.config.rules import cuda_is_available
from opentau_cli.errors import RunError, UserError
from opentau_cli.process import lease as remote_lease
from opentau_cli.process import runlock
from opentau_cli.process.accelerate_launcher import TORCHRUN_ARGS
from opentau_cli.process.restarts import STOPPED, failure_of_attempt, is_knock_on, last_attempt, read_restarts, record_final
from opentau_cli.process.runtime import ATTEMPT_MARK, PREEMPT_SIGNALS, PREEMPTED_FILE, read_user_error
from opentau_cli.store.layout import CHECKPOINTS, EVALS, LAUNCH_FILE, LAUNCHER_LOG, LOGS, METRICS, TENSORBOARD, TRAIN_CONFIG
from opentau_cli.store.lineage import ROLLED_BACK, roll_back, span
from opentau_cli.store.runs import checkpoint_steps, clean_leftovers, latest, run_dir_of


@dataclass(frozen=True)
class Worker:
    """What every rank of a launch runs."""

    module: str  # run as `python -m <module>` by accelerate launch
    name: str  # what failed, in the error: "Training failed: ..."
    console: bool = True  # the launcher's stdout (rank 0's console) reaches this terminal, else <log_dir>/launcher.log


TRAIN_WORKER = Worker("opentau_cli.train.worker", "Training")
TRACKERS_MODULE = "opentau_cli.train.trackers"  # W&B's late evaluations (finish_evals)
LOCAL_ONLY_EXIT = 3  # the launch ended as it should, but checkpoints are on this machine only: docs/configuration.md, "Exit codes"


@dataclass
class RunPlan:
    """Everything a launch needs, decided before any process starts (plan/run_plan.py makes it)."""

    checked: Validated
    resume_from: Path | None = None
    notes: list[str] = field(default_factory=list)
    finished: bool = False  # resuming a run that already reached its steps: nothing to launch (exit 0)
    rollback: bool = False  # the launcher first moves the checkpoints newer than resume_from aside (lineage.py)
    remote_rollback: bool = False  # ... and those in checkpoint.remote (process/uploader.py)
    # The revision (branch, tag) each Hub dataset was asked at before its commit was pinned, by member label: launch.json
    # records it, so that a later resume can say when that branch has moved (data/hub.py pin_for_resume).
    dataset_branches: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> TrainConfig:
        return self.checked.config

    @property
    def setup(self) -> AccelerateSetup:
        return self.checked.accelerate


def free_port() -> int:
    """An unused TCP port so parallel runs on one machine do not collide on Accelerate's default 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_yaml(setup: AccelerateSetup, cfg: TrainConfig, cuda: bool, max_restarts: int = 0) -> dict:
    """The Accelerate config we hand to `accelerate launch`: the user's YAML as written, changed only where it must be.

    What changes: the launch's shape (processes, machines, machine rank, main process address: the command line and
    the cluster's environment may override the YAML), the CPU recipes of docs/ARCHITECTURE.md ("CPU recipes"), a free
    port for a one-machine launch, and what the config wins over (DeepSpeed's accumulation and clipping). On CPU, DDP
    must go through the multi-GPU (torchrun) launcher: `use_cpu: true` / MULTI_CPU would make Accelerate fall back to
    one process; the worker then creates `Accelerator(cpu=True)`, which runs MULTI_CPU over gloo. Every other key
    (gpu_ids, dynamo_config, DeepSpeed offload, deepspeed_config_file, ...) reaches Accelerate as the user wrote it.
    """
    restarts = max_restarts > 0
    # Restarts need torch's elastic agent (torchrun), which Accelerate runs for the multi-process launchers only.
    multi = setup.world_size > 1 or restarts
    out: dict = {"compute_environment": "LOCAL_MACHINE", "rdzv_backend": "static", "same_network": True, **(setup.raw or {})}
    out.update(num_processes=setup.num_processes, num_machines=setup.num_machines, machine_rank=setup.machine_rank,
               mixed_precision=setup.mixed_precision, use_cpu=False)
    if setup.backend == "deepspeed":
        out["distributed_type"] = "DEEPSPEED"
        ds = dict(out.get("deepspeed_config") or {})
        if setup.ds_config_file:
            # The JSON holds the DeepSpeed settings (Accelerate refuses them twice); the worker sets accumulation,
            # clipping and the micro-batch from the config (train/trainer.py).
            ds["deepspeed_config_file"] = setup.ds_config_file
            out["mixed_precision"] = None
        else:
            ds.update(zero_stage=setup.zero_stage,
                      # The config wins over the YAML (rules.py warned about any disagreement).
                      gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                      gradient_clipping=cfg.optimizer.grad_clip_norm)
            ds.setdefault("zero3_init_flag", setup.zero_stage == 3)
        if setup.num_machines > 1:
            ds.setdefault("deepspeed_multinode_launcher", "standard")  # torchrun on each machine, as srun starts it
        out["deepspeed_config"] = ds
    elif multi:
        # FSDP too: opentau applies fully_shard itself (train/fsdp.py); Accelerate's own FSDP plugin would take over
        # the model, and its clip_grad_norm_ would skip the unprepared one.
        if not cuda or setup.backend == "fsdp" or out.get("distributed_type") in (None, "NO", "MULTI_CPU"):
            out["distributed_type"] = "MULTI_GPU"
        if cuda:
            out.setdefault("gpu_ids", "all")
    else:
        out["distributed_type"] = "NO"
    if multi or setup.backend == "deepspeed":
        out["main_process_port"] = setup.main_process_port or (free_port() if setup.num_machines == 1 else 29500)
        if setup.main_process_ip:
            out["main_process_ip"] = setup.main_process_ip
    return out


def worker_env(setup: AccelerateSetup, cuda: bool, max_restarts: int = 0, distributed: DistributedConfig | None = None
               ) -> dict[str, str]:
    env = dict(os.environ)
    if max_restarts > 0:
        # The c10d rendezvous endpoint: machine 0's address, or a free port of this machine for a one-machine launch
        # (torchrun's default, port 29400, would join every restartable run on the machine into one rendezvous).
        host = setup.main_process_ip if setup.num_machines > 1 else "127.0.0.1"
        port = setup.main_process_port or (free_port() if setup.num_machines == 1 else 29500)
        torchrun = {"rdzv_endpoint": f"{host}:{port}"}
        machines = distributed.machine_range if distributed is not None else None
        if setup.num_machines > 1 or machines is not None:
            # Elastic machines (torch's --nnodes MIN:MAX; a fixed count with restarts is N:N). Machine 0 hosts the
            # rendezvous store whatever its address resolves to (on loopback every "machine" would claim it); the
            # others connect to it. Once MIN machines are there, the rendezvous waits machine_wait_seconds for more; a
            # machine that left is dropped after 3 missed heartbeats, one every machine_wait_seconds / 3 (torch's 5 s
            # at most).
            low, high = machines or (setup.num_machines, setup.num_machines)
            wait = max(1, round(distributed.machine_wait_seconds)) if distributed is not None else 30
            beat = min(5, max(1, wait // 3))
            torchrun.update(nnodes=f"{low}:{high}", rdzv_conf=f"is_host={int(setup.machine_rank == 0)},last_call_timeout="
                                                              f"{wait},keep_alive_interval={beat},keep_alive_max_attempt=3")
        env[TORCHRUN_ARGS] = json.dumps(torchrun)
        # A fresh store for each restarted group: with the agent's store shared across rendezvous rounds, the restarted
        # ranks read the failed group's keys (gloo's peer addresses) and hang connecting to dead ranks (seen, torch 2.13).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    if setup.backend == "deepspeed" and not cuda:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator; the worker uses gloo
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, setup.num_processes // setup.num_machines))))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def new_log_dir(output_dir: Path, machine_rank: int = 0) -> Path:
    """This launch's dir under logs/, named for its start time; machine 0's names the run (the ranks agree on it and
    all write their rank<N>.log there), another machine's launcher keeps its own files in `<time>-machine<k>/`."""
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-machine{machine_rank}" if machine_rank else "")
    base = output_dir / LOGS / stamp
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{stamp}-{n}"), n + 1
    path.mkdir(parents=True)
    return path


def prepare_output_dir(plan: RunPlan, echo=print) -> None:
    """Create the run dir; with --overwrite on a fresh run, drop the old run's results (named first) so they never
    mix. A fresh run into the dir of a start that failed before its first checkpoint (the only kind the rules let
    through) moves that start's metrics and TensorBoard events into its own log dir: kept, and never mixed with this
    run's. A resume with --rollback moves the checkpoints newer than its source aside (lineage.py)."""
    cfg = plan.config
    if cfg.overwrite and not cfg.resume and cfg.output_dir.is_dir():
        doomed = [cfg.output_dir / name for name in (CHECKPOINTS, METRICS, TENSORBOARD, ROLLED_BACK, EVALS)
                  if (cfg.output_dir / name).exists() or (cfg.output_dir / name).is_symlink()]
        if doomed:
            echo(f"--overwrite=true: removing {describe_removal(doomed)} of the earlier run in {cfg.output_dir}.")
        for p in doomed:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    elif not cfg.resume and cfg.output_dir.is_dir():
        results = [cfg.output_dir / name for name in (METRICS, TENSORBOARD, EVALS) if (cfg.output_dir / name).exists()]
        if results:
            logs = [p for p in (cfg.output_dir / LOGS).glob("*") if p.is_dir()]
            failed_start = max(logs, key=lambda d: d.stat().st_mtime) if logs else cfg.output_dir / LOGS / "earlier"
            failed_start.mkdir(parents=True, exist_ok=True)
            for p in results:
                p.rename(failed_start / p.name)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    if plan.rollback and plan.resume_from is not None:
        echo(roll_back(run_dir_of(plan.resume_from), plan.resume_from).line())


def describe_removal(paths: list[Path]) -> str:
    """'checkpoints/ (000020, 000040), metrics.jsonl and tensorboard/' for the overwrite line."""
    parts = []
    for p in paths:
        if p.name == CHECKPOINTS and p.is_dir():
            steps = [c for _, c in checkpoint_steps(p)]
            parts.append(f"{CHECKPOINTS}/ ({span(steps)})" if steps else f"{CHECKPOINTS}/")
        else:
            parts.append(p.name + ("/" if p.is_dir() else ""))
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def deepspeed_op_note(setup: AccelerateSetup, cuda: bool) -> str | None:
    """DeepSpeed compiles its CPU communication op with the C++ compiler on first use, silently: say so once. Not
    where the op is compiled into the DeepSpeed package (scripts/test.sh's set-up does so on a CPU torch) or was built
    by an earlier launch into torch's extensions folder."""
    if setup.backend != "deepspeed" or cuda:
        return None
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    built = root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / "deepspeed_shm_comm"
    package = importlib.util.find_spec("deepspeed")  # where DeepSpeed is, without importing it (seconds)
    installed = Path(package.origin).parent / "ops" / "comm" if package and package.origin else None
    if any(built.glob("*.so")) or (installed and any(installed.glob("deepspeed_shm_comm_op*.so"))):
        return None
    return ("DeepSpeed builds its CPU communication op (deepspeed_shm_comm) with the C++ compiler on this first launch: "
            "usually 30-60 s on 2 cores, once; later launches reuse it.")


def interrupted_line(plan: RunPlan) -> str:
    """What Ctrl-C kept and how to continue."""
    run_dir = plan.config.output_dir
    kept = latest(run_dir)
    if kept is None:
        return f"Interrupted: no checkpoint was saved; run the same command again to start over ({run_dir})."
    return (f"Interrupted: nothing was saved after checkpoint {kept}; continue with `opentau resume {run_dir}` "
            "(Ctrl-C does not save: send SIGTERM to save first).")


def write_launch_files(plan: RunPlan, log_dir: Path, cuda: bool, max_restarts: int = 0) -> tuple[Path, Path, Path]:
    cfg_path = log_dir / TRAIN_CONFIG
    cfg_path.write_text(json.dumps(plan.config.to_json_dict(), indent=2) + "\n")
    accel_path = log_dir / "accelerate_config.yaml"
    accel_path.write_text(yaml.safe_dump(accelerate_yaml(plan.setup, plan.config, cuda, max_restarts), sort_keys=False))
    launch_path = log_dir / LAUNCH_FILE
    launch = {
        "accelerate": plan.setup.to_dict(),
        "resume_from": str(plan.resume_from) if plan.resume_from else None,
        "log_dir": str(log_dir),
        "run_id": log_dir.name,
        "dataset_branches": plan.dataset_branches,  # what a later resume compares with the Hub (plan.recorded_branches)
    }
    launch_path.write_text(json.dumps(launch, indent=2) + "\n")
    return cfg_path, accel_path, launch_path


def build_command(accel_path: Path, cfg_path: Path, launch_path: Path, module: str = TRAIN_WORKER.module,
                  max_restarts: int = 0) -> list[str]:
    # Restarts: torch's elastic agent checks its ranks every second and re-forms the group through the c10d
    # rendezvous; the static one cannot (docs/ARCHITECTURE.md, "Restarts"). A flag: Accelerate ignores the YAML's
    # rdzv_backend, whose command-line default wins.
    restarts = (["--max_restarts", str(max_restarts), "--monitor_interval", "1", "--rdzv_backend", "c10d"]
                if max_restarts else [])
    return [
        sys.executable, "-m", "opentau_cli.process.accelerate_launcher", "--config_file", str(accel_path), *restarts,
        "-m", module, "--config", str(cfg_path), "--launch", str(launch_path),
    ]


def _worker_processes(launcher_pid: int, module: str) -> list:
    import psutil

    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if module in " ".join(child.cmdline()):
                out.append(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out




def failed_log(log_dir: Path) -> tuple[Path, str]:
    """The rank log that holds the root failure and its last line (a rank that only lost its peer comes last)."""
    logs = sorted(log_dir.glob("rank*.log"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0)
    found = []
    for log in logs:
        text = log.read_text(errors="replace")
        mark = text.rfind(ATTEMPT_MARK)  # a restartable launch: only its last attempt's failure ended it
        text = text[mark:] if mark >= 0 else text
        if "Traceback" in text or "Error:" in text:
            lines = [ln for ln in text.splitlines() if ln.strip()]
            last = lines[-1].strip() if lines else ""
            found.append((is_knock_on(last), log, last))
    if found:
        _, log, last = sorted(found, key=lambda f: f[0])[0]
        return log, last
    return (logs[0] if logs else log_dir), ""


def run(plan: RunPlan, *, worker: Worker = TRAIN_WORKER, echo=print, break_lock: bool = False,
        announce=lambda: None) -> int:
    """Launch `worker` on every rank and wait. Returns 0 or 130; raises UserError when a rank found a problem with
    the input (its one line, read the same way for every worker) or another live run holds the run directory
    (`runlock`: machine 0 holds it for the run) or checkpoint.remote (its lease, `holding_remote`), RunError when a
    rank failed (with the log path). `announce()` once the launch can no longer be refused."""
    if plan.setup.machine_rank > 0:
        announce()
        return _run(plan, worker, echo)
    with holding_remote(plan, break_lock, echo) as lease, runlock.held(plan.config.output_dir, break_lock=break_lock):
        announce()  # the plan's summary: once nothing can refuse the launch any more
        return _run(plan, worker, echo, lease)


@contextlib.contextmanager
def holding_remote(plan: RunPlan, break_lock: bool, echo):
    """checkpoint.remote's lease (process/lease.py) for the launch, renewed while it runs; None without a remote.
    Taken before anything is written here, so a refusal leaves no trace. A fresh run checks again, once it holds
    the lease, that no other run committed there meanwhile."""
    cfg = plan.config
    if not cfg.checkpoint.remote:
        yield None
        return
    from opentau_cli.store.remote_run import RemoteRun
    from opentau_cli.store.storage import open_storage

    from opentau_cli.process.uploader import UPLOAD_RETRY_SECONDS
    from opentau_cli.store.remote import RemoteError

    # Short retries: a renewal that fails is tried again at the next heartbeat, and the release at the end of a
    # launch whose store is away must not hold the exit.
    storage = open_storage(cfg.checkpoint.remote, {**cfg.checkpoint.remote_options,
                                                   "retry_seconds": UPLOAD_RETRY_SECONDS / 2})
    me = remote_lease.identity(Path(cfg.output_dir).absolute(), cfg.checkpoint.remote_lease_seconds)
    try:
        held = remote_lease.acquire(storage, me, break_lock=break_lock, echo=echo)
    except RemoteError as e:
        raise UserError(f"{e} The launch did not start; run it again once the store answers.") from None
    with held.heartbeat(on_lost=echo):
        if not cfg.resume and RemoteRun(storage).committed():
            raise UserError(f"checkpoint.remote {cfg.checkpoint.remote} already holds a run: pick another prefix, or "
                            f"continue that run with `opentau resume {cfg.checkpoint.remote}`.")
        yield held


def _run(plan: RunPlan, worker: Worker, echo, lease=None) -> int:
    cuda = cuda_is_available()
    setup = plan.setup
    first = setup.machine_rank == 0
    if first:  # the run directory is machine 0's to prepare: the others only add their launch files and rank logs
        clean_leftovers(plan.config.output_dir)
        prepare_output_dir(plan, echo)
        note = deepspeed_op_note(setup, cuda)
        if note:
            echo(note)
    log_dir = new_log_dir(plan.config.output_dir, setup.machine_rank)
    # Training restarts from its last checkpoint; other workers (profile) have nothing to restart from.
    max_restarts = plan.config.distributed.max_restarts if worker == TRAIN_WORKER else 0
    cfg_path, accel_path, launch_path = write_launch_files(plan, log_dir, cuda, max_restarts)
    cmd = build_command(accel_path, cfg_path, launch_path, worker.module, max_restarts)
    if first:
        echo(f"Logs: {log_dir}/rank<N>.log")
    else:
        echo(f"Machine {setup.machine_rank} of {setup.num_machines} joins the run led by machine 0 at "
             f"{setup.main_process_ip}; its ranks' logs: {log_dir}/rank<N>.log (linked into machine 0's log dir).")

    # While the ranks run, rank 0's progress line shows the uploads (process/uploader.py StatusView); the uploader's
    # own lines go to uploads.log.
    uploader = start_uploads(plan, log_dir, lease) if plan.config.checkpoint.remote else None
    if lease is not None and uploader is not None:
        lease.on_lost = uploader.give_up  # said once, by the uploader (uploads.log, the progress line)
    # Machine 0 evaluates the published checkpoints in a process of its own (process/evaluator.py).
    evaluator = start_evals(plan, log_dir) if plan.config.eval.enabled and first and worker == TRAIN_WORKER else None
    interrupted = False
    preempted: list[str] = []
    proc = None

    def preempt(signum, _frame):
        # A preemption notice is honoured at every moment (docs/ARCHITECTURE.md, "Restarts"): written down first, for
        # the ranks still to start (a group being restarted, or the first one still starting up), then sent to the
        # ranks that run (not torchrun, which would kill them): they finish the step, save, and exit 0.
        name = signal.Signals(signum).name
        preempted.append(name)
        with contextlib.suppress(OSError):
            (log_dir / PREEMPTED_FILE).write_text(name + "\n")
        for rank in _worker_processes(proc.pid, worker.module) if proc is not None else ():
            try:
                rank.send_signal(signum)
            except Exception:
                pass

    def interrupt(_signum, _frame):
        nonlocal interrupted
        interrupted = True
        if proc is None:
            raise KeyboardInterrupt
        try:
            proc.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, preempt) for s in PREEMPT_SIGNALS}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    try:
        # The launcher's own chatter, and its traceback when a rank fails, go to launcher.log: the user gets one
        # line. Only global rank 0 (on machine 0) shows progress on the console.
        with (log_dir / LAUNCHER_LOG).open("w") as launcher_log:
            proc = subprocess.Popen(cmd, env=worker_env(setup, cuda, max_restarts, plan.config.distributed),
                                    stdout=None if worker.console and first else launcher_log, stderr=launcher_log)
        rc = proc.wait()
        local_only = finish_uploads(uploader, plan.config, echo) if uploader is not None else []
        if evaluator is not None:
            finish_evals(evaluator, plan.config, echo, wait=rc == 0 and not interrupted and not preempted)
            if uploader is not None:
                store_evals(uploader, plan.config, echo)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if interrupted:
        if first:
            echo(interrupted_line(plan))
        return 130
    if rc != 0:
        user_error = read_user_error(log_dir)
        if user_error:
            raise UserError(user_error)
        log, last = failed_log(log_dir)
        if preempted and not last:  # ranks the notice ended before they could take it (they were starting up)
            kept = latest(plan.config.output_dir)
            echo(f"Stopped by {preempted[0]} before training began: nothing to save; "
                 + (f"continue from {kept} with `opentau resume {plan.config.output_dir}`." if kept else
                    "run the same command again to start."))
            return LOCAL_ONLY_EXIT if local_only else 0
        if log == log_dir:  # no rank got as far as its log
            log = log_dir / LAUNCHER_LOG
        stopped = log_dir / STOPPED
        if stopped.is_file():  # a restarted group found a failure no restart cures (process/restarts.py)
            raise RunError(f"{worker.name} stopped: {stopped.read_text().strip()}. Full log: {log.resolve()}")
        used = sum(1 for r in read_restarts(plan.config.output_dir) if r.get("run_id") == log_dir.name and not r.get("final"))
        after = f" after {used} restart{'s' * (used != 1)}" if used else ""
        # The rank that failed first and how (process/restarts.py), never a peer that only lost it.
        root = failure_of_attempt(log_dir, log_dir, last_attempt(log_dir), setup.machine_rank,
                                  max(1, setup.num_processes // max(1, setup.num_machines)))
        if root.rank is not None and (not root.error or root.error.startswith("hung:")):
            log, last = Path(root.log), root.describe()
        if max_restarts and first:  # every attempt's end is on record, the last one included
            record_final(plan.config.output_dir, log_dir.name, root, None)
        # A rank's own `Error: ...` sentence is said once, in the CLI's own `Error:` line.
        last = last.removeprefix("Error: ").rstrip(".")
        reason = f": {last}" if last else f" (exit code {rc})"
        raise RunError(f"{worker.name} failed{after}{reason}. Full log: {log.resolve()}")
    return LOCAL_ONLY_EXIT if local_only else 0


def start_uploads(plan: RunPlan, log_dir: Path, lease=None):
    """The launcher's uploads of the run's checkpoints to checkpoint.remote (process/uploader.py); a rollback first
    sets the remote's checkpoints newer than the resume point aside, as the local ones were."""
    from opentau_cli.process.uploader import UPLOAD_RETRY_SECONDS, UPLOADS_LOG, Uploader
    from opentau_cli.store.remote_run import RemoteRun
    from opentau_cli.store.storage import open_storage

    cfg = plan.config
    # Each request retries for a few seconds only: the thread's own retries (with backoff, for as long as the run
    # lives) take over from there, and say on the progress line that the store is away.
    options = {**cfg.checkpoint.remote_options, "retry_seconds": UPLOAD_RETRY_SECONDS}
    remote = RemoteRun(open_storage(cfg.checkpoint.remote, options), fence=lease.check if lease else lambda: None)
    protect = plan.resume_from.name if plan.resume_from is not None else None
    record = {"run_dir": str(Path(cfg.output_dir).absolute()), "first_launch": log_dir.name}

    def note(line: str) -> None:
        with open(log_dir / UPLOADS_LOG, "a") as f:
            f.write(time.strftime("%H:%M:%S ") + line + "\n")

    quiet_storage_clients(log_dir / UPLOADS_LOG)

    # Every machine sends its ranks' part of each checkpoint when it keeps its own run directory; machine 0 commits.
    first = plan.setup.machine_rank == 0
    if first and protect is not None:
        # The launch is going ahead: put a missing, garbled or stale `last` in the store right before any upload, as
        # readers go by the manifests and `last` is only a hint (docs/ARCHITECTURE.md, "Remote checkpoints"); fenced
        # by the writer's lease like every pointer (RemoteRun.set_pointer).
        try:
            repaired = remote.repair_last(protect)
        except Exception as e:  # noqa: BLE001 - the hint waits for the next commit, which rewrites it
            note(f"Repairing {remote.url}/checkpoints/last failed ({type(e).__name__}); the next commit rewrites it.")
        else:
            if repaired:
                note(f"Repaired {remote.url}/checkpoints/last: it names {repaired} again.")
    uploader = Uploader(Path(cfg.output_dir), remote, keep_last=cfg.checkpoint.keep_last, protect=protect,
                        record=record, echo=note, commits=first)
    uploader.rollback_to = plan.resume_from.name if plan.remote_rollback and first else None
    return uploader.start()


def quiet_storage_clients(log: Path) -> None:
    """The storage clients' own log records (a cancelled transfer's traceback, a retried request) go to `log`, never
    the console: the launcher says what matters in its own words."""
    import logging

    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S"))
    for name in ("botocore", "boto3", "s3transfer", "awscrt", "urllib3", "fsspec", "concurrent.futures"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False


def finish_uploads(uploader, cfg: TrainConfig, echo) -> list[str]:
    """Wait up to checkpoint.remote_drain_seconds for the pending uploads, saying what it waits for and each retry;
    name what stays local only and return it."""
    seconds = cfg.checkpoint.remote_drain_seconds
    pending = uploader.pending()
    if pending is not None and seconds > 0 and uploader.stopped is None:
        echo(f"Waiting up to {seconds:g} s for checkpoint {pending} to be stored in {uploader.remote.url} ...")
        uploader.loud = echo
    local_only = uploader.drain(seconds)
    if not uploader.commits:
        if local_only:
            echo(f"This machine's part of checkpoint {local_only[0]} is not in {uploader.remote.url} after waiting "
                 f"{seconds:g} s.")
        return local_only
    if uploader.stopped:
        echo(uploader.stopped)
    if not local_only and uploader.remote_last():
        echo(f"Checkpoint {uploader.remote_last()} is stored in {uploader.remote.url}.")
    if local_only:
        many = len(local_only) > 1
        said = f"Checkpoint{'s' * many} {', '.join(local_only)} {'are' if many else 'is'} local only"
        if uploader.stopped:
            echo(f"{said} (this launch may not write to {uploader.remote.url} any more): `opentau resume "
                 f"{uploader.remote.url}` continues the run from the store.")
        else:
            echo(f"{said} (not in {uploader.remote.url} after waiting {seconds:g} s): `opentau checkpoint push "
                 f"{cfg.output_dir}` uploads {'them' if many else 'it'} once the store answers; `opentau resume "
                 f"{uploader.remote.url}` elsewhere continues from {uploader.remote_last() or 'nothing'}.")
    return local_only


def start_evals(plan: RunPlan, log_dir: Path):
    """The launcher's evaluations of the run's published checkpoints in eval.env (process/evaluator.py); its
    processes write to evals.log."""
    from opentau_cli.process.evaluator import Evaluator

    cfg = plan.config

    def note(line: str) -> None:
        with open(log_dir / "evals.log", "a") as f:
            f.write(time.strftime("%H:%M:%S ") + line + "\n")

    return Evaluator(Path(cfg.output_dir), save_freq=cfg.save_freq, every=cfg.eval.every, total_steps=cfg.steps,
                     log=log_dir / "evals.log", echo=note).start()


def evaluate_owed(plan: RunPlan, echo) -> None:
    """A finished run's evaluations that its launch did not finish (stopped by Ctrl-C, or a preemption at the end):
    `opentau resume RUN` runs them, holding the run lock, and launches no rank; with checkpoint.remote their
    records then go to the store (`uploader.push`, which stores the run's history; the command pushed the
    checkpoints and said so before the evaluations)."""
    from opentau_cli.process.evaluator import Evaluator
    from opentau_cli.process.uploader import push

    cfg = plan.config
    with runlock.held(cfg.output_dir):
        probe = Evaluator(Path(cfg.output_dir), save_freq=cfg.save_freq, every=cfg.eval.every, total_steps=cfg.steps,
                          log=Path(os.devnull))
        if not probe.owed():
            return
        finish_evals(start_evals(plan, new_log_dir(cfg.output_dir)), cfg, echo, wait=True)
    if cfg.checkpoint.remote:
        push(cfg.output_dir, cfg.checkpoint.model_dump(), echo=echo, say_up_to_date=False)


def log_late_evaluations(evaluator, cfg: TrainConfig, echo) -> None:
    """W&B gets the evaluations that ended after the ranks, from a process of its own (train/trackers.py, run by
    module name as the evaluations are: the launcher imports no tracker); one that cannot start says so."""
    if "wandb" not in cfg.logging.trackers:
        return
    with open(evaluator.log, "a") as log:
        rc = subprocess.run([sys.executable, "-m", TRACKERS_MODULE, str(cfg.output_dir), cfg.logging.project],
                            stdout=log, stderr=log).returncode
    if rc != 0:
        echo(f"W&B did not take the last evaluations (see {evaluator.log}); they are in "
             f"{Path(cfg.output_dir) / EVALS}, and the next `opentau resume {cfg.output_dir}` logs them.")


def store_evals(uploader, cfg: TrainConfig, echo) -> None:
    """The records of the evaluations that ended after the last commit (the final checkpoint's), into the store
    with the rest of the run's history; a store that does not answer leaves them to the next commit."""
    from opentau_cli.store.remote_run import history_files

    if not uploader.commits or uploader.stopped is not None or not uploader.committed:
        return
    try:
        uploader.remote.store_history(history_files(Path(cfg.output_dir)))
    except Exception as e:  # noqa: BLE001 - the records are on this disk; the next commit carries them
        echo(f"The last evaluations' records are not in {uploader.remote.url} ({type(e).__name__}); they are in "
             f"{Path(cfg.output_dir) / EVALS}, and the next commit of this run stores them.")


def finish_evals(evaluator, cfg: TrainConfig, echo, *, wait: bool) -> None:
    """A run that reached its end waits for its owed evaluations, the final checkpoint's included (Ctrl-C stops
    waiting); a preempted or failed one leaves them to the next launch. Says what is still owed and how to finish."""
    from opentau_cli.store import evals

    if wait:
        if evaluator.pending() or evaluator.unseen():
            echo(f"Evaluating the remaining checkpoints in {cfg.eval.env} (Ctrl-C leaves them for `opentau resume "
                 f"{cfg.output_dir}`)...")
        left = evaluator.finish()
        log_late_evaluations(evaluator, cfg, echo)
    else:
        evaluator.stop()
        left = evaluator.pending()
    if left:
        echo(f"Checkpoint{'s' * (len(left) > 1)} {', '.join(left)} {'are' if len(left) > 1 else 'is'} not evaluated "
             f"yet: `opentau resume {cfg.output_dir}` evaluates {'them' if len(left) > 1 else 'it'} first.")
    done = {n: r for n, r in evals.records(cfg.output_dir).items() if r.get("status") == evals.DONE}
    if done:
        last = max(done, key=int)
        best = max(done, key=lambda n: (done[n]["success_rate"], int(n)))
        echo(f"Success rate in {cfg.eval.env}: {done[last]['success_rate']:.1%} at checkpoint {last} (the last "
             f"evaluated); the best is checkpoint {best} with {done[best]['success_rate']:.1%}.")
