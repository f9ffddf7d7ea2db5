"""The `opentau` command line: wires the command groups together."""

from __future__ import annotations

import atexit
import gc
import signal
import sys

from opentau_cli import __version__
from opentau_cli.errors import Stopped
from opentau_cli.cli import checkpoint_cmd, config_cmd, dataset_cmd, eval_cmd, profile_cmd, serve_cmd, train_cmd
from opentau_cli.cli.common import error, make_app

import typer
from typer.exceptions import TyperException

# At exit, the interpreter's last garbage collections walk every object torch and transformers made (about a second
# per command, measured); freezing them first skips that walk. Files are closed by the commands themselves.
atexit.register(gc.freeze)

app = make_app(
    "Train pi05 robot policies with Accelerate (single process, DDP, DeepSpeed ZeRO-2/3); "
    "checkpoint, resume, consolidate, export, evaluate and profile them safely."
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"opentau {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version.")) -> None:
    pass


train_cmd.register(app)
profile_cmd.register(app)
eval_cmd.register(app)
serve_cmd.register(app)
app.add_typer(checkpoint_cmd.app, name="checkpoint")
app.add_typer(config_cmd.app, name="config")
app.add_typer(dataset_cmd.app, name="dataset")


def _stop(signum, _frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def main(prog_name: str = "opentau", received: list[str] | None = None) -> None:
    """The `opentau` console script: the app, with the usage errors Typer finds itself (a value of the wrong type, a
    missing argument) said in one line with exit 2, as every other mistake is; help for a bare group stays help. A
    preemption signal (SIGTERM, SIGUSR1) stops a command through `Stopped`: it cleans up and says so in one line
    (a launch takes the signals over while its ranks run: process/launch.py). `received`: the notices that came
    while the commands were being imported (cli/entry.py)."""
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, _stop)
    if received:
        train = prog_name == "opentau-train" or sys.argv[1:2] in (["train"], ["resume"])
        typer.echo(f"Stopped by {received[0]} before {'training began' if train else 'it started'}: nothing was "
                   f"started; run the same command again{' to start it' if train else ''}.", err=True)
        sys.exit(0 if train else Stopped.exit_code)
    try:
        code = app(prog_name=prog_name, standalone_mode=False)
    except TyperException as e:
        if type(e).__name__ == "NoArgsIsHelpError" or not hasattr(e, "format_message"):
            e.show()
        else:
            error(e.format_message().replace("\n", " "))
        sys.exit(getattr(e, "exit_code", 2))
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def train_alias(received: list[str] | None = None) -> None:
    """`opentau-train ...` is `opentau train ...` (the upstream entry point)."""
    sys.argv[1:1] = ["train"]
    main(prog_name="opentau-train", received=received)
