"""What every command shares: the sub-app factory, option types, and the one place errors become exit codes."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
import sys
import traceback
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from opentau_cli.errors import RunError, Stopped, UserError

# Commands that take dotted config overrides after their own options.
OVERRIDES_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}

ConfigPathOpt = Annotated[
    Optional[Path],
    typer.Option("--config_path", "--config-path", help="Training config JSON (a path under configs/ is found without the prefix)."),
]
AccelerateConfigOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--accelerate-config",
        "--accelerate_config",
        help="Accelerate YAML; default: Accelerate's default config file if present, else one process.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
ForceOpt = Annotated[bool, typer.Option("--force", help=(
    "Replace an earlier output of this same command (the old one is removed only once the new one is complete); never "
    "a run, a checkpoint or anything opentau did not write (opentau_cli/store/outputs.py)."))]
WeightsOpt = Annotated[Optional[str], typer.Option("--weights", help=(
    "ema or live, for a training checkpoint: the EMA of the weights (ema.decay) or the weights as trained; default: "
    "the EMA when the checkpoint holds one (what RUN:best is ranked on unless checkpoint.best_metric names a val_* "
    "key). The output records which."))]
# What `eval` and `serve` load, and where.
PolicySourceArg = Annotated[str, typer.Argument(help=(
    "A run or checkpoint directory, or a model: a file, a directory (e.g. from `checkpoint export`) or a Hugging Face "
    "repo id, in any published layout."))]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1 (default: cuda when there is a GPU).")]


def same_with_dashes(token: str) -> str:
    """`--plot_episodes` is `--plot-episodes`: every command's own options take either spelling (click normalizes
    declared and given option names with it; dotted config overrides pass through as given)."""
    return token.replace("_", "-")


def make_app(help_text: str) -> typer.Typer:
    return typer.Typer(
        help=help_text,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode="markdown",
        context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110,
                          "token_normalize_func": same_with_dashes},
    )


def config_overrides(ctx: typer.Context) -> dict:
    """The dotted config overrides that follow a command's own options (`ctx.args`). An option that is no config key
    but close to one of the command's own is that option mistyped (`eval --stide`): refused naming it, where the
    config's closest key would mislead."""
    import difflib

    from opentau_cli.config.load import all_keys, parse_overrides

    own = sorted({o for p in ctx.command.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])
                  if o.startswith("--")})
    keys = set(all_keys())
    for arg in ctx.args:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if not key or "." in key or key in keys:
            continue
        close = difflib.get_close_matches(f"--{same_with_dashes(key)}", [same_with_dashes(o) for o in own], n=1, cutoff=0.6)
        if close:
            mine = next(o for o in own if same_with_dashes(o) == close[0])
            raise UserError(f"No such option --{key} for `opentau {ctx.command.name}` (did you mean {mine}?).")
    return parse_overrides(list(ctx.args))


@contextmanager
def progress_bar(what: str, unit: str):
    """A bar on stderr when it is a terminal (`exporting ━━━━  12.3 of 45.6 MB  0:00:04`); yields `progress(done,
    total)`, in bytes for unit "MB", else counted in `unit` (e.g. "chunks")."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    scale = 1e6 if unit == "MB" else 1
    with Progress(TextColumn(what), BarColumn(), TextColumn("{task.fields[shown]}"), TimeRemainingColumn(),
                  transient=True, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(what, total=None, shown="")

        def progress(done: int, total: int, note: str = "") -> None:
            shown = f"{done / scale:.1f} of {total / scale:.1f} MB" if unit == "MB" else f"{done} of {total} {unit}"
            bar.update(task, completed=done, total=total, shown=f"{shown}  {note}" if note else shown)

        yield progress


def error(message: str) -> None:
    typer.echo(f"Error: {message}", err=True)


def warn(message: str) -> None:
    typer.echo(f"Warning: {message}", err=True)


def handle_errors(fn: Callable) -> Callable:
    """Known failures become one line on stderr and an exit code; OPENTAU_DEBUG=1 shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UserError, RunError) as e:
            if os.environ.get("OPENTAU_DEBUG"):
                traceback.print_exc()
            error(str(e))
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("Interrupted.", err=True)
            raise typer.Exit(130) from None
        except Stopped as e:  # what it was writing is removed on the way out, or recognised by its next run
            typer.echo(f"Stopped by {e} before it finished; run the same command again to complete it.", err=True)
            raise typer.Exit(e.exit_code) from None
        except BrokenPipeError:  # `opentau ... | head`
            sys.stderr.close()
            raise typer.Exit(0) from None

    return wrapper


_MACHINE_HELP = "overrides the accelerate config (and the cluster's environment), so one YAML serves every machine"
MachineRankOpt = Annotated[Optional[int], typer.Option("--machine_rank", "--machine-rank", help=f"This machine's rank; {_MACHINE_HELP}.")]
NumMachinesOpt = Annotated[Optional[int], typer.Option("--num_machines", "--num-machines", help=f"Machines in the run; {_MACHINE_HELP}.")]
MainIpOpt = Annotated[Optional[str], typer.Option("--main_process_ip", "--main-process-ip", help=f"Machine 0's address; {_MACHINE_HELP}.")]
BreakLockOpt = Annotated[bool, typer.Option("--break-lock", "--break_lock", help=(
    "Take over the run directory's lock, and checkpoint.remote's lease, held by a run on another host that is known "
    "to be dead (a lost node)."))]
ReshardOpt = Annotated[str, typer.Option("--reshard", metavar="BOOL", help=(
    "true: resume on another number of processes or machines, or under another backend / ZeRO stage; the global "
    "batch, model, optimizer and data position carry over exactly (docs/resume.md, \"Elastic resume\")."))]

RollbackOpt = Annotated[str, typer.Option("--rollback", metavar="BOOL", help=(
    "true: resume from a checkpoint older than the run's newest; the newer checkpoints and their metrics move into "
    "RUN/rolled_back/<time>/ (nothing is deleted) and the run continues from the one given (docs/resume.md, \"One history per run\")."))]


DatasetChangedOpt = Annotated[str, typer.Option("--dataset-changed", "--dataset_changed", metavar="BOOL", help=(
    "true: resume although the files of a local dataset changed since the checkpoint was saved (its meta/ files, or "
    "the number or sizes of its data files); the data order then continues over the dataset as it is now."))]


def parse_bool_flag(name: str, value: str) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise UserError(f"{name} takes true or false, not '{value}'.")


MainPortOpt = Annotated[Optional[int], typer.Option("--main_process_port", "--main-process-port", help=f"Machine 0's port; {_MACHINE_HELP}.")]


def machine_settings(machine_rank, num_machines, main_process_ip, main_process_port) -> dict:
    """The machine flags of train / resume / config validate, for plan.with_machine (None: not given)."""
    return {"machine_rank": machine_rank, "num_machines": num_machines, "main_process_ip": main_process_ip,
            "main_process_port": main_process_port}


def local_source(text: str) -> str:
    """A local checkpoint, run or model as given; for a run in remote storage (`URL[:STEP|:best]`) a verified copy of
    the checkpoint in the local cache (tools/remote.py), downloaded once."""
    from opentau_cli.store.storage import is_url

    if not is_url(text):
        return text
    from opentau_cli.tools.remote import local_checkpoint

    return str(local_checkpoint(text, echo=lambda line: typer.echo(line, err=True)))
