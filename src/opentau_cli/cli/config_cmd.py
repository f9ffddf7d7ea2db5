"""`opentau config validate | show | schema`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from opentau_cli.cli.common import (
    OVERRIDES_CONTEXT, AccelerateConfigOpt, DatasetChangedOpt, MachineRankOpt, MainIpOpt, MainPortOpt, NumMachinesOpt, ReshardOpt,
    RollbackOpt, handle_errors,
    make_app, machine_settings, parse_bool_flag, warn,
)
from opentau_cli.config import Machine, TrainConfig, load_config
from opentau_cli.units import CARD_SIZE_HELP

app = make_app("Validate, show and describe the training config.")


@app.command("validate", context_settings=OVERRIDES_CONTEXT)
@handle_errors
def validate_cmd(
    ctx: typer.Context,
    config: Path = typer.Argument(..., help="Training config JSON (a checkpoint's train_config.json with --resume=true checks that resume)."),
    accelerate_config: AccelerateConfigOpt = None,
    gpus: Optional[int] = typer.Option(
        None, "--gpus", help="Check for a target machine with this many visible CUDA GPUs (0: none) instead of this machine."
    ),
    machine_rank: MachineRankOpt = None,
    num_machines: NumMachinesOpt = None,
    main_process_ip: MainIpOpt = None,
    main_process_port: MainPortOpt = None,
    reshard: ReshardOpt = "false",
    rollback: RollbackOpt = "false",
    dataset_changed: DatasetChangedOpt = "false",
    gpu_memory: Optional[str] = typer.Option(
        None, "--gpu-memory", help=f"Check the memory plan against cards of this size instead of this machine's: {CARD_SIZE_HELP}."
    ),
) -> None:
    """Run every check `train` runs before launching (with --resume=true, also the checkpoint's), without launching.

    Machine-dependent rules are checked for this machine unless --gpus describes the target machine.

    Examples:

        opentau config validate configs/examples/pi05_tiny_config.json

        opentau config validate configs/examples/pi05_config.json --accelerate-config configs/examples/accelerate_ddp_config.yaml --gpus 8 --gpu-memory 80GB

        opentau config validate configs/examples/pi05_config.json --accelerate-config configs/examples/accelerate_deepspeed_zero3_config.yaml --gpus 8

        opentau config validate outputs/train/pi05/checkpoints/000040/train_config.json --resume=true --steps=100

        opentau config validate configs/examples/pi05_config.json --accelerate-config configs/examples/accelerate_2nodes_deepspeed_config.yaml --main_process_ip 10.1.0.7 --machine_rank 1 --gpus 8
    """
    from opentau_cli.cli.summary import summarize
    from opentau_cli.plan.run_plan import plan_train
    from opentau_cli.sim.watch import check_eval_setting

    from opentau_cli.plan.memory import parse_size, set_card_memory

    set_card_memory(parse_size(gpu_memory) if gpu_memory is not None else None)  # this command's card, not a previous one's
    machine = Machine.with_gpus(gpus) if gpus is not None else None
    machines = machine_settings(machine_rank, num_machines, main_process_ip, main_process_port)
    plan = plan_train(config, accelerate_config, list(ctx.args), machine, machines=machines,
                      reshard=parse_bool_flag("--reshard", reshard), rollback=parse_bool_flag("--rollback", rollback),
                      dataset_changed=parse_bool_flag("--dataset-changed", dataset_changed))
    check_eval_setting(plan.config)  # the checks `opentau eval --env` makes, as train makes them before launch
    for w in plan.checked.warnings:
        warn(w)
    for note in plan.notes:
        typer.echo(note, err=True)
    typer.echo(summarize(plan))


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
