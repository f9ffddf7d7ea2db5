"""`opentau dataset synth | info`."""

from __future__ import annotations

from pathlib import Path

import typer

from opentau_cli.cli.common import handle_errors, make_app, not_available

app = make_app("Create and describe LeRobot-format datasets.")


@app.command("synth")
@handle_errors
def synth_cmd(out_dir: Path = typer.Argument(...)) -> None:
    """Write a small learnable LeRobot-format dataset, offline."""
    not_available("dataset synth")


@app.command("info")
@handle_errors
def info_cmd(dataset_dir: Path = typer.Argument(...)) -> None:
    """Print features, episodes, frames, fps and stats of a dataset."""
    not_available("dataset info")
