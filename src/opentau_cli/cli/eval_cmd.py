"""`opentau eval`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from opentau_cli.cli.common import (
    OVERRIDES_CONTEXT, DeviceOpt, ForceOpt, PolicySourceArg, WeightsOpt, config_overrides, handle_errors, local_source,
    progress_bar,
)
from opentau_cli.errors import UserError


@handle_errors
def eval_cmd(
    ctx: typer.Context,
    source: Annotated[Optional[str], typer.Argument(help=PolicySourceArg.__metadata__[0].help)] = None,
    episodes: Optional[str] = typer.Option(None, "--episodes", help="Episode indices, e.g. 0,3,5 (default: the run's "
                                                                    "held-out episodes; for a model, every episode)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="New (or empty) directory, outside any run, for eval.json and eval.png (default: outputs/eval/<name>)."),
    force: ForceOpt = False,
    batch_size: int = typer.Option(8, "--batch-size", "--batch_size", help="Chunks sampled per forward."),
    stride: int = typer.Option(1, "--stride", help="Evaluate a chunk every N frames."),
    plot_episodes: int = typer.Option(3, "--plot-episodes", help="Episodes drawn in eval.png."),
    device: DeviceOpt = None,
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling noise."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="The dataset of a mixture run to evaluate on, by its name "
                                                                 "(default: the first), with its own statistics."),
    weights: WeightsOpt = None,
    env: Optional[str] = typer.Option(None, "--env", help="Roll the policy out in a simulator instead: metaworld:TASK "
                                                         "(e.g. metaworld:push-v3), pusht, aloha:transfer_cube, "
                                                         "aloha:insertion (needs the [sim] extra)."),
    rollouts: int = typer.Option(50, "--rollouts", help="--env: episodes, from seeds SEED, SEED+1, ..."),
    envs: int = typer.Option(1, "--envs", help="--env: envs run at once, their inference batched."),
    videos: int = typer.Option(0, "--videos", help="--env: mp4 videos of the first K episodes."),
    record_steps: int = typer.Option(0, "--record-steps", help="--env: the first K steps' observations and actions "
                                                              "of every episode into steps.npz."),
    camera_map: Optional[list[str]] = typer.Option(None, "--camera-map", help="--env: POLICY_CAMERA=ENV_CAMERA "
                                                                             "(repeatable)."),
    image_size: Optional[int] = typer.Option(None, "--image-size", help="--env: side of the rendered images (default: "
                                                                       "the policy's image resolution)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="--env: steps per episode (default: the env's)."),
    render: str = typer.Option("fast", "--render", help="--env: fast (shadows, multisampling and reflections off: "
                                                         "~10x cheaper on a CPU) or shipped (the simulator's own scene)."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="--env: replay this dataset's recorded actions from "
                                                                "each episode's recorded seed (no policy)."),
) -> None:
    """Sample action chunks on held-out episodes and report the action error (per joint and per chunk position)
    against the recorded actions and against the mean-action baseline; writes eval.json and eval.png. With --env,
    roll the policy out in a simulator instead and report its success rate (eval_info.json, videos, steps.npz).

    Dotted overrides follow, e.g. --dataset.root=DIR (default: the run's dataset) or --policy.num_inference_steps=5.

    Examples:

      opentau eval outputs/train/pi05_tiny

      opentau eval exported/pi05_lerobot --dataset.root=data/my_robot --episodes 40,41,42 --output outputs/eval/mine

      opentau eval outputs/train/mixture --dataset reach_video

      opentau eval my-org/pi05-pick-bottle --dataset.root=data/my_robot   # a pushed export (its commit is printed)

      opentau eval outputs/train/reach --env metaworld:reach-v3 --rollouts 50 --seed 1000 --envs 4 --videos 5

      opentau eval --replay data/reach --env metaworld:reach-v3   # the dataset's actions from its seeds
    """
    if replay is not None or env is not None:
        return _in_simulator(ctx, source, env, replay, rollouts, seed, output, envs, videos, record_steps, camera_map,
                             image_size, max_steps, device, dataset, weights, force, render)
    if source is None:
        raise UserError("Give a run, checkpoint or model to evaluate (or --replay DATASET --env ENV).")
    from opentau_cli.tools.evaluate import evaluate, parse_episodes

    with progress_bar("evaluating", "chunks") as progress:
        result = evaluate(local_source(source), overrides=config_overrides(ctx), episodes=parse_episodes(episodes),
                          output=output, batch_size=batch_size, stride=stride, plot_episodes=plot_episodes, device=device,
                          seed=seed, dataset=dataset, echo=lambda m: typer.echo(m, err=True), force=force,
                          weights=weights, progress=progress)
    r = result.report
    ours, mean = r["policy"], r["mean_action"]
    typer.echo(f"{'':14}{'policy':>12}{'mean action':>14}")
    typer.echo(f"{'action MSE':14}{ours['mse']:>12.5g}{mean['mse']:>14.5g}")
    typer.echo(f"{'action MAE':14}{ours['mae']:>12.5g}{mean['mae']:>14.5g}")
    typer.echo("MAE per joint:          " + " ".join(f"{x:.4g}" for x in ours["per_joint"]["mae"]))
    typer.echo("MAE per chunk position: " + " ".join(f"{x:.4g}" for x in ours["per_step"]["mae"]))
    verdict = "beats" if r["beats_mean_action"] else "does NOT beat"
    episodes_text = "held-out" if r["held_out"] else "selected"
    typer.echo(f"The policy {verdict} the mean action on {r['samples']} chunks of {len(r['episodes'])} {episodes_text} "
               f"episodes (MSE ratio {r['mse_ratio']:.3f}).")
    typer.echo(f"Wrote {result.json_path}" + (f" and {result.plot_path}" if result.plot_path else "") + ".")


def _in_simulator(ctx, source, env, replay, rollouts, seed, output, envs, videos, record_steps, camera_map,
                  image_size, max_steps, device, dataset, weights, force, render) -> None:
    if render not in ("fast", "shipped"):
        raise UserError(f"--render {render}: expected fast or shipped.")
    if env is None:
        raise UserError("--replay needs --env, the simulator to replay the dataset in (e.g. --env metaworld:reach-v3).")
    if replay is not None:
        from opentau_cli.sim.replay import replay_dataset

        with progress_bar("replaying", "episodes") as progress:
            result = replay_dataset(replay, env, progress=lambda d, t, s: progress(d, t, f"success {s}/{d}"))
        typer.echo(f"Replayed {result['episodes_run']} episodes of {replay} in {result['env']}: success rate "
                   f"{result['success_rate']:.1%} (95% interval {result['success_rate_95'][0]:.1%}-"
                   f"{result['success_rate_95'][1]:.1%}).")
        return
    if source is None:
        raise UserError("Give a run, checkpoint or model to evaluate in the simulator.")
    from opentau_cli.sim.rollout import parse_camera_map, evaluate_in_sim

    with progress_bar("rolling out", "episodes") as progress:
        info = evaluate_in_sim(
            local_source(source), env, rollouts=rollouts, seed=seed, output=output, envs=envs, videos=videos,
            record=record_steps, camera_map=parse_camera_map(camera_map),
            image_size=(image_size, image_size) if image_size else None, max_steps=max_steps,
            overrides=config_overrides(ctx), dataset=dataset, device=device, weights=weights, force=force,
            fast_render=render == "fast", echo=lambda m: typer.echo(m, err=True),
            progress=lambda d, t, s: progress(d, t, f"success {s}/{d} ({s / d:.0%})"))
    low, high = info["success_rate_95"]
    typer.echo(f"Success rate {info['success_rate']:.1%} ({info['successes']} of {info['episodes_run']}; 95% interval "
               f"{low:.1%}-{high:.1%}) in {info['env']}; mean return {info['mean_return']:.3g}, mean episode length "
               f"{info['mean_steps']:.1f} steps.")
    typer.echo(f"Actions outside the env's action space: {info['clipped_action_share']:.1%} of action values.")
    typer.echo(f"Wrote {info['output']}.")


def register(app: typer.Typer) -> None:
    app.command("eval", context_settings=OVERRIDES_CONTEXT)(eval_cmd)
