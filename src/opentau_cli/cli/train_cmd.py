"""`opentau train` and `opentau resume`."""

from __future__ import annotations

from pathlib import Path

import typer

from opentau_cli.cli.common import OVERRIDES_CONTEXT, AccelerateConfigOpt, ConfigPathOpt, handle_errors, not_available


@handle_errors
def train(ctx: typer.Context, config_path: ConfigPathOpt = None, accelerate_config: AccelerateConfigOpt = None) -> None:
    """Train a policy under Accelerate (single process, DDP, DeepSpeed ZeRO-2/3).

    Examples:

        opentau train --config_path=configs/examples/pi05_tiny_config.json --accelerate-config=configs/examples/accelerate_cpu_ddp_config.yaml --steps 40

        opentau-train --config_path=outputs/train/pi05/checkpoints/000040/train_config.json --resume=true --steps=100
    """
    not_available("Training")


@handle_errors
def resume(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., help="A run directory (newest complete checkpoint) or one checkpoint directory."),
    accelerate_config: AccelerateConfigOpt = None,
) -> None:
    """Resume a run from its newest complete checkpoint (or the checkpoint given).

    Examples:

        opentau resume outputs/train/pi05 --steps=100

        opentau resume outputs/train/pi05/checkpoints/000040
    """
    not_available("Resuming")


def register(app: typer.Typer) -> None:
    app.command("train", context_settings=OVERRIDES_CONTEXT)(train)
    app.command("resume", context_settings=OVERRIDES_CONTEXT)(resume)
