"""Offline evaluation: sample action chunks on held-out episodes and compare them with the recorded actions and with
the mean-action baseline (always predicting the mean action of the policy's statistics), per joint and per chunk
position; `eval.json` and a PNG of predicted vs recorded trajectories.

The policy comes from a training checkpoint (a run or checkpoint directory: its own train_config.json, its held-out
episodes by default) or from a model in any layout `policy.pretrained_path` takes (a file, a directory such as
`checkpoint export` writes, or a Hugging Face repo id; its config.json and its weights' shapes say how to build it,
and every episode of the dataset is evaluated by default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from opentau_cli.config.model import MixtureMember, TrainConfig
from opentau_cli.data.mixture import select_member
from opentau_cli.errors import UserError
from opentau_cli.store.outputs import check_target, publishing, writable_parent
from opentau_cli.tools.inference import (
    describe_hub, describe_weights, device_named, for_inference, from_checkpoint, from_model, is_training_checkpoint,
    model_policy_config, pinned_model, sample,
)

EVAL_JSON = "eval.json"
EVAL_PLOT = "eval.png"
COMMAND = "eval"  # its name in the output convention's marker (store/outputs.py)


@dataclass
class Evaluated:
    """What `evaluate` measured and where it wrote it."""

    report: dict
    json_path: Path
    plot_path: Path | None


# ------------------------------------------------------------------------------------------- the data

def _dataset(cfg: TrainConfig, member: MixtureMember, episodes: list[int] | None, from_run: bool):
    """The evaluated dataset and whether its episodes are the run's held-out ones."""
    from opentau_cli.data.build import make_dataset, split_episodes
    from opentau_cli.data.remote import member_files

    # A Hub dataset: the run's snapshot in the cache; one in object storage: the run's version through this machine's cache.
    root, files = member_files(member, cfg.dataset)
    held_out = False
    if episodes is None and from_run and cfg.validation.val_split > 0:
        _, episodes = split_episodes(root, cfg.validation.val_split, cfg.seed, member.episodes)
        held_out = True
    elif episodes is None:
        episodes = member.episodes
    return make_dataset(cfg, member, root, episodes, files=files), held_out


def parse_episodes(text: str | None) -> list[int] | None:
    """`0,3,5` or `[0, 3, 5]` -> [0, 3, 5]."""
    if text is None:
        return None
    try:
        found = [int(x) for x in text.strip().strip("[]").split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--episodes={text}: expected episode indices such as 0,3,5.") from None
    if not found:
        raise UserError(f"--episodes={text}: no episode given.")
    return found


# ------------------------------------------------------------------------------------------- measuring
class _Errors:
    """Sums of squared and absolute errors per (chunk position, joint) over the valid (non-padded) steps."""

    def __init__(self, steps: int, joints: int):
        self.sq = torch.zeros(steps, joints, dtype=torch.float64)
        self.abs = torch.zeros(steps, joints, dtype=torch.float64)
        self.count = torch.zeros(steps, dtype=torch.float64)

    def add(self, predicted: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> None:
        diff = (predicted.double() - target.double()) * valid[..., None]
        self.sq += (diff**2).sum(0)
        self.abs += diff.abs().sum(0)
        self.count += valid.sum(0)

    def summary(self) -> dict:
        n = self.count.sum().clamp_min(1)
        per_step = self.count.clamp_min(1)[:, None]
        return {
            "mse": (self.sq.sum() / (n * self.sq.shape[1])).item(),
            "mae": (self.abs.sum() / (n * self.abs.shape[1])).item(),
            "per_joint": {"mse": (self.sq.sum(0) / n).tolist(), "mae": (self.abs.sum(0) / n).tolist()},
            "per_step": {"mse": (self.sq / per_step).mean(1).tolist(), "mae": (self.abs / per_step).mean(1).tolist()},
        }


def _batches(dataset, indices: list[int], batch_size: int):
    from opentau_cli.data.sampler import collate

    for start in range(0, len(indices), batch_size):
        yield collate([dataset[i] for i in indices[start : start + batch_size]])


def _check_widths(policy, dataset) -> None:
    for feature, width in (("state", dataset.state_dim), ("action", dataset.action_dim)):
        own = int(getattr(policy, f"{feature}_dim").item())
        if own != width:
            raise UserError(f"The policy was trained on a {own}-dim {feature} but the dataset's {feature} has {width} dims: "
                            "evaluate it on its own robot's data.")


def _trajectories(policy, cfg, member: MixtureMember, episodes: list[int], device, generator) -> list[dict]:
    """For a few episodes: the recorded actions, and the chunks sampled every n_action_steps frames laid end to end."""
    from opentau_cli.data.build import make_dataset
    from opentau_cli.data.remote import member_files

    root, files = member_files(member, cfg.dataset)  # as _dataset reads it
    out = []
    for episode in episodes:
        one = make_dataset(cfg, member, root, [episode], files=files)
        recorded = torch.stack([one[i]["actions"][0] for i in range(len(one))])
        starts = list(range(0, len(one), policy.cfg.n_action_steps))
        chunks = torch.cat([sample(policy, b, device, generator) for b in _batches(one, starts, 8)])
        predicted = chunks.reshape(-1, chunks.shape[-1])[: len(one)]
        out.append({"episode": episode, "recorded": recorded, "predicted": predicted})
    return out


def _plot(path: Path, trajectories: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    joints = min(trajectories[0]["recorded"].shape[1], 6)
    fig, axes = plt.subplots(len(trajectories), joints, figsize=(3 * joints, 2.4 * len(trajectories)), squeeze=False)
    for row, traj in zip(axes, trajectories):
        for j, ax in enumerate(row):
            ax.plot(traj["recorded"][:, j].numpy(), label="recorded", color="black", linewidth=1.2)
            ax.plot(traj["predicted"][:, j].numpy(), label="predicted", color="tab:orange", linewidth=1.0, linestyle="--")
            ax.set_title(f"episode {traj['episode']}, joint {j}", fontsize=8)
            ax.tick_params(labelsize=6)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def evaluate(source: str | Path, *, overrides: dict | None = None, episodes: list[int] | None = None,
             output: Path | None = None, batch_size: int = 8, stride: int = 1, plot_episodes: int = 3,
             device: str | None = None, seed: int = 0, dataset: str | None = None, echo=print,
             force: bool = False, weights: str | None = None, progress=None) -> Evaluated:
    """Evaluate `source` (a training checkpoint / run, or a model) on `dataset` (a name of its config's datasets;
    default: the first) and write eval.json and eval.png into `output`. `progress(done, total)` follows the action
    chunks sampled."""
    overrides = dict(overrides or {})
    if batch_size < 1 or stride < 1 or plot_episodes < 0:
        raise UserError("--batch-size and --stride must be at least 1, --plot-episodes at least 0.")
    dev = device_named(device)
    path = Path(str(source)).expanduser()
    output = Path(output) if output is not None else Path("outputs") / "eval" / (path.name or "model")
    check_target(output, force=force, source=path, command=COMMAND)  # the output convention: opentau_cli/store/outputs.py
    writable_parent(output)
    from_run = is_training_checkpoint(path)
    if from_run:
        cfg, member, policy, origin = from_checkpoint(path, overrides, dataset, weights)
        data, held_out = _dataset(cfg, member, episodes, from_run=True)
    else:
        local, hub = pinned_model(str(source))  # a repo id: one commit, from the Hugging Face cache
        if hub:
            echo(describe_hub(hub))
        cfg = model_policy_config(local, overrides)
        member = select_member(cfg, dataset)
        data, held_out = _dataset(cfg, member, episodes, from_run=False)
        policy, origin = from_model(cfg, local, data.stats)
        origin.update(hub)
    _check_widths(policy, data)

    for_inference(policy, dev)
    steps, joints = policy.cfg.n_action_steps, data.action_dim
    mean = policy.action_mean[:joints].float().cpu()
    ours, baseline = _Errors(steps, joints), _Errors(steps, joints)
    generator = torch.Generator().manual_seed(seed)
    indices = list(range(0, len(data), stride))
    echo(f"Evaluating {len(indices)} action chunks of {len(data.episodes)} episodes on {dev} with the "
         f"{describe_weights(origin)}...")
    done = 0
    for batch in _batches(data, indices, batch_size):
        predicted = sample(policy, batch, dev, generator)
        target = batch["actions"][:, :steps, :joints]
        valid = (~batch["action_is_pad"][:, :steps]).double()
        ours.add(predicted, target, valid)
        baseline.add(mean.expand_as(target), target, valid)
        done += len(predicted)
        if progress is not None:
            progress(done, len(indices))
    report = {
        **origin,
        "policy_type": policy.cfg.type, "preset": policy.cfg.preset,
        "dataset": member.root, "dataset_name": member.label, "episodes": list(data.episodes), "held_out": held_out,
        "samples": len(indices), "stride": stride, "n_action_steps": steps, "action_dim": joints, "seed": seed,
        "baseline": "the mean action of the policy's normalization statistics, at every step",
        "policy": ours.summary(), "mean_action": baseline.summary(),
    }
    report["mse_ratio"] = report["policy"]["mse"] / max(report["mean_action"]["mse"], 1e-12)
    report["beats_mean_action"] = report["policy"]["mse"] < report["mean_action"]["mse"]

    from opentau_cli.store.manifest import write_json_atomic

    shown = list(data.episodes)[:plot_episodes]
    remote = (origin.get("checkpoint") or {}).get("url") and origin["checkpoint"]["path"]  # a cached remote copy's URL
    with publishing(output, force=force, source=path, command=COMMAND, recorded=remote or None) as staging:
        staging.mkdir()
        write_json_atomic(staging / EVAL_JSON, report)
        if shown:
            _plot(staging / EVAL_PLOT, _trajectories(policy, cfg, member, shown, dev, generator),
                  f"{path.name}: predicted (chunks every {steps} frames) vs recorded actions")
    return Evaluated(report, output / EVAL_JSON, output / EVAL_PLOT if shown else None)
