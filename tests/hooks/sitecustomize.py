"""Test- and benchmark-only: the one fault-injection helper for a launched `opentau` process (docs/ARCHITECTURE.md,
"Fault injection in tests").

Put this directory on PYTHONPATH and set the variable of each hook wanted (HOOKS, at the end: one variable per hook,
its value the hook's setting; several hooks combine). Every Python process of the launch (the `opentau` command,
torch's agent, the ranks, their data workers) reads this file at start-up; a process with none of the variables is
untouched. A hook patches the product where a test needs a moment or a measurement, when the module it patches is
imported (`after_import`), and a rank's record is written as the rank leaves (`at_rank_exit`).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
_PATCHES: dict[str, list] = {}  # module name -> what to call with the module once it is imported


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        patches = _PATCHES.pop(name, None)
        if patches is None:
            return None
        spec = importlib.util.find_spec(name)  # the real spec: this finder no longer answers for `name`
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


def after_import(name: str, patch) -> None:
    """Call `patch(module)` once module `name` is imported, in whichever process imports it."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    _PATCHES.setdefault(name, []).append(patch)


def at_rank_exit(write) -> None:
    """Call `write()` as a rank leaves: process/runtime.py's exit_rank ends in os._exit, so atexit never runs."""
    def patch(runtime):
        leave = runtime.exit_rank

        def exit_rank(code):
            write()
            leave(code)

        runtime.exit_rank = exit_rank

    after_import("opentau_cli.process.runtime", patch)


def rank() -> str:
    return os.environ.get("RANK", "0")


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


# Faults


def fail_a_step(spec: str) -> None:
    """TEST_FAULT=ACTION@STEP:ATTEMPT[,...]: one rank (TEST_FAULT_RANK, default 1; `any`: whichever rank the process
    gets, as under elastic machines) acts just before it starts step STEP in attempt ATTEMPT (`*`: every attempt).
    `kill` SIGKILLs itself (a lost node, the OOM killer); `machine` SIGKILLs its launcher's process group (the whole
    machine leaves); `hold` waits for a SIGTERM (the agent re-forming the group) and then runs the step as a requested
    stop; `stop` SIGSTOPs itself (a hang); `raise` raises a RuntimeError (a crash in the step); `user` raises the
    product's UserError (bad input found late); `wait` only waits for TEST_FAULT_AFTER. TEST_FAULT_AFTER=FILE[#TEXT]:
    it first waits (up to 300 s) until FILE exists (and holds TEXT, whitespace aside).
    TEST_FAULT_TIMES=FILE: it appends the wall-clock time of each moment (its start, the fault, the start and end of
    each attempt's first step) to FILE as JSON lines (benchmarks/bench_restart.py times a restart with them)."""
    if os.environ.get("TEST_FAULT_RANK", "1") not in ("any", os.environ.get("RANK", "")):
        return
    faults = {}
    for item in spec.split(","):
        action, _, rest = item.partition("@")
        step, _, when = rest.partition(":")
        if when in ("*", str(attempt())):
            faults[int(step)] = action

    def note(event: str) -> None:
        if os.environ.get("TEST_FAULT_TIMES"):
            with open(os.environ["TEST_FAULT_TIMES"], "a") as f:
                f.write(json.dumps({"event": event, "t": time.time(), "attempt": attempt()}) + "\n")

    def act(action: str) -> bool:  # True: the step runs as a requested stop (`hold` got its signal)
        after, deadline = os.environ.get("TEST_FAULT_AFTER"), time.time() + 300
        while after and not file_holds(*after.partition("#")[::2]) and time.time() < deadline:
            time.sleep(0.1)
        note(action)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "machine":
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            signal.pause()  # dies with its agent
        if action == "hold":
            return hold_until_sigterm()
        if action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if action == "raise":
            raise RuntimeError("injected fault: a crash in the step")
        if action == "user":
            from opentau_cli.errors import UserError

            raise UserError("injected fault: episode 3 of the dataset is unreadable.")
        return False

    def patch(trainer):
        step, first = trainer.Trainer.train_step, [True]

        def train_step(self, *args, **kwargs):
            action = faults.get(self.step + 1)
            if action and act(action):
                kwargs["stop_requested"] = True
            if not first[0]:
                return step(self, *args, **kwargs)
            first[0] = False
            note("first_step_start")
            result = step(self, *args, **kwargs)
            note("first_step_end")
            return result

        trainer.Trainer.train_step = train_step

    note("start")
    after_import("opentau_cli.train.trainer", patch)


def file_holds(path: str, text: str) -> bool:
    """FILE exists and holds TEXT (whitespace aside: a JSON file's spacing is not the point)."""
    try:
        return "".join(text.split()) in "".join(Path(path).read_text().split())
    except OSError:
        return False


def hold_until_sigterm() -> bool:
    """Wait (up to 300 s) for the SIGTERM with which the agent stops the group to admit a joining machine."""
    import threading

    received, previous = threading.Event(), signal.getsignal(signal.SIGTERM)

    def handle(signum, frame):
        received.set()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, handle)
    return received.wait(300)


def kill_at_save_moment(spec: str) -> None:
    """TEST_KILL_AT=MOMENT@STEP (a moment of tests/save_faults.py): when rank TEST_KILL_RANK (default 0) reaches
    MOMENT in the save of STEP, it SIGKILLs the launcher, Accelerate's agent, every other rank and itself, as a node
    failure would; TEST_KILL_SIGNAL=SIGTERM (or another signal's name) instead sends that signal to the launcher alone,
    as a scheduler preempting the job does, and the run goes on. The launcher must lead its own session (the test
    starts it with start_new_session=True): that is how the hook finds the top of the run."""
    moment, _, step = spec.partition("@")
    if rank() != os.environ.get("TEST_KILL_RANK", "0"):
        return
    sys.path.append(str(TESTS))
    from save_faults import arm

    def launcher():
        import psutil

        return next((p for p in psutil.Process().parents() if os.getpgid(p.pid) == p.pid), None)

    def kill_the_run() -> None:
        import psutil

        top = launcher()
        for p in [p for p in ([top] + top.children(recursive=True) if top else []) if p.pid != os.getpid()]:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    name = os.environ.get("TEST_KILL_SIGNAL")
    arm(moment, int(step), (lambda: launcher().send_signal(signal.Signals[name])) if name else kill_the_run,
        rank=int(rank()))


def kill_tool_at_point(spec: str) -> None:
    """TEST_KILL_POINT=NAME[:SIGNAL], NAME one of opentau_cli.store.faults.TOOL_POINTS: the first time an offline
    command (consolidate, export) reaches NAME it sends itself SIGNAL (SIGKILL by default; SIGTERM as `kill`,
    `timeout` or a job's time limit sends it)."""
    name, _, sig = spec.partition(":")

    def patch(faults):
        assert name in faults.TOOL_POINTS, f"{name!r} is not a named moment of the tools' writes"
        struck = []

        def strike(point: str, _path) -> None:
            if point == name and not struck:
                struck.append(point)
                os.kill(os.getpid(), signal.Signals[sig or "SIGKILL"])

        faults.hooks.append(strike)

    after_import("opentau_cli.store.faults", patch)


def hold_upload(directory: str) -> None:
    """TEST_UPLOAD_DIR=DIR: every commit of a checkpoint to the store appends {"name", "t"} to DIR/commits.jsonl.
    TEST_UPLOAD_HOLD=NAME (a checkpoint's name) or #N (the launch's N-th upload): that upload stops after its first
    file is stored, writes the checkpoint's name to DIR/held and waits until DIR/release exists (the test meanwhile
    stops the store, kills the run, ...). TEST_UPLOAD_PACE=NAME: a rank's save of any later checkpoint first waits (up
    to 300 s) until NAME is committed: the uploader follows `last`, so without it a fast run can publish the next
    checkpoint before the first upload starts and NAME is (rightly) never uploaded."""
    where, hold, pace = Path(directory), os.environ.get("TEST_UPLOAD_HOLD") or "", os.environ.get("TEST_UPLOAD_PACE")
    commits, uploads = where / "commits.jsonl", []

    def patch_remote_run(module):
        upload, commit = module.RemoteRun.upload, module.RemoteRun.commit

        def held_upload(self, name, files, manifest, *, progress=lambda n: None, **kwargs):
            if name not in uploads:
                uploads.append(name)
            chosen = hold == f"#{uploads.index(name) + 1}" if hold.startswith("#") else hold == name
            if not chosen or (where / "held").exists():
                return upload(self, name, files, manifest, progress=progress, **kwargs)
            first = [True]

            def after_each(n):
                progress(n)
                if first[0]:
                    first[0] = False
                    # Written beside and renamed in: a test that sees `held` reads the whole name.
                    (where / "held.tmp").write_text(name)
                    os.replace(where / "held.tmp", where / "held")
                    while not (where / "release").exists():
                        time.sleep(0.05)

            return upload(self, name, files, manifest, progress=after_each, **kwargs)

        def recorded_commit(self, name, *args, **kwargs):
            commit(self, name, *args, **kwargs)
            with open(commits, "a") as f:
                f.write(json.dumps({"name": name, "t": time.time()}) + "\n")

        module.RemoteRun.upload, module.RemoteRun.commit = held_upload, recorded_commit

    def patch_manager(module):
        save = module.CheckpointManager.save

        def paced_save(self, step, *args, **kwargs):
            deadline = time.time() + 300
            while step > int(pace) and time.time() < deadline and not (commits.exists()
                                                                       and f'"{pace}"' in commits.read_text()):
                time.sleep(0.1)
            return save(self, step, *args, **kwargs)

        module.CheckpointManager.save = paced_save

    after_import("opentau_cli.store.remote_run", patch_remote_run)
    if pace:
        after_import("opentau_cli.train.manager", patch_manager)


def store_outage(directory: str) -> None:
    """TEST_OUTAGE_DIR=DIR: whenever DIR/arm exists, the next download of a dataset file by any process of the launch
    (a rank or a data worker) claims the outage: it creates DIR/request, waits until the test has stopped the store
    (DIR/down) and goes on with the download, which then meets the store gone. What happens from there (retries,
    waiting, giving up) is the product's own."""
    def patch(remote):
        download = remote.RemoteFiles._download

        def outage_first(self, rel, pin, out):
            arm = os.path.join(directory, "arm")
            if os.path.exists(arm):
                try:
                    os.rename(arm, os.path.join(directory, f"claimed-{os.getpid()}"))  # one process claims each arming
                except OSError:
                    pass
                else:
                    with open(os.path.join(directory, "request"), "w") as f:
                        f.write(rel)
                    while not os.path.exists(os.path.join(directory, "down")):
                        time.sleep(0.05)
            return download(self, rel, pin, out)

        remote.RemoteFiles._download = outage_first

    after_import("opentau_cli.data.remote", patch)


# Records


def record_samples(directory: str) -> None:
    """TEST_RECORD_SAMPLES=DIR: every process that reads training frames appends each index it reads to
    DIR/rank<RANK>.txt, one per line, in the order read (with dataset.num_workers=0 reads happen exactly as batches
    are consumed)."""
    def patch(dataset):
        read = dataset.LeRobotDataset.__getitem__

        def recorded(self, idx):
            with open(Path(directory) / f"rank{rank()}.txt", "a") as f:
                f.write(f"{int(idx)}\n")
            return read(self, idx)

        dataset.LeRobotDataset.__getitem__ = recorded

    after_import("opentau_cli.data.dataset", patch)


def record_weights(directory: str) -> None:
    """TEST_RECORD_WEIGHTS=DIR: before a launch's first step and after each step, rank 0 writes every trainable
    parameter's full fp32 value (DeepSpeed's master weight, gathered with DeepSpeed's own `safe_get_full_fp32_param`;
    otherwise the parameter itself) to DIR/step_<k>.safetensors; every rank takes part (the gather is a collective).
    With an EMA, the one the launch starts from is recorded the same way (DIR/step_<k>_ema.safetensors, read while the
    EMA is swapped in)."""
    def record(trainer, suffix: str = "") -> None:
        import torch
        from safetensors.torch import save_file

        acc = trainer.accelerator
        engine = getattr(acc, "deepspeed_engine_wrapped", None)
        weights = {}
        for name, p in acc.unwrap_model(trainer.model).named_parameters():
            if not p.requires_grad:
                continue
            if engine is not None:
                from deepspeed.utils import safe_get_full_fp32_param

                value = safe_get_full_fp32_param(p)
            else:
                value = p.detach()
            weights[name] = value.detach().to("cpu", torch.float32).clone().contiguous()
        if acc.is_main_process:
            save_file(weights, str(Path(directory) / f"step_{trainer.step}{suffix}.safetensors"))

    def patch(trainer):
        step = trainer.Trainer.train_step

        def recorded(self, *args, **kwargs):
            if not getattr(self, "_recorded_start", False):
                self._recorded_start = True
                record(self)
                if self.ema is not None:  # the EMA the launch starts with, read the same way inside its swap_in
                    with self.ema.swap_in():
                        record(self, "_ema")
            result = step(self, *args, **kwargs)
            record(self)
            return result

        trainer.Trainer.train_step = recorded

    after_import("opentau_cli.train.trainer", patch)


def status_bytes(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def record_memory(directory: str) -> None:
    """TEST_MEMORY_RECORD=DIR: each rank's peak resident memory read by the kernel (/proc/self/status), outside the
    product's own accounting; each rank writes DIR/rank<N>.json (tests/real_peak.py reads them) with
    `rss_before_policy` (its resident bytes just before the policy is built, train/trainer.py build_policy_model),
    `hwm_before_policy` (its high-water mark then: what start-up alone reached), `hwm_built` (once the policy is built
    and, under FSDP2, sharded by train/fsdp.py shard_for_launch, before the optimizer is made), `hwm_steps` (after each
    training step) and `hwm_exit` (as the rank leaves)."""
    record: dict = {"hwm_steps": []}

    def patch(trainer):
        build, step, shard = trainer.build_policy_model, trainer.Trainer.train_step, trainer.fsdp.shard_for_launch

        def build_policy_model(*args, **kwargs):
            record["rss_before_policy"], record["hwm_before_policy"] = status_bytes("VmRSS"), status_bytes("VmHWM")
            model = build(*args, **kwargs)
            record["hwm_built"] = status_bytes("VmHWM")
            return model

        def shard_for_launch(*args, **kwargs):
            model = shard(*args, **kwargs)
            record["hwm_built"] = status_bytes("VmHWM")
            return model

        def train_step(self, *args, **kwargs):
            result = step(self, *args, **kwargs)
            record["hwm_steps"].append(status_bytes("VmHWM"))
            return result

        trainer.build_policy_model, trainer.Trainer.train_step = build_policy_model, train_step
        trainer.fsdp.shard_for_launch = shard_for_launch  # trainer.py calls it as fsdp.shard_for_launch

    def write():
        if "rss_before_policy" in record:
            record["hwm_exit"] = status_bytes("VmHWM")
            Path(directory, f"rank{rank()}.json").write_text(json.dumps(record))

    after_import("opentau_cli.train.trainer", patch)
    at_rank_exit(write)


def time_save_and_restore(directory: str) -> None:
    """BENCH_TIMING_RECORD=DIR: each rank writes DIR/rank<N>.json as it leaves, with `save_s` (seconds in each
    checkpoint save, CheckpointManager.save: what training waits for) and `load_s` (in each restore, Trainer.restore:
    the checkpoint into the model, optimizer, scheduler and RNG), timed around the product's calls."""
    record: dict = {"save_s": [], "load_s": []}

    def timed(owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record[key].append(time.perf_counter() - start)

        setattr(owner, name, wrapper)

    after_import("opentau_cli.train.manager", lambda manager: timed(manager.CheckpointManager, "save", "save_s"))
    after_import("opentau_cli.train.trainer", lambda trainer: timed(trainer.Trainer, "restore", "load_s"))
    at_rank_exit(lambda: Path(directory, f"rank{rank()}.json").write_text(json.dumps(record)))


# Benchmark settings


def take_turns(spec: str) -> None:
    """BENCH_TURNS=DIR:ME:OTHER:RECORD: the rank takes a turn with another process (benchmarks/turns.py) at the start
    of every training step and writes when it held each (`spans`) to RECORD (JSON) as it leaves."""
    directory, me, other, record = spec.split(":")
    sys.path.append(str(TESTS.parent / "benchmarks"))
    from turns import Turns

    turns = Turns(directory, me, other)

    def patch(trainer):
        step = trainer.Trainer.train_step

        def train_step(self, *args, **kwargs):
            turns.next()
            return step(self, *args, **kwargs)

        trainer.Trainer.train_step = train_step

    def write():
        turns.done()
        with open(record, "w") as f:
            json.dump({"spans": turns.spans}, f)

    after_import("opentau_cli.train.trainer", patch)
    at_rank_exit(write)


def pin_cores(rank_cpus: str) -> None:
    """BENCH_RANK_CPUS=CPUS and BENCH_OTHER_CPUS=CPUS (e.g. 0 and 1): the cores split as on a GPU node's host
    (benchmarks/bench_remote.py). A rank process (`python -m opentau_cli.train.worker`) pins itself to the first, and
    the data workers it starts inherit them; every other process (`opentau train` itself: the launcher, whose thread
    uploads) to the others."""
    with open("/proc/self/cmdline", "rb") as f:
        cpus = rank_cpus if b"opentau_cli.train.worker" in f.read() else os.environ.get("BENCH_OTHER_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


HOOKS = {  # the variable that chooses a hook: its value is the hook's setting (each hook's doc)
    "TEST_FAULT": fail_a_step,
    "TEST_KILL_AT": kill_at_save_moment,
    "TEST_KILL_POINT": kill_tool_at_point,
    "TEST_UPLOAD_DIR": hold_upload,
    "TEST_OUTAGE_DIR": store_outage,
    "TEST_RECORD_SAMPLES": record_samples,
    "TEST_RECORD_WEIGHTS": record_weights,
    "TEST_MEMORY_RECORD": record_memory,
    "BENCH_TIMING_RECORD": time_save_and_restore,
    "BENCH_TURNS": take_turns,
    "BENCH_RANK_CPUS": pin_cores,
}

for _variable, _install in HOOKS.items():
    if os.environ.get(_variable):
        _install(os.environ[_variable])
