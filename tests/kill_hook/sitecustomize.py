"""Test-only: SIGKILL a whole real `opentau train` launch at a chosen moment of a checkpoint save.

Put this directory on PYTHONPATH and set TEST_KILL_AT=MOMENT@STEP (a moment of tests/save_faults.py; TEST_KILL_RANK=N
picks the rank that acts, default 0). When that rank reaches MOMENT during the save of STEP, it SIGKILLs the launcher,
Accelerate's agent, every other rank and itself, as a node failure would. TEST_KILL_SIGNAL=SIGTERM (or another
signal's name) instead sends that signal to the launcher alone, as a scheduler preempting the job does, and the run
goes on. The launcher must lead its own session (the test starts it with start_new_session=True): that is how the
hook finds the top of the run. Python processes without the variable are untouched; with it, the strike is
registered as a hook on the save's named fault points.
"""

from __future__ import annotations

import os


def kill_the_run() -> None:
    """SIGKILL the launcher (the session leader above this process), everything under it, and this process."""
    import signal

    import psutil

    me = psutil.Process()
    top = _launcher(me)
    victims = ([top] + top.children(recursive=True)) if top else []
    for p in [p for p in victims if p.pid != me.pid]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def signal_the_launcher(signum: int) -> None:
    """Send signum to the launcher only (it forwards it to the ranks)."""
    import psutil

    _launcher(psutil.Process()).send_signal(signum)


def _launcher(me):
    return next((p for p in me.parents() if os.getpgid(p.pid) == p.pid), None)


def _install(spec_text: str) -> None:
    import sys
    from pathlib import Path

    moment, _, step = spec_text.partition("@")
    rank = os.environ.get("TEST_KILL_RANK", "0")
    if os.environ.get("RANK", "0") != rank:
        return
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/, for save_faults
    from save_faults import arm

    import signal
    from functools import partial

    name = os.environ.get("TEST_KILL_SIGNAL")
    arm(moment, int(step), partial(signal_the_launcher, signal.Signals[name]) if name else kill_the_run, rank=int(rank))


if os.environ.get("TEST_KILL_AT"):
    _install(os.environ["TEST_KILL_AT"])
