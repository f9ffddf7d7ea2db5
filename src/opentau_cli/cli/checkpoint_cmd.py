"""`opentau checkpoint consolidate | export | inspect | verify | list | push`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from opentau_cli.cli.common import (
    BreakLockOpt, JsonOpt, WeightsOpt, handle_errors, local_source, make_app, progress_bar,
)
from opentau_cli.units import SIZE_HELP

app = make_app("Consolidate, export, inspect, verify, list and push checkpoints.")


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


@app.command("consolidate")
@handle_errors
def consolidate_cmd(
    checkpoint_dir: str = typer.Argument(..., help="A DeepSpeed or FSDP2 checkpoint directory (or the dir holding its tag "
                                                   "dirs), or URL:STEP of a run in remote storage (with --output)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 (default, like zero_to_fp32.py) or bf16."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", "--max_shard_size", help=f"Above this, write HF shards + model.safetensors.index.json ({SIZE_HELP})."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output directory or .safetensors file, outside any run (default: "
                                                                      "CHECKPOINT_DIR/model.safetensors); missing parents are made."),
    force: bool = typer.Option(False, "--force", help="Redo it even if the checkpoint is already consolidated; with --output, "
                                                      "replace an earlier output of this command (never a run or anything else)."),
    weights: WeightsOpt = None,
) -> None:
    """Turn DeepSpeed ZeRO-2/3 shards of any number of ranks into model.safetensors, streaming.

    Reads the shards lazily (never unpickling arbitrary objects), writes tensor by tensor, atomically.
    The result equals DeepSpeed's zero_to_fp32.py output tensor for tensor.

    Examples:

      opentau checkpoint consolidate outputs/train/pi05/checkpoints/000040/

      opentau checkpoint consolidate outputs/train/pi05/checkpoints/last --dtype bf16 --max-shard-size 2GB
    """
    from opentau_cli.errors import UserError
    from opentau_cli.store.storage import is_url
    from opentau_cli.tools.consolidate import consolidate

    if is_url(checkpoint_dir) and output is None:
        raise UserError(f"{checkpoint_dir} is in remote storage, where nothing is written: pass --output DIR for the "
                        "consolidated weights.")
    checkpoint_dir = Path(local_source(checkpoint_dir))
    with progress_bar("consolidating", "MB") as progress:
        result = consolidate(checkpoint_dir, dtype=dtype, max_shard_size=max_shard_size, output=output, force=force,
                             weights=weights, progress=progress)
    for note in result.notes:
        typer.echo(note, err=True)
    if result.already:
        typer.echo(f"{checkpoint_dir} is already consolidated ({result.files[0]}); nothing to do (use --force to redo it).")
        return
    names = ", ".join(str(p) for p in result.files)
    typer.echo(f"Wrote {names}: {result.num_tensors} tensors, {human(result.total_bytes)} ({dtype}).")


@app.command("export")
@handle_errors
def export_cmd(
    checkpoint: str = typer.Argument(..., help="A checkpoint directory, a run directory (its newest complete checkpoint), "
                                              "RUN:STEP, RUN:best, or URL[:STEP|:best] of a run in remote storage."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="New (or empty) directory, outside any run, for the model; "
                                                                      "missing parents are made (optional with --push-to-hub)."),
    layout: str = typer.Option("opentau", "--layout", help="opentau (OpenTau, statistics in the weights), lerobot or openpi."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, or bf16 (norms, embeddings and action/time projections stay fp32, as openpi keeps them)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="The dataset of a mixture run whose robot the model serves, "
                                                                 "by its name (default: the first): its statistics and widths."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", metavar="USER/REPO[@BRANCH]", help=(
        "Also push the export, with a model card (and the checkpoint's eval plot), to this Hugging Face model repo as "
        "one commit; the token comes from HF_TOKEN or `hf auth login`. The checkpoint is verified first.")),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: create the repo private."),
    eval_dir: Optional[Path] = typer.Option(None, "--eval", help=(
        "With --push-to-hub: the `opentau eval` output of this checkpoint for the card (default: the newest one under "
        "outputs/eval/ that evaluated it).")),
    force: bool = typer.Option(False, "--force", help=(
        "Replace an earlier output of this command at --output; with --push-to-hub, also push to a repo holding files "
        "the export does not replace (they are kept, and named).")),
    weights: WeightsOpt = None,
) -> None:
    """Write a checkpoint's policy as a plain model in a published layout, with its normalization statistics in
    that layout's place and a config.json in its convention (DeepSpeed shards are gathered, streaming); with
    --push-to-hub, publish it to the Hugging Face Hub with a model card.

    Examples:

      opentau checkpoint export outputs/train/pi05/checkpoints/last --output exported/pi05_lerobot --layout lerobot

      opentau checkpoint export outputs/train/pi05 --output exported/pi05_openpi --layout openpi --dtype bf16

      opentau checkpoint export outputs/train/mixture --output exported/reach_video --dataset reach_video

      opentau checkpoint export outputs/train/pi05:best --layout lerobot --push-to-hub my-org/pi05-pick-bottle --private
    """
    from opentau_cli.errors import UserError

    if push_to_hub is not None:
        _push(checkpoint, push_to_hub, layout=layout, dtype=dtype, dataset=dataset, weights=weights, private=private,
              force=force, output=output, eval_dir=eval_dir)
        return
    if output is None:
        raise UserError("Give --output DIR (where the model is written), --push-to-hub USER/REPO, or both.")
    if private or eval_dir is not None:
        raise UserError(f"{'--private' if private else '--eval'} goes with --push-to-hub.")
    from opentau_cli.tools.export import export

    with progress_bar("exporting", "MB") as progress:
        result = export(Path(local_source(checkpoint)), output, layout=layout, dtype=dtype, dataset=dataset, force=force,
                        weights=weights, progress=progress)
    typer.echo(f"Wrote {result.output} ({layout} layout, {dtype}, {result.weights} weights of step {result.step} from "
               f"{result.checkpoint}): {result.num_tensors} tensors, {human(result.total_bytes)}; "
               f"files: {', '.join(str(f.relative_to(result.output)) for f in result.files)}.")


def _push(checkpoint: str, target: str, **options) -> None:
    from opentau_cli.tools.publish import push

    pushed = push(checkpoint, target, locate=local_source, echo=lambda m: typer.echo(m, err=True), **options)
    if pushed.eval_dir is not None:
        typer.echo(f"Model card: with the evaluation in {pushed.eval_dir}.", err=True)
    if pushed.removed:
        typer.echo(f"Removed {', '.join(pushed.removed)} of the earlier push: no evaluation of this checkpoint was found "
                   "(--eval DIR names one).", err=True)
    if pushed.kept:
        typer.echo(f"Kept {len(pushed.kept)} file(s) of {pushed.target.repo_id} the export does not replace (--force "
                   f"never deletes): {', '.join(pushed.kept)}.", err=True)
    what = (f"{pushed.layout} layout, {pushed.weights} weights of step {pushed.step}: {len(pushed.files)} files, "
            f"{human(pushed.total_bytes)}")
    if pushed.unchanged:
        typer.echo(f"{pushed.target} already holds exactly this export ({what}) at commit {pushed.commit}: no new commit.")
    else:
        typer.echo(f"Pushed to {pushed.target}{' (a new repo)' if pushed.created else ''}: commit {pushed.commit} ({what}); "
                   f"{pushed.url}")
    typer.echo(f"Pin it: opentau serve {pushed.target.repo_id}@{pushed.commit}")


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@app.command("inspect")
@handle_errors
def inspect_cmd(checkpoint_dir: str = typer.Argument(..., help="A checkpoint directory, a run directory, or a run in "
                                                               "remote storage: URL (its checkpoints) or URL:STEP."),
                as_json: JsonOpt = False,
                plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE.png", help=(
                    "Also draw the run's loss (training and validation), success rate (eval.env) and learning-rate "
                    "curves by step into this new PNG, from its metrics.jsonl (no TensorBoard needed)."))) -> None:
    """Show step, backend, world size, preset, parameters, dtypes and files of a checkpoint; of a run directory, its
    checkpoints, what `last` designates, the branch it is on (what `opentau resume RUN` continues) and rollbacks.

    Examples:

      opentau checkpoint inspect outputs/train/pi05/checkpoints/last --json

      opentau checkpoint inspect outputs/train/pi05 --plot pi05_curves.png
    """
    from opentau_cli.store.runs import run_dir_of
    from opentau_cli.store.storage import is_url
    from opentau_cli.tools.info import inspect_checkpoint, inspect_run, is_run_dir
    from opentau_cli.tools.remote import split_target

    if is_url(checkpoint_dir) and split_target(checkpoint_dir)[0] == checkpoint_dir:
        _print_remote(checkpoint_dir, as_json)
        return
    checkpoint_dir = Path(local_source(checkpoint_dir))
    if plot is not None:
        from opentau_cli.tools.curves import plot_curves

        run = checkpoint_dir if is_run_dir(checkpoint_dir) else run_dir_of(checkpoint_dir.resolve())
        typer.echo(f"Drew the loss and learning-rate curves of {run} into {plot_curves(run, plot)}.", err=True)
    if is_run_dir(checkpoint_dir):
        _print_run(inspect_run(checkpoint_dir), as_json)
        return
    info = inspect_checkpoint(checkpoint_dir)
    if as_json:
        typer.echo(json.dumps(info.to_dict(), indent=2))
        return
    backend = info.backend or "-"
    if info.zero_stage is not None and info.backend == "deepspeed":
        backend += f" ZeRO-{info.zero_stage}"
    consolidated = {None: "n/a (weights in model.safetensors)", True: "yes", False: "no"}[info.consolidated]
    complete = ("yes: every file at its manifest size (hashes not checked; `opentau checkpoint verify` re-hashes)"
                if info.complete else "no: manifest missing or not matching the files")
    lines = [
        ("checkpoint", info.path), ("step", info.step), ("backend", backend), ("world size", info.world_size),
        ("mixed precision", info.mixed_precision), ("policy", " ".join(x for x in (info.policy_type, info.preset) if x) or None),
        ("parameters", f"{info.parameters:,}" + (f" ({info.trainable_parameters:,} trainable)" if info.trainable_parameters is not None else "")
         + (f"  [{info.parameters_source}]" if info.parameters_source else "") if info.parameters is not None else None),
        ("dtypes", ", ".join(f"{k}: {v:,}" for k, v in info.dtypes.items()) or None),
        ("consolidated", consolidated), ("complete", complete),
        ("saved", info.time), ("size", human(info.total_bytes)),
        ("designated by", ", ".join(f"checkpoints/{link}" for link in info.links) or None),
    ]
    if info.evaluation:
        e = info.evaluation
        lines.append(("success rate", f"{e['success_rate']:.1%} ({e['successes']} of {e['episodes_run']} episodes from "
                                      f"seed {e['seed']} in {e['env']}; mean return {e['mean_return']:.3g}, mean "
                                      f"length {e['mean_steps']:.1f} steps)" if e.get("status") == "done" else
                      f"{e['status']}" + (f": {e['reason']}" if e.get("reason") else "")))
    if info.lineage is not None:
        parent = (info.lineage.get("parent") or {}).get("name")
        lines.append(("continues", f"{parent or 'nothing (the run started here)'}, written by launch {info.lineage.get('launch')}"))
    if info.lora:
        base = info.lora.get("base") or {}
        source = base.get("source") or f"the seeded initial policy (seed {base.get('seed')})"
        lines.append(("lora", f"rank {info.lora['rank']}, alpha {info.lora['alpha']:g}: holds the adapters, the fully "
                              f"trained modules and the buffers; the frozen base is not copied ({source})"))
    for k, v in lines:
        typer.echo(f"{k + ':':17}{'-' if v is None else v}")
    typer.echo("files:")
    for rel, size in sorted(info.files.items()):
        typer.echo(f"  {human(size):>10}  {rel}")


def _names(names: list[str]) -> str:
    return ", ".join(names) if names else "-"


def _print_run(run, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(run.to_dict(), indent=2))
        return
    last = "-"
    if run.last:
        state = {True: "complete at its manifest sizes", False: "INCOMPLETE: fails its manifest", None: "MISSING"}[run.last_complete]
        last = f"{run.last} ({state})"
    lines = [
        ("run", run.path),
        ("checkpoints", f"{len(run.checkpoints)}: {_names(run.checkpoints)}"),
        ("last", last),
        ("best", run.best or "- (none kept: checkpoint.keep_best)"),
        ("current branch", " -> ".join(run.branch) or "-"),
        ("resume continues", run.resumes_from or "nothing: no complete checkpoint on the current branch"),
        ("launches", _names(run.launches)),
    ]
    if run.off_branch:
        lines.append(("off the branch", f"{_names(run.off_branch)} (`resume` does not continue them)"))
    for stamp, names in run.rolled_back.items():
        lines.append(("rolled back", f"{_names(names)} (moved to rolled_back/{stamp}/, kept)"))
    if run.remote:
        states = run.remote.get("checkpoints") or {}
        by_state = {s: [n for n, v in states.items() if v == s] for s in ("remote", "uploading", "local")}
        lines.append(("remote", f"{run.remote.get('url')}: stored {_names(by_state['remote'])}; uploading "
                                f"{_names(by_state['uploading'])}; local only {_names(by_state['local'])}"
                                + (f" (last upload error: {run.remote['error']})" if run.remote.get("error") else "")))
    if run.evaluations:
        from opentau_cli.tools.info import describe_evaluation

        envs = {e["env"] for e in run.evaluations.values() if e.get("env")}
        lines.append(("success rate", ", ".join(f"{n} {describe_evaluation(e)}" for n, e in run.evaluations.items())
                      + (f" (in {', '.join(sorted(envs))})" if envs else "")))
    if run.interrupted:
        lines.append(("interrupted", f"{_names(run.interrupted)} (not checkpoints; the next run removes them)"))
    for r in run.restarts:
        if r.get("final"):
            lines.append(("ended", f"{r.get('time')}: {r.get('cause')}; no restart left (launch {r.get('run_id')})"))
            continue
        source = f"from checkpoint {r['resumed_from']}" if r.get("resumed_from") else "from the start (no checkpoint yet)"
        world, before = r.get("world"), r.get("world_before")
        on = f" on {world} process{'es' * (world != 1)} (was {before})" if world and before and world != before else ""
        lines.append(("re-formed" if r.get("regroup") else f"restart {r.get('restart')}",
                      f"{r.get('time')}: {r.get('cause')}; continued {source} at step {r.get('step')}{on} "
                      f"(launch {r.get('run_id')})"))
    for k, v in lines:
        typer.echo(f"{k + ':':18}{v}")
    typer.echo("Hashes not checked: `opentau checkpoint list RUN --verify` re-hashes every file; "
               "`opentau checkpoint inspect RUN/checkpoints/<step>` shows one checkpoint.")


@app.command("verify")
@handle_errors
def verify_cmd(path: str = typer.Argument(..., help="A checkpoint directory, a run directory, or a run in remote storage "
                                                    "(URL: every committed checkpoint, verified into the cache: downloaded "
                                                    "once, its copies used while the store cannot be reached)."),
               as_json: JsonOpt = False) -> None:
    """Re-hash every file of a checkpoint (or of every checkpoint of a run) against its manifest; exit 1 on any problem.

    Example: opentau checkpoint verify outputs/train/pi05
    """
    from opentau_cli.store.storage import is_url
    from opentau_cli.tools.info import verify_path
    from opentau_cli.tools.remote import verify_remote

    report = verify_remote(path, echo=lambda line: typer.echo(line, err=True)) if is_url(path) else verify_path(Path(path))
    if as_json:
        typer.echo(json.dumps({"ok": report.ok, "checkpoints": report.checkpoints, "notes": report.notes,
                               "problems": report.problems}, indent=2))
    else:
        for ckpt, problems in report.checkpoints.items():
            typer.echo(f"{'OK  ' if not problems else 'FAIL'} {ckpt}")
            for p in problems:
                typer.echo(f"     {p}")
        for note in report.notes:
            typer.echo(f"note: {note}")
        for p in report.problems:
            typer.echo(f"FAIL {p}")
    if not report.ok:
        bad = sum(1 for p in report.checkpoints.values() if p) + len(report.problems)
        typer.echo(f"Error: verification failed ({bad} problem(s) above).", err=True)
        raise typer.Exit(1)


@app.command("list")
@handle_errors
def list_cmd(
    run_dir: str = typer.Argument(..., help="A run directory (holding checkpoints/), or a run in remote storage (URL)."),
    verify: bool = typer.Option(False, "--verify", help="Also re-hash every file against its manifest (reads every byte)."),
    as_json: JsonOpt = False,
) -> None:
    """List the checkpoints of a run: step, time, size, complete or not, which ones `last` and `best` point at, the
    branch `last` is on (what `opentau resume RUN` continues) and checkpoints a rollback moved aside.

    Without --verify, "complete" means every file is there at its manifest size; --verify re-hashes them and exits 1
    when a checkpoint fails.

    Examples:

      opentau checkpoint list outputs/train/pi05

      opentau checkpoint list outputs/train/pi05 --verify
    """
    from dataclasses import asdict

    from opentau_cli.store.storage import is_url
    from opentau_cli.tools.info import list_run

    if is_url(run_dir):
        _list_remote(run_dir, verify, as_json)
        return
    run_dir = Path(run_dir)
    rows = list_run(run_dir, verify=verify)
    failed = [r.name for r in rows if verify and r.verified is False]
    if as_json:
        typer.echo(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        _print_list(run_dir, rows, verify)
    if failed:  # as `checkpoint verify`: a run whose checkpoints fail their manifests is not a success
        typer.echo(f"Error: {len(failed)} checkpoint(s) fail verification: {', '.join(failed)}.", err=True)
        raise typer.Exit(1)


def _print_list(run_dir: Path, rows, verify: bool) -> None:
    from opentau_cli.tools.info import describe_evaluation

    if not rows:
        typer.echo(f"No checkpoints in {run_dir}.")
        return
    head = "verified" if verify else "sizes ok"
    width = max(24, *(len(r.name) + 2 for r in rows))
    success = any(r.evaluation for r in rows)  # a run evaluated in a simulator (eval.env): its success rates
    typer.echo(f"{'':2}{'checkpoint':<{width}}{'step':>8}  {'saved':<26}{'size':>11}  {head:<9}{'consolidated':<13}"
               f"{'is':<10}{'branch':<9}{'parent':<8}" + (f"{'success':<9}" if success else ""))
    for r in rows:
        cons = {None: "n/a", True: "yes", False: "no"}[r.consolidated]
        branch = "current" if r.branch else ("rolled" if r.rolled_back else "-")
        links = "+".join(name for name, on in (("last", r.last), ("best", r.best)) if on) or "-"
        typer.echo(f"{'->' if r.last else '':2}{r.name:<{width}}{r.step if r.step is not None else '-':>8}  {str(r.time):<26}"
                   f"{human(r.bytes):>11}  {'yes' if r.complete else 'NO':<9}{cons:<13}{links:<10}{branch:<9}"
                   f"{r.parent or '-':<8}" + (f"{describe_evaluation(r.evaluation):<9}" if success else "") + r.note)
    typer.echo("(-> and is last = checkpoints/last points at it; is best = checkpoints/best (checkpoint.keep_best); branch "
               "current = on last's branch, which `opentau resume RUN` continues; rolled = moved aside by a rollback, "
               "kept under rolled_back/)")
    if success:
        typer.echo("(success = its success rate in the simulator, eval.env; skipped = a newer checkpoint was published "
                   "before its turn; waiting / running = not evaluated yet)")
    if verify:
        typer.echo("Every file re-hashed against its checkpoint's manifest.")
    else:
        typer.echo("Hashes not checked (sizes only): `opentau checkpoint list RUN --verify` re-hashes every file.")


def _list_remote(url: str, verify: bool, as_json: bool) -> None:
    from opentau_cli.tools.remote import list_remote

    if verify:
        verify_cmd(url, as_json)
        return
    rows, found = list_remote(url)
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in rows], indent=2))
        return
    if not rows:
        typer.echo(f"No checkpoints in {url}.")
        return
    typer.echo(f"{'':2}{'checkpoint':<12}{'step':>8}{'size':>12}  {'state':<12}{'is':<10}")
    for r in rows:
        typer.echo(f"{'->' if 'last' in r.marks else '':2}{r.name:<12}{r.step:>8}{human(r.size):>12}  {r.state:<12}"
                   f"{'+'.join(r.marks) or '-':<10}{r.problem or ''}")
    typer.echo("(committed = its manifest is stored and every file it lists is there at its size (hashes are checked "
               "on download: `checkpoint verify URL`); damaged = a file is missing or at another size; partial = an "
               "upload that never committed, which readers ignore and the next commit removes)")
    if found.last_problem:
        typer.echo(f"Note: {found.last_problem}; `opentau resume {found.url}` repairs it.")


def _print_remote(url: str, as_json: bool) -> None:
    from opentau_cli.tools.remote import list_remote, open_run

    remote = open_run(url)
    rows, found = list_remote(url)
    record = remote.run_record() or {}
    info = {"url": remote.url, "run_dir": record.get("run_dir"), "last": found.last, "best": found.best,
            "resumes_from": found.newest, "committed": found.committed, "damaged": sorted(found.damaged),
            "partial": found.partial}
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    for k, v in (("remote", info["url"]), ("run from", info["run_dir"] or "-"),
                 ("last", (info["last"] or "-") + (f" ({found.last_problem})" if found.last_problem else "")),
                 ("best", info["best"] or "-"), ("committed", _names(info["committed"])),
                 ("damaged", _names(info["damaged"])),
                 ("partial", _names(info["partial"]) + (" (uploads that never committed)" if info["partial"] else ""))):
        typer.echo(f"{k + ':':18}{v}")
    typer.echo(f"`opentau resume {remote.url}` continues from {info['resumes_from'] or 'nothing'}; "
               f"`opentau checkpoint inspect {remote.url}:STEP` shows one checkpoint.")


@app.command("push")
@handle_errors
def push_cmd(run_dir: Path = typer.Argument(..., help="A run directory whose run has a checkpoint.remote."),
             break_lock: BreakLockOpt = False) -> None:
    """Upload the run's checkpoints that are local only (newer than the store's newest) to its checkpoint.remote,
    taking the store's lease as a launch does.

    Example: opentau checkpoint push outputs/train/pi05
    """
    from opentau_cli.process.uploader import push

    if not (run_dir / "checkpoints").is_dir():
        from opentau_cli.errors import UserError

        raise UserError(f"{run_dir} is not a run directory (no checkpoints/ in it).")
    push(run_dir, break_lock=break_lock, echo=lambda m: typer.echo(m, err=True))
