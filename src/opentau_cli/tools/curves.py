"""A run's training curves without TensorBoard: the loss (training and validation), the success rate in the
simulator (eval.env) and the learning rate by step, read from its metrics.jsonl and drawn to a PNG (`opentau checkpoint inspect RUN --plot FILE.png`)."""

from __future__ import annotations

import json
from pathlib import Path

from opentau_cli.errors import UserError
from opentau_cli.store.layout import METRICS
from opentau_cli.store.outputs import publishing

COMMAND = "checkpoint inspect --plot"
VALIDATION_KEYS = ("val_loss", "ema_val_loss")
SUCCESS = "eval/success_rate"  # store/evals.py SUCCESS_KEY: the launcher's evaluation's rows (kind "eval")


def read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{"loss" | "lr" | "val_loss" | "ema_val_loss": [(step, value), ...]} from the run's metrics.jsonl (a line cut
    short by a kill is skipped)."""
    curves: dict[str, list[tuple[int, float]]] = {"loss": [], "lr": [], SUCCESS: [], **{k: [] for k in VALIDATION_KEYS}}
    try:
        lines = (Path(run_dir) / METRICS).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        kind = record.get("kind")
        keys = ("loss", "lr") if kind == "train" else VALIDATION_KEYS if kind == "val" else (SUCCESS,) if kind == "eval" else ()
        for key in keys:
            if isinstance(record.get(key), (int, float)):
                curves[key].append((int(record["step"]), float(record[key])))
    return curves


def plot_curves(run_dir: Path, output: Path) -> Path:
    """Draw the run's loss and learning-rate curves into `output` (a new .png, outside any run: store/outputs.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output = Path(output)
    if output.suffix.lower() != ".png":
        raise UserError(f"--plot {output}: name a .png file.")
    curves = read_curves(run_dir)
    if not curves["loss"]:
        raise UserError(f"{Path(run_dir) / METRICS} holds no training step yet: nothing to plot.")
    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    dots = "." if len(curves["loss"]) <= 50 else None  # a short run's few records stay visible
    loss_ax.plot(*zip(*curves["loss"]), label="train loss", linewidth=1, marker=dots)
    for key in VALIDATION_KEYS:
        if curves[key]:
            loss_ax.plot(*zip(*curves[key]), "o-", label=key.replace("_", " "), markersize=3)
    loss_ax.set_ylabel("loss")
    loss_ax.legend(loc="upper left")
    if curves[SUCCESS]:  # beside the loss, on its own axis: the success rate rises as the loss falls (or does not)
        success_ax = loss_ax.twinx()
        success_ax.plot(*zip(*sorted(curves[SUCCESS])), "s-", color="tab:red", label="success rate", markersize=4)
        success_ax.set_ylim(-0.02, 1.02)
        success_ax.set_ylabel("success rate")
        success_ax.legend(loc="upper right")
    loss_ax.grid(alpha=0.3)
    lr_ax.plot(*zip(*curves["lr"]), color="tab:green", label="learning rate", marker=dots)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("step")
    lr_ax.grid(alpha=0.3)
    loss_ax.set_title(Path(run_dir).name)
    fig.tight_layout()
    with publishing(output, force=False, source=run_dir, command=COMMAND) as staging:
        fig.savefig(staging, format="png", dpi=100)
    plt.close(fig)
    return output
