"""Test-only: make one rank of a real `opentau train` launch fail at a chosen step of a chosen attempt.

Put this directory on PYTHONPATH and set TEST_FAULT=ACTION@STEP:ATTEMPT[,ACTION@STEP:ATTEMPT...] and TEST_FAULT_RANK=N
(default 1; `any`: whichever rank the process gets, for a machine's only rank under elastic machines, whose global
rank the rendezvous decides). Just before that rank starts step STEP in attempt ATTEMPT (TORCHELASTIC_RESTART_COUNT; `*` = every
attempt), it acts: `kill` SIGKILLs itself (a lost node, the OOM killer), `machine` SIGKILLs its launcher's process
group (the `opentau` command and its agent: the whole machine leaves; the rank dies with its agent), `hold` waits
for a SIGTERM (the agent stopping the group to admit a machine that joins) and then runs the step, `stop` SIGSTOPs
itself (a hang), `raise`
raises a RuntimeError (a crash in the step), `user` raises the product's UserError (bad input found late). The hook
wraps Trainer.train_step when opentau_cli.train.trainer is imported; processes without TEST_FAULT are untouched.
With TEST_FAULT_TIMES=FILE that rank appends the wall-clock time of each moment (its start, the fault, the start and
end of each attempt's first step) to FILE as JSON lines: benchmarks/bench_restart.py times a restart with them.
"""

from __future__ import annotations

import os


def _faults() -> dict[int, str]:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    out = {}
    for item in os.environ["TEST_FAULT"].split(","):
        action, _, rest = item.partition("@")
        step, _, when = rest.partition(":")
        if when in ("*", attempt or "0"):
            out[int(step)] = action
    return out


def _note(event: str) -> None:
    path = os.environ.get("TEST_FAULT_TIMES")
    if path:
        import json
        import time

        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(),
                                "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}) + "\n")


def _act(action: str) -> bool:
    """Act; True when the step must run as a requested stop (`hold` got its signal). With TEST_FAULT_AFTER=FILE it
    first waits (up to 300 s) until FILE exists: the test says when (e.g. once a checkpoint is in the store)."""
    import signal
    import time

    after = os.environ.get("TEST_FAULT_AFTER")
    deadline = time.time() + 300
    while after and not os.path.exists(after) and time.time() < deadline:
        time.sleep(0.1)
    _note(action)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "machine":
        os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
        signal.pause()  # dies with its agent
    if action == "hold":  # wait for the agent's SIGTERM (it re-forms the group when a machine joins), then go on
        import threading

        received = threading.Event()
        previous = signal.getsignal(signal.SIGTERM)

        def handle(signum, frame):
            received.set()
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, handle)
        return received.wait(300)  # the step then runs as the stop the signal asked for
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if action == "raise":
        raise RuntimeError("fault_hook: a crash in the step")
    if action == "user":
        from opentau_cli.errors import UserError

        raise UserError("fault_hook: episode 3 of the dataset is unreadable.")
    return False


def _wrap(module) -> None:
    faults = _faults()
    original = module.Trainer.train_step

    first = [True]

    def train_step(self, *args, **kwargs):
        action = faults.get(self.step + 1)
        if action and _act(action):
            kwargs["stop_requested"] = True
        if not first[0]:
            return original(self, *args, **kwargs)
        first[0] = False
        _note("first_step_start")
        result = original(self, *args, **kwargs)
        _note("first_step_end")
        return result

    module.Trainer.train_step = train_step


def _install() -> None:
    import importlib.abc
    import sys

    if os.environ.get("TEST_FAULT_RANK", "1") not in ("any", os.environ.get("RANK", "")):
        return
    _note("start")

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "opentau_cli.train.trainer":
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = spec.loader
            execute = loader.exec_module

            def exec_module(module):
                execute(module)
                _wrap(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


if os.environ.get("TEST_FAULT"):
    _install()
