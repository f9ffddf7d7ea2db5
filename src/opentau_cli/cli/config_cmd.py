"""`opentau config validate | show | schema`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from opentau_cli.cli.common import OVERRIDES_CONTEXT, AccelerateConfigOpt, handle_errors, make_app, warn
from opentau_cli.config import TrainConfig, load_config, resolve_accelerate_config, validate
from opentau_cli.config.summary import summarize

app = make_app("Validate, show and describe the training config.")


@app.command("validate", context_settings=OVERRIDES_CONTEXT)
@handle_errors
def validate_cmd(ctx: typer.Context, config: Path = typer.Argument(..., help="Training config JSON."), accelerate_config: AccelerateConfigOpt = None) -> None:
    """Run every check `train` runs, without launching anything.

    Examples:

        opentau config validate configs/examples/pi05_tiny_config.json

        opentau config validate configs/examples/pi05_config.json --accelerate-config configs/examples/accelerate_deepspeed_zero3_config.yaml --policy.gradient_checkpointing=false
    """
    checked = validate(load_config(config, ctx.args), resolve_accelerate_config(accelerate_config))
    for w in checked.warnings:
        warn(w)
    typer.echo(summarize(checked))


@app.command("show", context_settings=OVERRIDES_CONTEXT)
@handle_errors
def show_cmd(ctx: typer.Context, config: Path = typer.Argument(..., help="Training config JSON.")) -> None:
    """Print the resolved config (file < OPENTAU_* env < overrides) as JSON.

    Example: opentau config show configs/examples/pi05_tiny_config.json --steps 40
    """
    typer.echo(json.dumps(load_config(config, ctx.args).to_json_dict(), indent=2))


@app.command("schema")
@handle_errors
def schema_cmd() -> None:
    """Print the JSON schema of the training config.

    Example: opentau config schema > train_config.schema.json
    """
    typer.echo(json.dumps(TrainConfig.model_json_schema(), indent=2))
