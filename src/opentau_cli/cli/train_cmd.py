"""`opentau train` and `opentau resume`."""

from __future__ import annotations

from pathlib import Path

import typer

from opentau_cli.cli.common import OVERRIDES_CONTEXT, AccelerateConfigOpt, ConfigPathOpt, handle_errors, warn


def _launch(plan) -> None:
    from opentau_cli import launch
    from opentau_cli.cli.summary import summarize

    for note in plan.checked.warnings:
        warn(note)
    for note in plan.notes:
        typer.echo(note, err=True)
    if plan.finished:  # e.g. a scheduler re-queues a run that already completed
        return
    typer.echo(summarize(plan, heading="Resuming" if plan.resume_from else "Training"), err=True)
    code = launch.run(plan, echo=lambda m: typer.echo(m, err=True))
    if code:
        raise typer.Exit(code)


@handle_errors
def train(ctx: typer.Context, config_path: ConfigPathOpt = None, accelerate_config: AccelerateConfigOpt = None) -> None:
    """Train a policy under Accelerate (single process, DDP, DeepSpeed ZeRO-2/3).

    Examples:

        opentau train --config_path=configs/examples/pi05_tiny_config.json --accelerate-config=configs/examples/accelerate_cpu_ddp_config.yaml --steps 40

        opentau-train --config_path=outputs/train/pi05/checkpoints/000040/train_config.json --resume=true --steps=100
    """
    from opentau_cli.plan import plan_train

    _launch(plan_train(config_path, accelerate_config, list(ctx.args)))


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
    from opentau_cli.plan import plan_resume

    _launch(plan_resume(run_dir, accelerate_config, list(ctx.args)))


def register(app: typer.Typer) -> None:
    app.command("train", context_settings=OVERRIDES_CONTEXT)(train)
    app.command("resume", context_settings=OVERRIDES_CONTEXT)(resume)
