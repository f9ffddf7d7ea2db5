"""`opentau checkpoint consolidate | inspect | verify | list`."""

from __future__ import annotations

from pathlib import Path

import typer

from opentau_cli.cli.common import handle_errors, make_app, not_available

app = make_app("Consolidate, inspect, verify and list checkpoints.")


@app.command("consolidate")
@handle_errors
def consolidate_cmd(checkpoint_dir: Path = typer.Argument(..., help="A DeepSpeed checkpoint directory.")) -> None:
    """Turn DeepSpeed ZeRO shards into one model.safetensors (streaming).

    Example: opentau checkpoint consolidate outputs/train/pi05/checkpoints/000040/
    """
    not_available("checkpoint consolidate")


@app.command("inspect")
@handle_errors
def inspect_cmd(checkpoint_dir: Path = typer.Argument(...)) -> None:
    """Show step, backend, world size, preset, parameters and files of a checkpoint."""
    not_available("checkpoint inspect")


@app.command("verify")
@handle_errors
def verify_cmd(path: Path = typer.Argument(...)) -> None:
    """Re-hash every file of a checkpoint (or every checkpoint of a run) against its manifest."""
    not_available("checkpoint verify")


@app.command("list")
@handle_errors
def list_cmd(run_dir: Path = typer.Argument(...)) -> None:
    """List the checkpoints of a run."""
    not_available("checkpoint list")
