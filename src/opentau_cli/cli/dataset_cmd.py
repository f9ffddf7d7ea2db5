"""`opentau dataset synth | info`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from opentau_cli.cli.common import ForceOpt, JsonOpt, handle_errors, make_app
from opentau_cli.errors import UserError

app = make_app("Create and describe LeRobot-format datasets.")


@app.command("synth")
@handle_errors
def synth_cmd(
    out_dir: Path = typer.Argument(..., help="New (or empty) directory, outside any run, to write the dataset into; missing parents are made."),
    episodes: int = typer.Option(30, "--episodes", help="Number of episodes."),
    steps_per_episode: int = typer.Option(50, "--steps-per-episode", "--steps_per_episode", help="Frames per episode."),
    cameras: int = typer.Option(1, "--cameras", help="Cameras (64x64 PNG images stored in the parquet files)."),
    fmt: str = typer.Option("v2.1", "--format", help="LeRobot layout: v2.1 or v3.0."),
    seed: int = typer.Option(0, "--seed", help="Same seed and options give the same data."),
    video: bool = typer.Option(False, "--video", help="Store cameras as mp4 (H.264, needs PyAV) instead of PNG in parquet."),
    force: ForceOpt = False,
    env: str = typer.Option(None, "--env", help="Record MetaWorld's scripted experts instead: metaworld:TASK[,TASK...] "
                                                "(LeRobot v3.0, mp4, 80 fps; needs the [sim] extra)."),
    image_size: int = typer.Option(64, "--image-size", help="--env: side of the recorded camera images."),
    keep_failed: bool = typer.Option(False, "--keep-failed", help="--env: also keep the episodes the expert failed."),
) -> None:
    """Write a small learnable LeRobot-format dataset (2-D point reaching), offline; or, with --env, demonstrations
    of MetaWorld's scripted experts (episode i of each task from seed SEED+i).

    Example: `opentau dataset synth /tmp/reach --episodes 20 --format v3.0`

    Example: `opentau dataset synth /tmp/mw --env metaworld:reach-v3,push-v3 --episodes 20 --seed 0`
    """
    if env is not None:
        from opentau_cli.cli.common import progress_bar
        from opentau_cli.sim.experts import write_expert_dataset

        with progress_bar("recording", "episodes") as progress:
            done = write_expert_dataset(out_dir, env, episodes=episodes, seed=seed, image_size=image_size,
                                        keep_failed=keep_failed, force=force, progress=progress)
        typer.echo(f"Wrote {done['kept']} expert episodes of {env} ({done['failed']} failed"
                   f"{', kept' if keep_failed else ', left out'}; LeRobot v3.0, {image_size}x{image_size} mp4 at 80 fps) "
                   f"to {done['path']}")
        return
    from opentau_cli.data.synth import write_synth

    out = write_synth(out_dir, episodes=episodes, steps_per_episode=steps_per_episode, cameras=cameras, fmt=fmt, seed=seed, video=video, force=force)
    stored = "mp4" if video else "PNG in parquet"
    typer.echo(f"Wrote {episodes} episodes x {steps_per_episode} frames ({fmt}, {cameras} camera(s), {stored}) to {out}")


def _fmt_vec(values: list[float], limit: int = 8) -> str:
    shown = ", ".join(f"{v:.4g}" for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


@app.command("info")
@handle_errors
def info_cmd(
    target: str = typer.Argument(..., help="Dataset directory, @demo, a dataset in object storage (s3://bucket/prefix/dataset: "
                                           "its meta/ is read), or a training config JSON (describes its mixture)."),
    as_json: JsonOpt = False,
    verify: bool = typer.Option(False, "--verify", help="Also read every frame (decode every image / video frame) and fail on the first problem."),
    state_key: str = typer.Option("observation.state", "--state-key", help="State feature read by --verify."),
    action_key: str = typer.Option("action", "--action-key", help="Action feature read by --verify."),
) -> None:
    """Print features, episodes, frames, fps and stats of a dataset, or the datasets a training config mixes.

    Examples: `opentau dataset info /work/data/my_lerobot_dataset --json`;
    `opentau dataset info /work/data/my_lerobot_dataset --verify` (reads every frame, exit 2 naming the bad file);
    `opentau dataset info configs/examples/pi05_mixture_config.json` (each member, its weight and share of samples).
    """
    from opentau_cli.data import resolve_dataset_root
    from opentau_cli.data.info import describe_dataset, verify_dataset

    if target.endswith(".json"):
        if verify:
            raise UserError("--verify reads one dataset: pass its directory (each member's root) instead of a config.")
        _print_mixture(target, as_json)
        return
    from opentau_cli.store.storage import is_url

    root, files = resolve_dataset_root(target), None
    if is_url(target):  # its meta/ through this machine's cache (data/remote.py); --verify fetches every file
        from opentau_cli.config.model import DatasetConfig, MixtureMember
        from opentau_cli.data.remote import resolve

        every_camera = DatasetConfig(num_cameras=1024)
        files = resolve(MixtureMember(root=target), every_camera, "dataset").files
        root = files.root
    info = describe_dataset(root)
    if files is not None:
        info["root"] = files.url
    if verify:
        frames = verify_dataset(root, state_key=state_key, action_key=action_key, files=files)
        typer.echo(f"Verified: all {frames} frames of {info['episodes']} episodes read and decoded.", err=True)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(f"Dataset   {info['root']}")
    typer.echo(f"Layout    LeRobot {info['codebase_version']} ({info['robot_type'] or 'robot type not given'})")
    typer.echo(f"Episodes  {info['episodes']}")
    typer.echo(f"Frames    {info['frames']}")
    typer.echo(f"FPS       {info['fps']:g}")
    typer.echo(f"Cameras   {', '.join(info['cameras']) or 'none'}")
    for task in info["tasks"]:
        typer.echo(f"Task      {task}")
    typer.echo("Features")
    for key, f in info["features"].items():
        typer.echo(f"  {key:<34} {f['dtype']:<8} {f['shape']}")
    typer.echo("Stats")
    for key, s in info["stats"].items():
        if s is None:
            typer.echo(f"  {key}: none in meta/ (computed from the data when training)")
        else:
            typer.echo(f"  {key} mean {_fmt_vec(s['mean'])}")
            typer.echo(f"  {' ' * len(key)} std  {_fmt_vec(s['std'])}  ({s['source']})")


def _print_mixture(config_path: str, as_json: bool) -> None:
    from opentau_cli.config import load_config
    from opentau_cli.data.info import describe_mixture

    info = describe_mixture(load_config(config_path, {}))
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    members = info["members"]
    kind = f"a mixture of {len(members)} dataset{'s' if len(members) > 1 else ''}" if info["mixture"] else "one dataset"
    typer.echo(f"Config    {config_path}: {kind}")
    typer.echo(f"Epoch     {info['draws_per_epoch']} draws (the training frames of all datasets), order by seed {info['seed']}")
    typer.echo(f"{'dataset':<24} {'weight':>7} {'share':>7} {'draws/epoch':>12} {'passes/epoch':>13} {'episodes train/val':>19}  layout  fps")
    for m in members:
        typer.echo(f"{m['name'][:24]:<24} {m['weight']:>7g} {m['share']:>7.1%} {m['draws_per_epoch']:>12} {m['passes_per_epoch']:>13.2f} "
                   f"{str(m['train_episodes']) + '/' + str(m['val_episodes']):>19}  {m['codebase_version'] or '?':<6}  {m['fps']:g}")
    for m in members:
        typer.echo(f"  {m['name']}: {m['root']}; state {m['state']}, action {m['action']}, cameras {', '.join(m['cameras']) or 'none'}")
