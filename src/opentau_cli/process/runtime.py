"""The life of one process that `accelerate launch` starts: docs/ARCHITECTURE.md "Per-rank runtime".

The train worker, the profile worker and the test helpers all run this way: output to `<log_dir>/rank<N>.log`, a
`UserError` as one marked line and exit 2, a `RunError` as one `Error:` line and exit 1, anything else as a traceback
and exit 1; then the process group is destroyed and the process leaves with `os._exit` after flushing. The launcher
reads the marked line back with `read_user_error`, the same way for every command.

Import nothing heavy here: the launcher imports this module to read rank logs.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import IO, Callable, NoReturn

USER_ERROR_MARK = "opentau-user-error: "
ATTEMPT_MARK = "opentau-attempt: "  # a rank log line where each attempt of a restartable launch begins
MACHINE_MARK = "opentau-machine: "  # the next line: the machine (its --machine_rank) and local rank of that attempt
# What every rank imports before it builds anything, in this order; DeepSpeed only in a DeepSpeed launch's ranks
# (import_rank_libraries).
RANK_IMPORTS = ("opentau_cli.config", "torch", "accelerate", "deepspeed", "opentau_cli.policies")
# What a library imports at its own import only for a feature opentau never uses, kept out while it imports
# (docs/ARCHITECTURE.md, "Start-up"): DeepSpeed's autotuner imports MLflow whenever it is installed, a second of CPU in
# every rank; Accelerate's SageMaker settings import boto3 (a quarter of a second in the launcher and every rank);
# transformers' object-detection losses import scipy.optimize (half a second wherever the policy is imported) when
# transformers found scipy at its own import, which it asks once. A run that logs to MLflow or reads its data with
# boto3 imports it later as usual, as a simulator does scipy.
UNUSED_IMPORTS = {"deepspeed": ("mlflow",), "accelerate": ("boto3",), "accelerate.commands.launch": ("boto3",),
                  "transformers": ("scipy",)}


def die_with_parent() -> None:
    """Be killed (SIGKILL) when the process that started this one dies, however it dies: torch's elastic agent starts
    each rank in a session of its own, so a signal to the launch's process group never reaches the ranks, and a rank
    whose launcher was SIGKILLed or OOM-killed would train on as an orphan, writing into a run whose lock died with the
    launcher (docs/ARCHITECTURE.md, "Per-rank runtime"). Linux's PR_SET_PDEATHSIG; elsewhere a no-op. A parent that
    died before the request took effect is caught by its pid changing."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def run_rank(work: Callable[..., int], argv: list[str] | None = None, *, description: str | None = None) -> NoReturn:
    """Run `work(cfg, setup, launch, console)` as one rank of a launch and exit with its code (see the module doc).

    `--config` is the resolved train_config.json and `--launch` the launch.json that the launcher wrote; `console`
    is the launcher's terminal on rank 0 (None on the other ranks).
    """
    die_with_parent()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="The resolved train_config.json written by the launcher.")
    parser.add_argument("--launch", required=True, help="launch.json: accelerate setup, resume checkpoint, log dir, run id.")
    args = parser.parse_args(argv)
    launch = json.loads(Path(args.launch).read_text())
    # The console is machine 0's launcher's terminal, for machine 0's first rank: with restarts over several machines
    # global rank 0 may be elsewhere (train/worker.py agree_run_id).
    shows = int(os.environ.get("LOCAL_RANK", "0") or 0) == 0 and not int(launch["accelerate"].get("machine_rank", 0) or 0)
    console = redirect_output(Path(launch["log_dir"]), int(os.environ.get("RANK", "0")), shows)
    restartable = max_restarts() > 0
    if restartable:
        mark_attempt(int(launch["accelerate"].get("machine_rank", 0) or 0))
    try:
        import_rank_libraries(launch["accelerate"].get("backend", "single"))
        from opentau_cli.config import TrainConfig, setup_from_dict

        cfg = TrainConfig.model_validate(json.loads(Path(args.config).read_text()))
        code = work(cfg, setup_from_dict(launch["accelerate"]), launch, console)
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:
        code = report_failure(e)
    if code == 2 and restartable:
        # No restart cures bad input: end the launch now rather than let torch's elastic agent burn its restarts on
        # it (the launcher reads the marked line). docs/ARCHITECTURE.md, "Restarts".
        kill_agent()
    exit_rank(code)


# Signals that mean "finish the current step, save, exit 0" (cluster preemption).
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_FILE = "preempted"  # <launch log dir>/preempted: the launcher received a preemption notice
_RECEIVED: list[str] = []  # the preemption signals this rank received before the worker took them over


def catch_preemption() -> None:
    """From the train rank's first instant (before run_rank), a preemption notice is kept, not fatal: a rank still
    importing when the launcher forwards it would otherwise die of it, and an automatic restart would take that for a
    failure (docs/ARCHITECTURE.md, "Restarts"). The worker reads it with `preemption_received`."""
    for s in PREEMPT_SIGNALS:
        signal.signal(s, lambda signum, _frame: _RECEIVED.append(signal.Signals(signum).name))


def preemption_received(launch_log_dir: Path) -> str | None:
    """The preemption signal this rank (or, before it started, its launcher) received, if any."""
    if _RECEIVED:
        return _RECEIVED[0]
    try:
        return (Path(launch_log_dir) / PREEMPTED_FILE).read_text().strip() or "SIGTERM"
    except OSError:
        return None


def redirect_output(log_dir: Path, rank: int, shows_console: bool) -> IO | None:
    """Send this rank's stdout/stderr (Python and C level) to its log file; return a handle on the console for the
    rank that shows it."""
    console = os.fdopen(os.dup(1), "w", buffering=1) if shows_console else None
    log = open(rank_log(log_dir, rank), "a", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    return console


def import_paused(*modules: str) -> None:
    """Import `modules` with the garbage collector paused, then freeze every object made so far.

    Importing torch, transformers, accelerate and DeepSpeed makes about a million objects that live as long as the
    process; the collector's passes over them while they are being made cost an eighth of the import time or more
    (docs/ARCHITECTURE.md, "Start-up"). Frozen, they are skipped by every later pass, the training loop's too.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in modules:
            hidden = [m for m in UNUSED_IMPORTS.get(name, ()) if m not in sys.modules]
            sys.modules.update(dict.fromkeys(hidden))  # None: `import mlflow` raises ImportError, which DeepSpeed takes
            try:
                importlib.import_module(name)
            finally:
                for m in hidden:
                    if sys.modules.get(m, "") is None:
                        del sys.modules[m]
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def import_rank_libraries(backend: str) -> None:
    """What a rank of a `backend` launch imports before it builds anything (RANK_IMPORTS), through import_paused.

    DeepSpeed only for a DeepSpeed launch: Accelerate's unwrap_model and transformers import it whenever it is
    installed, only to look for its engine. A rank of any other launch keeps it out for good (None in sys.modules), so
    they find it not installed: about 0.4 s of CPU less per rank (docs/ARCHITECTURE.md, "Start-up")."""
    if backend != "deepspeed":
        sys.modules.setdefault("deepspeed", None)
    import_paused(*[name for name in RANK_IMPORTS if sys.modules.get(name, "") is not None])


def rank_log(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.log"


def join_run_logs(log_dir: Path, run_log_dir: Path, rank: int) -> None:
    """Move this rank's log from its machine's launch dir into the run's log dir (the one global rank 0's launcher
    made), leaving a link behind so that machine's launcher still finds it. The file keeps being written: the open
    descriptor follows the rename. A no-op on the machine of rank 0."""
    if Path(log_dir).resolve() == Path(run_log_dir).resolve():
        return
    Path(run_log_dir).mkdir(parents=True, exist_ok=True)
    here, there = rank_log(log_dir, rank), rank_log(run_log_dir, rank)
    if here.is_symlink():  # an earlier group of this launch linked it: this rank already writes through the link
        return
    if not there.exists():
        os.replace(here, there)
    else:
        # Another group of the run had this rank number (elastic machines re-number ranks): continue its log.
        sys.stdout.flush()
        sys.stderr.flush()
        with open(there, "ab") as out:
            out.write(here.read_bytes())
        fd = os.open(there, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        here.unlink()
    os.symlink(os.path.relpath(there, log_dir), here)


def report_failure(e: BaseException) -> int:
    """Print a failure the way the launcher reads it (call inside `except`); returns the exit code."""
    from opentau_cli.errors import RunError, UserError

    if isinstance(e, UserError):
        print(f"{USER_ERROR_MARK}{e}", flush=True)
        return 2
    if isinstance(e, RunError):
        print(f"Error: {e}", flush=True)
        return 1
    traceback.print_exc()
    sys.stderr.flush()
    return 1


def read_user_error(log_dir: Path) -> str | None:
    """The launcher's side of report_failure: the message of a rank that stopped on bad input, if one did."""
    for log in sorted(log_dir.glob("rank*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(USER_ERROR_MARK):
                return line[len(USER_ERROR_MARK):]
    return None


def close_process_group() -> None:
    """Tear down torch.distributed before exit: a process that exits with gloo's threads still running can abort
    ("terminate called without an active exception") after its work is done."""
    dist = sys.modules.get("torch.distributed")  # never imported: no group to close (and no torch import to pay)
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# Objects a rank keeps until os._exit: freeing a DDP model runs its Reducer's native destructor, which can deadlock
# with a gloo thread that is releasing a finished collective and waits for the GIL (seen: a finished demo run hung).
_KEPT: list = []


def keep_until_exit(obj) -> None:
    """Never free `obj` (e.g. the trainer, which holds the DDP model and the process group) before the rank exits."""
    _KEPT.append(obj)


def exit_rank(code: int) -> NoReturn:
    """Close the process group, flush, and leave without native teardown: with the work done and the logs flushed,
    gloo / DeepSpeed threads torn down at interpreter exit sometimes abort a rank, failing a finished run."""
    close_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Under torch's elastic agent (automatic restarts, docs/ARCHITECTURE.md "Restarts").

def attempt() -> int:
    """0 for the launch's first worker group, k for its k-th restart (set by torch's elastic agent)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def max_restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def mark_attempt(machine: int) -> None:
    """Where this attempt begins in the rank log (which every attempt appends to), and on which machine: with
    elastic machines a global rank may run on another machine after a re-forming."""
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    print(f"{ATTEMPT_MARK}{attempt()}\n{MACHINE_MARK}{machine} local_rank {local}", flush=True)


def kill_agent() -> None:
    """SIGKILL this rank's elastic agent, ending the launch without its remaining restarts; this rank and the
    others of the machine die with it (die_with_parent)."""
    os.kill(os.getppid(), signal.SIGKILL)
