"""The console scripts `opentau` and `opentau-train`: a preemption notice (SIGTERM, SIGUSR1) is kept from the first
instant, before the commands are imported (half a second), and then stops the command cleanly (cli/main.py), so a
notice at any moment gets one line and the right exit code, never a silent 143 (docs/ARCHITECTURE.md, "Restarts").
Imports nothing but the standard library before that."""

from __future__ import annotations

import signal

RECEIVED: list[str] = []  # the preemption signals received while the commands were being imported


def _keep(signum, _frame) -> None:
    RECEIVED.append(signal.Signals(signum).name)


def main() -> None:
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, _keep)
    from opentau_cli.cli.main import main as run

    run(received=RECEIVED)


def train_alias() -> None:
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, _keep)
    from opentau_cli.cli.main import train_alias as run

    run(received=RECEIVED)
