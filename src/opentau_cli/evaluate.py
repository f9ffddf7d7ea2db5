"""Offline evaluation: sample action chunks on held-out episodes and compare them with the recorded actions and with
the mean-action baseline (always predicting the mean action of the policy's statistics), per joint and per chunk
position; `eval.json` and a PNG of predicted vs recorded trajectories.

The policy comes from a training checkpoint (a run or checkpoint directory: its own train_config.json, its held-out
episodes by default) or from a model in any layout `policy.pretrained_path` takes (a file, a directory such as
`checkpoint export` writes, or a Hugging Face repo id; its config.json and its weights' shapes say how to build it,
and every episode of the dataset is evaluated by default).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from opentau_cli.checkpoint.layout import TRAIN_CONFIG
from opentau_cli.config.load import load_config
from opentau_cli.config.model import DatasetSource, MixtureMember, TrainConfig
from opentau_cli.data.mixture import member_statistics, select_member
from opentau_cli.errors import UserError
from opentau_cli.outputs import check_target, publishing, writable_parent

EVAL_JSON = "eval.json"
EVAL_PLOT = "eval.png"
COMMAND = "eval"  # its name in the output convention's marker (outputs.py)
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # what openpi and LeRobot tokenize pi05 prompts with


@dataclass
class Evaluated:
    """What `evaluate` measured and where it wrote it."""

    report: dict
    json_path: Path
    plot_path: Path | None


# ------------------------------------------------------------------------------------------- the policy
def _is_training_checkpoint(path: Path) -> bool:
    from opentau_cli.checkpoint.layout import CHECKPOINTS
    from opentau_cli.checkpoint.manager import is_checkpoint_dir

    if str(path).endswith(":best"):  # RUN:best, the run's best kept checkpoint (find_checkpoint resolves it)
        return True
    return path.is_dir() and (is_checkpoint_dir(path) or (path / CHECKPOINTS).is_dir() or path.name == CHECKPOINTS)


def _from_checkpoint(path: Path, overrides: dict, dataset: str | None, weights: str | None = None
                     ) -> tuple[TrainConfig, MixtureMember, torch.nn.Module, dict]:
    """The run's config, the dataset evaluated and the policy normalizing with that dataset's statistics; `weights`:
    ema | live | None (the EMA when the checkpoint holds one)."""
    from opentau_cli.checkpoint.export import open_saved_policy
    from opentau_cli.checkpoint.manager import read_training_state

    saved = open_saved_policy(path, weights)
    cfg = load_config(saved.path / TRAIN_CONFIG, overrides)
    member = _run_member(cfg, overrides, dataset)
    policy, origin = _policy_of_checkpoint(saved, cfg)
    # Which weights of which checkpoint (RUN:best or a run directory resolve to one): docs/ARCHITECTURE.md, "EMA weights".
    origin.update({"weights": saved.weights, "step": saved.step,
                   "checkpoint": {"path": str(saved.path), "step": saved.step, "resolved_from": str(path)}})
    if cfg.dataset.mixture is not None:  # the policy holds the first member's statistics, widened: serve this one's
        policy.set_stats(member_statistics(read_training_state(saved.path), member))
        origin["statistics"] = f"dataset {member.label}'s own, from the checkpoint's training_state.json"
    return cfg, member, policy, origin


def describe_weights(origin: dict) -> str:
    """Which weights of which checkpoint a loaded policy holds, in words (eval's and serve's first line):
    'EMA weights of step 60 (RUN/checkpoints/000060)'."""
    kind = {"ema": "EMA weights", "live": "live weights"}.get(origin.get("weights"), "weights (EMA or live: not recorded)")
    step, where = origin.get("step"), (origin.get("checkpoint") or {}).get("path")
    return kind + (f" of step {step}" if step is not None else "") + (f" ({where})" if where else "")


def _run_member(cfg: TrainConfig, overrides: dict, dataset: str | None) -> MixtureMember:
    """The dataset `--dataset` picks; a mixture reads its members' own fields, so a top-level one would be ignored."""
    if cfg.dataset.mixture is not None:
        for key in overrides:
            if key.startswith("dataset.") and key[len("dataset."):] in DatasetSource.model_fields:
                raise UserError(f"--{key}: the run trained on a mixture, whose members carry their own; evaluate a "
                                "member with --dataset NAME, or export it (`checkpoint export --dataset NAME`) and "
                                "evaluate the model on other data with --dataset.root.")
    return select_member(cfg, dataset)


def _policy_of_checkpoint(saved, cfg: TrainConfig) -> tuple[torch.nn.Module, dict]:
    from opentau_cli.checkpoint.export import check_entries, policy_layout
    from opentau_cli.policies import build_policy

    if cfg.policy.lora.enabled:  # the adapted policy as it trained (base, then adapters), not a merge of it
        from opentau_cli.checkpoint.manager import read_training_state
        from opentau_cli.policies.lora import check_base, restore_policy

        check_base(saved.path, read_training_state(saved.path), cfg)
        policy = restore_policy(cfg, {name: entry.produce() for name, entry in saved.entries.items()})
        return policy, {"statistics": "from the checkpoint (the policy's statistics buffers)",
                        "lora": f"rank {cfg.policy.lora.rank} adapters on their base weights"}
    shapes, _ = policy_layout(cfg.policy)
    check_entries(saved, shapes)
    policy = build_policy(cfg.policy)
    own = policy.state_dict()
    with torch.no_grad():
        for name in shapes:  # one tensor at a time: the state_dict's tensors are the policy's own storage
            own[name].copy_(saved.entries[name].produce())
    return policy, {"statistics": "from the checkpoint (the policy's statistics buffers)"}


def _model_config(cfg: TrainConfig, ckpt, overrides: dict) -> TrainConfig:
    """The policy config of a model: the defaults, then its config.json, its preset (from its weights' shapes), then
    the command line's --policy.* overrides."""
    from pydantic import ValidationError

    from opentau_cli.checkpoint.export import MODEL_CONFIG, policy_fields
    from opentau_cli.config.load import format_validation_error
    from opentau_cli.config.model import PolicyConfig
    from opentau_cli.policies.pretrained import guess_preset

    fields = {}
    config = ckpt.root / MODEL_CONFIG
    if config.is_file():
        try:
            fields = policy_fields(json.loads(config.read_text()))
        except (ValueError, AttributeError) as exc:
            raise UserError(f"{config}: not a readable config.json ({exc}).") from None
    fields["type"] = ckpt.layout.policy_type
    preset = guess_preset(ckpt)
    if preset is not None:
        fields["preset"] = preset
        fields.update(_sizes_from_shapes(ckpt, preset))
    if fields.get("preset", cfg.policy.preset) == "pi05":
        fields["tokenizer_path"] = PALIGEMMA_TOKENIZER
    given = {key.split(".", 1)[1] for key in overrides if key.startswith("policy.")}
    merged = {**cfg.policy.model_dump(), **{k: v for k, v in fields.items() if k not in given}}
    try:
        cfg.policy = PolicyConfig.model_validate(merged)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, f" in {config}")) from None
    return cfg


def _sizes_from_shapes(ckpt, preset: str) -> dict:
    """What the weights' shapes fix whatever a config file says: the action width and the image side (SigLIP's
    position table holds one row per patch; openpi's config.json names neither)."""
    import math

    from opentau_cli.policies.layouts import our_name
    from opentau_cli.policies.pi05.configuration import PRESETS

    shapes = {our_name(k, ckpt.layout): s for k, s in ckpt.shapes.items()}
    sizes = {}
    if "action_out_proj.weight" in shapes:
        sizes["max_action_dim"] = shapes["action_out_proj.weight"][0]
    positions = shapes.get("vlm.vision_tower.embeddings.position_embedding.weight")
    if positions:
        side = math.isqrt(positions[0]) * PRESETS[preset]["vision"]["patch_size"]
        sizes["image_resolution"] = [side, side]
    return sizes


def _model_policy_config(source: str, overrides: dict) -> TrainConfig:
    from opentau_cli.policies.pretrained import Checkpoint

    with Checkpoint(source) as ckpt:
        cfg = _model_config(load_config(None, overrides), ckpt, overrides)
    cfg.policy = cfg.policy.model_copy(update={"pretrained_path": source})
    return cfg


def _from_model(cfg: TrainConfig, source: str, dataset_stats: dict) -> tuple[torch.nn.Module, dict]:
    """The model's weights and its own statistics; the evaluated episodes' statistics only where it has none; which
    weights (ema | live) of which step an opentau export recorded (None: the model does not say)."""
    from opentau_cli.checkpoint.export import model_provenance
    from opentau_cli.policies import build_pretrained

    # Built without random initialization (about one copy of the weights in host RAM); no random draws either:
    # sampling takes its noise from its own generator.
    policy, report = build_pretrained(cfg.policy, dataset_stats=dataset_stats, rng_draws=False)
    return policy, {"model": source, "layout": report.layout.label, "statistics": report.stats_source,
                    **model_provenance(source)}


# ------------------------------------------------------------------------------------------- the data
def _dataset(cfg: TrainConfig, member: MixtureMember, episodes: list[int] | None, from_run: bool):
    """The evaluated dataset and whether its episodes are the run's held-out ones."""
    from opentau_cli.data.build import make_dataset, split_episodes
    from opentau_cli.data.hub import dataset_root

    root = dataset_root(member, cfg.dataset.num_cameras)  # a Hub dataset: the run's snapshot in the cache
    held_out = False
    if episodes is None and from_run and cfg.validation.val_split > 0:
        _, episodes = split_episodes(root, cfg.validation.val_split, cfg.seed, member.episodes)
        held_out = True
    elif episodes is None:
        episodes = member.episodes
    return make_dataset(cfg, member, root, episodes), held_out


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


def _sample(policy, batch: dict, device, generator: torch.Generator) -> torch.Tensor:
    from opentau_cli.train.trainer import to_device

    noise = torch.randn(len(batch["task"]), policy.cfg.chunk_size, policy.cfg.max_action_dim, generator=generator)
    return policy.sample_actions(to_device(batch, device), noise=noise.to(device)).cpu()


def _check_widths(policy, dataset) -> None:
    for feature, width in (("state", dataset.state_dim), ("action", dataset.action_dim)):
        own = int(getattr(policy, f"{feature}_dim").item())
        if own != width:
            raise UserError(f"The policy was trained on a {own}-dim {feature} but the dataset's {feature} has {width} dims: "
                            "evaluate it on its own robot's data.")


def _trajectories(policy, cfg, member: MixtureMember, episodes: list[int], device, generator) -> list[dict]:
    """For a few episodes: the recorded actions, and the chunks sampled every n_action_steps frames laid end to end."""
    from opentau_cli.data.build import make_dataset
    from opentau_cli.data.hub import dataset_root

    root = dataset_root(member, cfg.dataset.num_cameras)  # a Hub dataset: the run's snapshot in the cache
    out = []
    for episode in episodes:
        one = make_dataset(cfg, member, root, [episode])
        recorded = torch.stack([one[i]["actions"][0] for i in range(len(one))])
        starts = list(range(0, len(one), policy.cfg.n_action_steps))
        chunks = torch.cat([_sample(policy, b, device, generator) for b in _batches(one, starts, 8)])
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


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device={name}: not a torch device (cpu, cuda, cuda:1).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device={name}: this machine has no CUDA GPU.")
    return device


def for_inference(policy, device: torch.device):
    """The policy on `device`, in eval mode and the inference dtype: what eval and serve both sample with."""
    policy.to(device).eval()
    if inference_dtype(device) != torch.float32:
        policy.cast_weights(inference_dtype(device))
    return policy


def inference_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA, as openpi serves pi05 (the fp32 set of the policy kept, modeling.FP32_PARAMETERS); fp32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def evaluate(source: str | Path, *, overrides: dict | None = None, episodes: list[int] | None = None,
             output: Path | None = None, batch_size: int = 8, stride: int = 1, plot_episodes: int = 3,
             device: str | None = None, seed: int = 0, dataset: str | None = None, echo=print,
             force: bool = False, weights: str | None = None) -> Evaluated:
    """Evaluate `source` (a training checkpoint / run, or a model) on `dataset` (a name of its config's datasets;
    default: the first) and write eval.json and eval.png into `output`."""
    overrides = dict(overrides or {})
    if batch_size < 1 or stride < 1 or plot_episodes < 0:
        raise UserError("--batch-size and --stride must be at least 1, --plot-episodes at least 0.")
    dev = _device(device)
    path = Path(str(source)).expanduser()
    output = Path(output) if output is not None else Path("outputs") / "eval" / (path.name or "model")
    check_target(output, force=force, source=path, command=COMMAND)  # the output convention: opentau_cli/outputs.py
    writable_parent(output)
    from_run = _is_training_checkpoint(path)
    if from_run:
        cfg, member, policy, origin = _from_checkpoint(path, overrides, dataset, weights)
        data, held_out = _dataset(cfg, member, episodes, from_run=True)
    else:
        cfg = _model_policy_config(str(source), overrides)
        member = select_member(cfg, dataset)
        data, held_out = _dataset(cfg, member, episodes, from_run=False)
        policy, origin = _from_model(cfg, str(source), data.stats)
    _check_widths(policy, data)

    for_inference(policy, dev)
    steps, joints = policy.cfg.n_action_steps, data.action_dim
    mean = policy.action_mean[:joints].float().cpu()
    ours, baseline = _Errors(steps, joints), _Errors(steps, joints)
    generator = torch.Generator().manual_seed(seed)
    indices = list(range(0, len(data), stride))
    echo(f"Evaluating {len(indices)} action chunks of {len(data.episodes)} episodes on {dev} with the "
         f"{describe_weights(origin)}...")
    for batch in _batches(data, indices, batch_size):
        predicted = _sample(policy, batch, dev, generator)
        target = batch["actions"][:, :steps, :joints]
        valid = (~batch["action_is_pad"][:, :steps]).double()
        ours.add(predicted, target, valid)
        baseline.add(mean.expand_as(target), target, valid)
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

    from opentau_cli.checkpoint.manifest import write_json_atomic

    shown = list(data.episodes)[:plot_episodes]
    with publishing(output, force=force, source=path, command=COMMAND) as staging:
        staging.mkdir()
        write_json_atomic(staging / EVAL_JSON, report)
        if shown:
            _plot(staging / EVAL_PLOT, _trajectories(policy, cfg, member, shown, dev, generator),
                  f"{path.name}: predicted (chunks every {steps} frames) vs recorded actions")
    return Evaluated(report, output / EVAL_JSON, output / EVAL_PLOT if shown else None)
