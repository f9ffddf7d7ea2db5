"""`opentau train` and `opentau resume`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from opentau_cli.cli.common import (
    OVERRIDES_CONTEXT, AccelerateConfigOpt, BreakLockOpt, ConfigPathOpt, DatasetChangedOpt, MachineRankOpt, MainIpOpt,
    MainPortOpt, NumMachinesOpt, ReshardOpt, RollbackOpt, handle_errors, machine_settings, parse_bool_flag, warn,
)
from opentau_cli.units import CARD_SIZE_HELP

GpuMemoryOpt = typer.Option(None, "--gpu-memory", help=(
    f"Check the memory plan against cards of this size instead of the visible GPU's: {CARD_SIZE_HELP}."))


MaxRestartsOpt = typer.Option(None, "--max-restarts", "--max_restarts", help=(
    "Restart the ranks from the run's last checkpoint up to this many times when one dies or hangs "
    "(distributed.max_restarts; 0 = a failure ends the run)."))


def _with_restarts(args: list[str], max_restarts: int | None) -> list[str]:
    """--max-restarts N is the config's distributed.max_restarts, checked and reported as every override is."""
    return args if max_restarts is None else [*args, f"--distributed.max_restarts={max_restarts}"]


def _set_card(gpu_memory: str | None) -> None:
    """This command's card for the memory plan (--gpu-memory), not a previous command's."""
    from opentau_cli.plan.memory import parse_size, set_card_memory

    set_card_memory(parse_size(gpu_memory) if gpu_memory is not None else None)


def _stopped_before_training(plan_and_launch):
    """A preemption notice while the launch is planned (before any rank exists) stops it cleanly: exit 0, as a
    notice during training does (docs/ARCHITECTURE.md, "Restarts")."""
    import functools

    from opentau_cli.errors import Stopped

    @functools.wraps(plan_and_launch)
    def wrapper(*args, **kwargs):
        try:
            return plan_and_launch(*args, **kwargs)
        except Stopped as e:
            typer.echo(f"Stopped by {e} before training began: nothing was started; run the same command again to "
                       "start it.", err=True)
            raise typer.Exit(0) from None

    return wrapper


def _launch(plan, break_lock: bool = False) -> None:
    from opentau_cli.cli.summary import summarize
    from opentau_cli.process import launch
    from opentau_cli.sim.watch import check_eval_setting

    check_eval_setting(plan.config)  # the checks `opentau eval --env` makes (config validate makes them too)
    first = plan.setup.machine_rank == 0  # machine 0 prints the plan and the progress; the others where their logs go
    for note in plan.checked.warnings:
        warn(note)
    if plan.finished:  # e.g. a scheduler re-queues a run that already completed: what is local only goes up
        for note in plan.notes if first else ():
            typer.echo(note, err=True)
        if first and plan.config.checkpoint.remote:
            from opentau_cli.process.uploader import push

            push(plan.config.output_dir, plan.config.checkpoint.model_dump(), break_lock=break_lock,
                 echo=lambda m: typer.echo(m, err=True))
        if first and plan.config.eval.enabled:  # its owed evaluations, if its end was interrupted
            launch.evaluate_owed(plan, echo=lambda m: typer.echo(m, err=True))
        return

    def announce() -> None:
        for note in plan.notes if first else ():
            typer.echo(note, err=True)
        if first:
            typer.echo(summarize(plan, heading="Resuming" if plan.resume_from else "Training"), err=True)

    code = launch.run(plan, echo=lambda m: typer.echo(m, err=True), break_lock=break_lock, announce=announce)
    if code:
        raise typer.Exit(code)


@handle_errors
@_stopped_before_training
def train(ctx: typer.Context, config_path: ConfigPathOpt = None, accelerate_config: AccelerateConfigOpt = None,
          machine_rank: MachineRankOpt = None, num_machines: NumMachinesOpt = None, main_process_ip: MainIpOpt = None,
          main_process_port: MainPortOpt = None, break_lock: BreakLockOpt = False, reshard: ReshardOpt = "false",
          rollback: RollbackOpt = "false", gpu_memory: Optional[str] = GpuMemoryOpt,
          max_restarts: Optional[int] = MaxRestartsOpt, dataset_changed: DatasetChangedOpt = "false") -> None:
    """Train a policy under Accelerate (single process, DDP, DeepSpeed ZeRO-2/3).

    Examples:

        opentau train --config_path=configs/examples/pi05_tiny_config.json --accelerate-config=configs/examples/accelerate_cpu_ddp_config.yaml --steps 40

        opentau-train --config_path=outputs/train/pi05/checkpoints/000040/train_config.json --resume=true --steps=100

        opentau train --config_path=configs/examples/pi05_tiny_config.json --output_dir=outputs/train/tiny --resume=auto
        (starts the run, or continues it from `last` when output_dir or checkpoint.remote holds one: what a
        scheduler's requeue runs again)
    """
    from opentau_cli.plan.run_plan import plan_train

    _set_card(gpu_memory)
    machines = machine_settings(machine_rank, num_machines, main_process_ip, main_process_port)
    _launch(plan_train(config_path, accelerate_config, _with_restarts(list(ctx.args), max_restarts), machines=machines,
                       reshard=parse_bool_flag("--reshard", reshard), rollback=parse_bool_flag("--rollback", rollback),
                       break_lock=break_lock, dataset_changed=parse_bool_flag("--dataset-changed", dataset_changed),
                       echo=lambda m: typer.echo(m, err=True)),
            break_lock)


@handle_errors
@_stopped_before_training
def resume(
    ctx: typer.Context,
    run_dir: str = typer.Argument(..., help=(
        "A run directory (newest complete checkpoint), one checkpoint directory, or the URL of the run's "
        "checkpoint.remote (s3://bucket/prefix/run): its last checkpoint is downloaded first.")),
    accelerate_config: AccelerateConfigOpt = None,
    machine_rank: MachineRankOpt = None,
    num_machines: NumMachinesOpt = None,
    main_process_ip: MainIpOpt = None,
    main_process_port: MainPortOpt = None,
    break_lock: BreakLockOpt = False,
    reshard: ReshardOpt = "false",
    rollback: RollbackOpt = "false",
    gpu_memory: Optional[str] = GpuMemoryOpt,
    max_restarts: Optional[int] = MaxRestartsOpt,
    dataset_changed: DatasetChangedOpt = "false",
) -> None:
    """Resume a run from the checkpoint `last` designates (or the checkpoint given; an older one needs --rollback=true).

    Examples:

        opentau resume outputs/train/pi05 --steps=100

        opentau resume outputs/train/pi05/checkpoints/000040 --rollback=true

        opentau resume outputs/train/pi05 --reshard=true --accelerate-config=configs/examples/accelerate_deepspeed_zero3_config.yaml

        opentau resume s3://my-bucket/runs/pi05 --output_dir=/scratch/pi05
    """
    from opentau_cli.plan.run_plan import plan_resume

    _set_card(gpu_memory)
    machines = machine_settings(machine_rank, num_machines, main_process_ip, main_process_port)
    target = _local_target(run_dir, list(ctx.args), parse_bool_flag("--rollback", rollback))
    _launch(plan_resume(target, accelerate_config, _with_restarts(list(ctx.args), max_restarts), machines=machines,
                        reshard=parse_bool_flag("--reshard", reshard), rollback=parse_bool_flag("--rollback", rollback),
                        break_lock=break_lock, dataset_changed=parse_bool_flag("--dataset-changed", dataset_changed)),
            break_lock)


def _local_target(run_dir: str, args: list[str], rollback: bool) -> Path:
    """A local run or checkpoint as given, or the local copy of a remote run (plan/remote.py)."""
    from opentau_cli.plan.remote import local_copy
    from opentau_cli.store.storage import is_url

    if not is_url(run_dir):
        return Path(run_dir)
    from opentau_cli.config import parse_overrides

    import json

    overrides = parse_overrides(args)
    options = overrides.get("checkpoint.remote_options")
    return local_copy(run_dir, overrides.get("output_dir"), json.loads(options) if isinstance(options, str) else options or {},
                      echo=lambda m: typer.echo(m, err=True), rollback=rollback)


def register(app: typer.Typer) -> None:
    app.command("train", context_settings=OVERRIDES_CONTEXT)(train)
    app.command("resume", context_settings=OVERRIDES_CONTEXT)(resume)
