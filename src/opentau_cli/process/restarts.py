"""Automatic restarts: what a rank does when torch's elastic agent restarts the worker group (docs/ARCHITECTURE.md,
"Restarts").

The agent (`accelerate launch --max_restarts N --rdzv_backend c10d`) restarts every rank when one fails; it knows
nothing of checkpoints. A restarted rank (TORCHELASTIC_RESTART_COUNT > 0) finds here why the previous attempt ended
(the agent's `failed (exitcode: ...)` line in its machine's launcher.log, that rank's log, the step each rank was at),
decides whether a restart can cure it, and continues from the run's `last` checkpoint as `opentau resume` would.
A failure no restart can cure (bad input, a checkpoint that fails verification, the same step failing twice) ends the
launch at once: the rank says why, writes it to `<run log dir>/stopped`, and kills its agent, whose other ranks die
with it (runtime.die_with_parent).

`Watchdog` turns a hang into a failure: a rank that finishes no step, validation or save within
distributed.timeout_minutes exits 1, so the agent restarts the group instead of waiting forever.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from opentau_cli.process.runtime import ATTEMPT_MARK, MACHINE_MARK, USER_ERROR_MARK, attempt, kill_agent, max_restarts, rank_log
from opentau_cli.store.layout import LAUNCHER_LOG, LOGS

RESTARTS = "restarts.jsonl"  # <run>/logs/restarts.jsonl: one line per automatic restart, every launch of the run
STOPPED = "stopped"  # <run log dir>/stopped: why a restarted launch ended without using its remaining restarts
GROUPS = "groups.jsonl"  # <run log dir>/groups.jsonl: each worker group of the launch (attempt, world size)
# Errors a rank reports when another rank died first: never the root cause.
# A data worker stopped by SIGTERM: the launcher stopping the group after another rank failed.
KNOCK_ON = ("Connection closed by peer", "Connection reset by peer", "ProcessGroupGloo", "NCCL communicator was aborted",
            "is killed by signal: Terminated")
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def fit_to_world(cfg, setup):
    """(cfg, setup) for the world this group has. A group of an elastic launch may re-form on fewer or more machines
    than the launch planned for (distributed.machines); it keeps the run's global batch (the planned per-process
    batch x processes) as `opentau resume --reshard=true` does, and the checkpoint it continues from is resharded
    (train/reshard.py). Unchanged for a group of the planned size."""
    from dataclasses import replace

    from opentau_cli.store.topology import fit_global_batch

    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    if not world or world == setup.world_size:
        return cfg, setup
    fitted = fit_global_batch(cfg.model_dump(), setup.world_size, world, {})
    per_machine = setup.num_processes // setup.num_machines
    return (cfg.model_copy(update=fitted),
            replace(setup, num_processes=world, num_machines=max(1, world // per_machine)))


def group_change(run_log_dir: Path, world: int) -> dict | None:
    """None for the launch's first worker group; else how this group follows the previous one: after a failure (the
    agent counted a restart) or because machines joined (torch's agent re-forms a healthy group when a machine
    asks to join, without counting a restart)."""
    try:
        lines = (Path(run_log_dir) / GROUPS).read_text().splitlines()
    except OSError:
        return None
    groups = [json.loads(line) for line in lines if line.strip()]
    if not groups:
        return None
    before = groups[-1]
    return {"machines_changed": before["attempt"] == attempt(), "world_before": before["world"], "world": world,
            "placement": before.get("placement")}


def note_group(run_log_dir: Path, world: int, placement: list[int] | None = None) -> None:
    """Note this group: its attempt, world and the machine of each global rank (a rank whose log lies on a lost
    machine's disk is still named with its machine)."""
    with (Path(run_log_dir) / GROUPS).open("a") as f:
        f.write(json.dumps({"attempt": attempt(), "world": world, "time": time.time(), "placement": placement}) + "\n")


def machines_changed(change: dict, world: int) -> "Failure":
    """The cause of a group re-formed because machines joined."""
    return Failure(rank=None, machine=0, exit_code=None, error="", log="", failed_at_step=None,
                   regroup=f"machines joined: {world} processes now, {change['world_before']} before",
                   world_before=change["world_before"])


def restarts_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOGS / RESTARTS


def read_restarts(run_dir: Path) -> list[dict]:
    """Every restart the run recorded, oldest first (unreadable lines skipped: a crash can tear the last one)."""
    path = restarts_path(run_dir)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def exit_description(code: int) -> str:
    """'was killed by SIGKILL' / 'exited with code 1', for a worker's exit status as the agent reports it."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Failure:
    """Why one attempt of a launch ended, as far as this machine can tell."""

    rank: int | None  # global rank of the first rank that failed (None: the agent's log does not say)
    machine: int
    exit_code: int | None
    error: str  # the last error line of that rank's log for that attempt ('' for a kill)
    log: str
    failed_at_step: int | None  # the step the ranks were running when it failed (the highest any rank had started)
    regroup: str = ""  # not a failure: the group re-formed because machines joined (elastic machines)
    world_before: int | None = None  # the failed group's number of processes

    def describe(self) -> str:
        if self.regroup:
            return self.regroup
        who = f"rank {self.rank} on machine {self.machine}" if self.rank is not None else f"a rank on machine {self.machine}"
        if self.exit_code is not None:
            how = exit_description(self.exit_code)
        elif self.error.startswith("hung:"):
            how = "stopped responding"
        else:
            # The agent names only the first failure it saw: a kill it did not name is still said as a kill.
            how = "failed" if self.error else "was killed (its log ends without an error)"
        at = f" at step {self.failed_at_step}" if self.failed_at_step is not None else ""
        error = f" ({self.error})" if self.error else ""
        return f"{who} {how}{at}{error}"


def attempt_segment(text: str, number: int) -> str:
    """The part of a rank log that attempt `number` wrote (between its mark and the next one)."""
    marks = [m for m in re.finditer(rf"^{re.escape(ATTEMPT_MARK)}(\d+)$", text, re.M)]
    starts = [m for m in marks if int(m.group(1)) == number]
    if not starts:
        return text if number == 0 and not marks else ""
    begin = starts[-1].end()
    later = [m.start() for m in marks if m.start() > begin]
    return text[begin:min(later)] if later else text[begin:]


def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error:") or re.match(r"^\w+(\.\w+)*(Error|Exception)\b", ln)]
    return errors[-1] if errors else ""


def agent_failures(launcher_log: Path) -> list[tuple[int, int]]:
    """(exit code, local rank) of every failure the elastic agent logged, in order: the k-th ended attempt k-1."""
    try:
        text = launcher_log.read_text(errors="replace")
    except OSError:
        return []
    return [(int(m.group(1)), int(m.group(2))) for m in _FAILED.finditer(text)]


_SUMMARY = re.compile(r"rank\s*:\s*\d+ \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def agent_summary(launcher_log: Path) -> dict[int, int]:
    """Exit code by local rank from the summary the agent prints when it gives up (every failed rank of the last
    attempt, not only the first it saw)."""
    try:
        text = launcher_log.read_text(errors="replace")
    except OSError:
        return {}
    return {int(m.group(1)): int(m.group(2)) for m in _SUMMARY.finditer(text)}


def is_knock_on(error: str) -> bool:
    return any(k in error for k in KNOCK_ON)


def is_timeout(error: str) -> bool:
    """A rank that gave up waiting (a collective's timeout, the watchdog): the one it waited for is the root."""
    return any(k in error.lower() for k in ("timed out", "timeout", "made no progress"))


def previous_failure(launch: dict, run_log_dir: Path, machine: int, procs_per_machine: int,
                     placement: list[int] | None = None) -> Failure:
    """Why attempt `attempt() - 1` ended (failure_of_attempt)."""
    return failure_of_attempt(Path(launch["log_dir"]), run_log_dir, attempt() - 1, machine, procs_per_machine, placement)


def last_attempt(run_log_dir: Path) -> int:
    """The number of the newest attempt the launch's rank logs hold (0 without restarts)."""
    numbers = [0]
    for log in Path(run_log_dir).glob("rank*.log"):
        try:
            numbers += [int(m.group(1)) for m in re.finditer(rf"^{re.escape(ATTEMPT_MARK)}(\d+)$", log.read_text(errors="replace"), re.M)]
        except OSError:
            continue
    return max(numbers)


def failure_of_attempt(launch_log_dir: Path, run_log_dir: Path, number: int, machine: int,
                       procs_per_machine: int, placement: list[int] | None = None) -> Failure:
    """Why attempt `number` of a launch ended. The ranks' own logs name the root: a rank that failed with an error of
    its own, else one whose log ends without an error (killed: SIGKILL, the OOM killer, a lost device), never one
    that only lost its peer. The agent's failure line adds the exit code when it names that rank (it names the first
    failure it saw, to the second, which may be a peer's knock-on error)."""

    failures = agent_failures(Path(launch_log_dir) / LAUNCHER_LOG)
    code, local = failures[number] if len(failures) > number else (None, None)
    errors, placed = {}, {}
    for log in Path(run_log_dir).glob("rank*.log"):
        if log.stem[4:].isdigit():
            errors[int(log.stem[4:])] = last_error_line(attempt_segment(log.read_text(errors="replace"), number))
            placed[int(log.stem[4:])] = placement_of(log, number)
    # A rank the group placed on another machine whose log is not on this disk (machines that keep their own run
    # directories) said nothing here: silent, on its recorded machine.
    for rank, where in enumerate(placement or []):
        if where != machine and (rank not in placed or placed[rank] is None):
            errors.setdefault(rank, "")
            placed[rank] = (where, None)
    # The rank the agent names: its machine and local rank, wherever the rendezvous put it in the global order.
    agent_rank = next((r for r, where in placed.items() if where == (machine, local)),
                      machine * procs_per_machine + local if local is not None else None) if local is not None else None
    own = [r for r in sorted(errors) if errors[r] and not is_knock_on(errors[r]) and not is_timeout(errors[r])]
    silent = [r for r in sorted(errors) if not errors[r]]
    waited = [r for r in sorted(errors) if errors[r] and is_timeout(errors[r])]
    if own:
        rank = own[0]
    elif silent:
        rank = agent_rank if agent_rank in silent else silent[0]
    else:
        rank = waited[0] if waited else agent_rank
    error = errors.get(rank, "") if rank is not None else ""
    if rank is not None and rank != agent_rank:
        machine = (placed.get(rank) or (rank // procs_per_machine, 0))[0]
    if not error and waited:  # a rank that went silent while its peers timed out waiting for it: a hang
        error = f"hung: rank {waited[0]} reports {errors[waited[0]]}"
    if rank is not None and rank != agent_rank and len(failures) == number + 1:
        # The attempt that made the agent give up: its summary names every failed rank's exit.
        where = placed.get(rank) or (rank // procs_per_machine, rank % procs_per_machine)
        code, agent_rank = agent_summary(Path(launch_log_dir) / LAUNCHER_LOG).get(where[1]), rank
    return Failure(rank=rank, machine=machine, exit_code=code if rank == agent_rank else None, error=error,
                   log=str(rank_log(run_log_dir, rank if rank is not None else 0).resolve()),
                   failed_at_step=started_step(run_log_dir))


def placement_of(log: Path, number: int) -> tuple[int, int] | None:
    """(machine, local rank) of a rank in attempt `number`, as its log's marks say."""
    try:
        segment = attempt_segment(log.read_text(errors="replace"), number)
    except OSError:
        return None
    found = re.search(rf"^{re.escape(MACHINE_MARK)}(\d+) local_rank (\d+)$", segment, re.M)
    return (int(found.group(1)), int(found.group(2))) if found else None


def user_error_of_attempt(run_log_dir: Path, number: int) -> str | None:
    """The one-line user error a rank of attempt `number` stopped on, if any."""

    for log in sorted(Path(run_log_dir).glob("rank*.log")):
        for line in attempt_segment(log.read_text(errors="replace"), number).splitlines():
            if line.startswith(USER_ERROR_MARK):
                return line[len(USER_ERROR_MARK):]
    return None


class StepMarks:
    """Each rank keeps the step it is running in `<run log dir>/rank<N>.step` (one pwrite per step, only when
    restarts are on), so the next attempt knows where the failed one stopped: a step that fails twice ends the run."""

    def __init__(self, run_log_dir: Path, rank: int):
        self.fd = os.open(Path(run_log_dir) / f"rank{rank}.step", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def running(self, step: int) -> None:
        os.pwrite(self.fd, f"{step:>12}\n".encode(), 0)


def started_step(run_log_dir: Path) -> int | None:
    steps = []
    for path in Path(run_log_dir).glob("rank*.step"):
        try:
            steps.append(int(path.read_text().strip()))
        except (OSError, ValueError):
            continue
    return max(steps) if steps else None


def incurable(failure: Failure, run_dir: Path, run_log_dir: Path, resume_from: Path | None) -> str | None:
    """Why restarting again cannot help, or None: bad input, or the same step failing again after a restart that
    resumed from the same checkpoint."""
    user_error = user_error_of_attempt(run_log_dir, attempt() - 1)
    if user_error:
        return user_error
    earlier = [r for r in read_restarts(run_dir) if r.get("run_id") == run_log_dir.name and not r.get("final")]
    if earlier and failure.failed_at_step is not None and earlier[-1].get("failed_at_step") == failure.failed_at_step \
            and earlier[-1].get("resumed_from") == (resume_from.name if resume_from else None):
        return (f"step {failure.failed_at_step} failed again after restart {earlier[-1].get('restart')} "
                f"({failure.describe()}); a restart cannot cure a failure that repeats")
    return None


def stop_launch(run_log_dir: Path, reason: str) -> None:
    """End the launch now, without the agent's remaining restarts: record why, then kill this rank's agent (the
    ranks die with it). Only for a failure no restart can cure."""
    try:
        (Path(run_log_dir) / STOPPED).write_text(reason + "\n")
    except OSError:
        pass
    print(f"Stopping the launch: {reason}", flush=True)
    kill_agent()
    time.sleep(30)  # the kernel kills this rank with its agent (PR_SET_PDEATHSIG)
    os._exit(1)


def record_restart(run_dir: Path, run_id: str, failure: Failure, resumed_from: Path | None, step: int,
                   world: int | None = None) -> dict:
    """Append this restart to <run>/logs/restarts.jsonl (the leader) and return the record."""
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "run_id": run_id, "restart": attempt(),
              "max_restarts": max_restarts(), "cause": failure.describe(), **asdict(failure),
              "resumed_from": resumed_from.name if resumed_from else None, "step": step,
              "world": world}
    path = restarts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return record


def record_final(run_dir: Path, run_id: str, failure: Failure, step: int | None) -> dict:
    """Append the failure that ended a restartable launch, with no restart left, to restarts.jsonl (the launcher, once
    its ranks are gone): every attempt's end is on record, the last included."""
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "run_id": run_id, "restart": None, "final": True,
              "max_restarts": None, "cause": failure.describe(), **asdict(failure), "resumed_from": None, "step": step,
              "world": None}
    path = restarts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def restart_line(record: dict) -> str:
    resumed = f"resumed from checkpoint {record['resumed_from']}" if record.get("resumed_from") else "started over (no checkpoint yet)"
    world, before = record.get("world"), record.get("world_before")
    on = f" on {world} process{'es' * (world != 1)} (was {before})" if world and before and world != before else ""
    if record.get("regroup"):
        return f"Group re-formed: {record['cause']}; {resumed} at step {record['step']}{on}."
    return (f"Restart {record['restart']} of {record['max_restarts']}: {record['cause']}; {resumed} at step "
            f"{record['step']}{on}. Log: {record['log']}")


class Watchdog:
    """Exit this rank (code 1) when `beat` has not been called for `timeout_s`: a hang outside a collective (a stuck
    data loader, a wedged device) becomes a failure the agent restarts; a hang inside one is the process group's
    timeout (the same setting)."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self.step = 0
        self.last = time.monotonic()
        thread = threading.Thread(target=self._watch, name="opentau-watchdog", daemon=True)
        thread.start()

    def beat(self, step: int | None = None) -> None:
        self.last = time.monotonic()
        if step is not None:
            self.step = step

    def stop(self) -> None:
        """No more watching: the loop is over (the last save's wait and the teardown take what they take)."""
        self.timeout_s = float("inf")

    def _watch(self) -> None:
        while True:
            time.sleep(min(5.0, self.timeout_s / 4) if self.timeout_s != float("inf") else 5.0)
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                print(f"Error: rank {self.rank} made no progress for {idle:.0f} s after step {self.step} "
                      f"(distributed.timeout_minutes = {self.timeout_s / 60:g}); stopping it as hung.", flush=True)
                os._exit(1)
