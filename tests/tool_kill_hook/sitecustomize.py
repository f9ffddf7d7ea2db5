"""Test-only: kill an offline opentau command (consolidate, export) at a named moment of its write.

Put this directory on PYTHONPATH and set TEST_KILL_POINT=NAME[:SIGNAL], NAME one of opentau_cli.store.faults.TOOL_POINTS
(SIGNAL: SIGKILL by default, or e.g. SIGTERM as `kill`, `timeout` or a job's time limit sends it). The first time the
command reaches NAME it sends itself SIGNAL. Processes without the variable are untouched.
"""

from __future__ import annotations

import os


def _install(spec: str) -> None:
    import signal

    from opentau_cli.store import faults

    name, _, sig = spec.partition(":")
    assert name in faults.TOOL_POINTS, f"{name!r} is not a named moment of the tools' writes"
    struck = []

    def strike(point: str, _path) -> None:
        if point == name and not struck:
            struck.append(point)
            os.kill(os.getpid(), signal.Signals[sig or "SIGKILL"])

    faults.hooks.append(strike)


if os.environ.get("TEST_KILL_POINT"):
    _install(os.environ["TEST_KILL_POINT"])
