"""`opentau profile`."""

from __future__ import annotations

import typer

from opentau_cli.cli.common import OVERRIDES_CONTEXT, AccelerateConfigOpt, ConfigPathOpt, handle_errors, not_available


@handle_errors
def profile(ctx: typer.Context, config_path: ConfigPathOpt = None, accelerate_config: AccelerateConfigOpt = None) -> None:
    """Time each phase of real training steps (data, forward, backward, optimizer, sync).

    Example: opentau profile --config_path=configs/examples/pi05_tiny_config.json --steps 20 --warmup 5
    """
    not_available("profile")


def register(app: typer.Typer) -> None:
    app.command("profile", context_settings=OVERRIDES_CONTEXT)(profile)
