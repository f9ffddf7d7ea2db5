"""`opentau eval`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from opentau_cli.cli.common import (
    OVERRIDES_CONTEXT, DeviceOpt, ForceOpt, PolicySourceArg, WeightsOpt, config_overrides, handle_errors, local_source,
    progress_bar,
)


@handle_errors
def eval_cmd(
    ctx: typer.Context,
    source: PolicySourceArg,
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
) -> None:
    """Sample action chunks on held-out episodes and report the action error (per joint and per chunk position)
    against the recorded actions and against the mean-action baseline; writes eval.json and eval.png.

    Dotted overrides follow, e.g. --dataset.root=DIR (default: the run's dataset) or --policy.num_inference_steps=5.

    Examples:

      opentau eval outputs/train/pi05_tiny

      opentau eval exported/pi05_lerobot --dataset.root=data/my_robot --episodes 40,41,42 --output outputs/eval/mine

      opentau eval outputs/train/mixture --dataset reach_video

      opentau eval my-org/pi05-pick-bottle --dataset.root=data/my_robot   # a pushed export (its commit is printed)
    """
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


def register(app: typer.Typer) -> None:
    app.command("eval", context_settings=OVERRIDES_CONTEXT)(eval_cmd)
