"""`opentau profile`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from opentau_cli.cli.common import OVERRIDES_CONTEXT, AccelerateConfigOpt, ConfigPathOpt, handle_errors, warn
from opentau_cli.errors import UserError
from opentau_cli.units import SIZE_HELP


@handle_errors
def profile(
    ctx: typer.Context,
    config_path: ConfigPathOpt = None,
    accelerate_config: AccelerateConfigOpt = None,
    steps: int = typer.Option(20, "--steps", min=1, help="Measured steps (the run's config `steps` is set to warmup + steps)."),
    warmup: int = typer.Option(5, "--warmup", min=0, help="Steps run first and not measured (start-up, allocator, compile)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the numbers as JSON to this path ('-' = stdout, no table)."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Comma-separated Accelerate YAMLs to run one after another and show side by side."),
    find_max_batch: bool = typer.Option(False, "--find-max-batch", help="Binary-search the largest per-device batch that fits, per Accelerate config."),
    max_batch: int = typer.Option(256, "--max-batch", min=1, help="Upper bound for --find-max-batch."),
    memory_limit: Optional[str] = typer.Option(
        None, "--memory-limit", help=f"Per-process resident memory cap, e.g. 8GB ({SIZE_HELP}): a worker passing it counts as out of memory (needed on CPU for --find-max-batch)."
    ),
    dataloader_only: bool = typer.Option(False, "--dataloader-only", help="Measure only the input pipeline (no model) in samples/s."),
    peak_tflops: Optional[float] = typer.Option(None, "--peak-tflops", min=0, help="Peak TFLOP/s of one device, for MFU on devices opentau does not know."),
) -> None:
    """Time each phase of real training steps (data, forward, backward, optimizer, sync); compare backends.

    Runs exactly what `train` builds, through the same launcher, without writing checkpoints.

    Examples:

        opentau profile --config_path=configs/examples/pi05_tiny_config.json --steps 20 --warmup 5

        opentau profile --config_path=configs/examples/pi05_tiny_config.json --compare configs/examples/accelerate_cpu_ddp_config.yaml,configs/examples/accelerate_cpu_deepspeed_config.yaml

        opentau profile --config_path=configs/examples/pi05_tiny_config.json --find-max-batch --memory-limit 6GB

        opentau profile --config_path=configs/examples/pi05_tiny_config.json --dataloader-only --json profile.json
    """
    from opentau_cli.config import load_config, resolve_accelerate_config
    from opentau_cli.profiling import run as prof
    from opentau_cli.profiling import render

    if config_path is None:
        raise UserError("--config_path is required (e.g. --config_path=configs/examples/pi05_tiny_config.json).")
    if compare and accelerate_config:
        raise UserError("--compare and --accelerate-config cannot be combined: list every Accelerate config in --compare.")
    if dataloader_only and (compare or find_max_batch):
        raise UserError("--dataloader-only measures the input pipeline alone; it cannot be combined with --compare or --find-max-batch.")
    if memory_limit and not find_max_batch:
        raise UserError("--memory-limit applies to --find-max-batch only.")
    cfg = load_config(config_path, ctx.args)
    to_stdout = json_path is not None and str(json_path) == "-"
    console = Console(stderr=to_stdout)
    if not console.is_terminal:
        console.width = 120  # logs and pipes: do not squeeze the tables into 80 columns
    opts = prof.ProfileOptions(steps=steps, warmup=warmup, peak_tflops=peak_tflops)

    if dataloader_only:
        report = prof.profile_dataloader_only(cfg, resolve_accelerate_config(accelerate_config), opts)
        if not to_stdout:
            console.print(render.dataloader_table(report))
    elif find_max_batch:
        configs = prof.parse_compare(compare) if compare else [accelerate_config]
        report = prof.find_max_batch(cfg, configs, opts, max_batch=max_batch, memory_limit=prof.parse_memory_limit(memory_limit) if memory_limit else None, echo=console.print)
        if not to_stdout:
            console.print(render.max_batch_table(report["results"]))
    elif compare:
        report = prof.compare(cfg, prof.parse_compare(compare), opts, echo=console.print)
        if not to_stdout:
            console.print(render.compare_table(report["rows"]))
    else:
        report = prof.profile_training(cfg, resolve_accelerate_config(accelerate_config), opts, echo=console.print)
        if not to_stdout:
            render.print_report(report, console)
    for w in report.get("warnings", []):
        warn(w)
    if json_path is not None:
        text = json.dumps(report, indent=2)
        if to_stdout:
            typer.echo(text)
        else:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(text + "\n")


def register(app: typer.Typer) -> None:
    app.command("profile", context_settings=OVERRIDES_CONTEXT)(profile)
