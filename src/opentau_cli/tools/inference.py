"""A trained policy opened for inference, as `opentau eval` and `opentau serve` both use it: from a training checkpoint
(a run or checkpoint directory, any backend's layout, LoRA merged, the EMA or the live weights) or from a model in any
layout `policy.pretrained_path` takes; on a device, in the inference dtype; and one sampled action chunk."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from opentau_cli.config.load import load_config
from opentau_cli.config.model import DatasetSource, MixtureMember, TrainConfig
from opentau_cli.data.mixture import member_statistics, select_member
from opentau_cli.errors import UserError
from opentau_cli.store.layout import TRAIN_CONFIG

PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # what openpi and LeRobot tokenize pi05 prompts with


def is_training_checkpoint(path: Path) -> bool:
    from opentau_cli.store.layout import CHECKPOINTS
    from opentau_cli.store.runs import STEP_SUFFIX, is_checkpoint_dir

    if str(path).endswith(":best") or STEP_SUFFIX.fullmatch(str(path)):  # RUN:best, RUN:STEP (find_checkpoint)
        return True
    return path.is_dir() and (is_checkpoint_dir(path) or (path / CHECKPOINTS).is_dir() or path.name == CHECKPOINTS)


def from_checkpoint(path: Path, overrides: dict, dataset: str | None, weights: str | None = None
                     ) -> tuple[TrainConfig, MixtureMember, torch.nn.Module, dict]:
    """The run's config, the dataset evaluated and the policy normalizing with that dataset's statistics; `weights`:
    ema | live | None (the EMA when the checkpoint holds one)."""
    from opentau_cli.store.runs import read_training_state
    from opentau_cli.tools.export import open_saved_policy
    from opentau_cli.tools.remote import remote_origin

    saved = open_saved_policy(path, weights)
    cfg = load_config(saved.path / TRAIN_CONFIG, overrides)
    member = _run_member(cfg, overrides, dataset)
    policy, origin = _policy_of_checkpoint(saved, cfg)
    # Which weights of which checkpoint (RUN:best or a run directory resolve to one): docs/ARCHITECTURE.md, "EMA weights".
    # A copy of a checkpoint in remote storage is named by its URL and step, never by the cache's path.
    checkpoint = {"path": str(saved.path), "step": saved.step, "resolved_from": str(path)}
    remote = remote_origin(saved.path)
    if remote is not None:
        checkpoint = {"path": remote["address"], "step": saved.step, "url": remote["url"],
                      "resolved_from": f"{remote['url']}:{saved.step}"}
    origin.update({"weights": saved.weights, "step": saved.step, "checkpoint": checkpoint,
                   "manifest_xxh3": _manifest_hash(saved.path)})
    if cfg.dataset.mixture is not None:  # the policy holds the first member's statistics, widened: serve this one's
        policy.set_stats(member_statistics(read_training_state(saved.path), member))
        origin["statistics"] = f"dataset {member.label}'s own, from the checkpoint's training_state.json"
    return cfg, member, policy, origin


def _manifest_hash(ckpt: Path) -> str | None:
    """The xxh3-128 of the checkpoint's manifest.json: which checkpoint was evaluated, whatever its path (a push finds
    its checkpoint's eval by it: tools/publish.py)."""
    from opentau_cli.store.layout import MANIFEST
    from opentau_cli.store.manifest import hash_file

    return hash_file(ckpt / MANIFEST) if (ckpt / MANIFEST).is_file() else None


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
    from opentau_cli.policies import build_policy
    from opentau_cli.tools.export import check_entries, policy_layout

    if cfg.policy.lora.enabled:  # the adapted policy as it trained (base, then adapters), not a merge of it
        from opentau_cli.policies.lora import check_base, restore_policy
        from opentau_cli.store.runs import read_training_state

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

    from opentau_cli.config.load import format_validation_error
    from opentau_cli.config.model import PolicyConfig
    from opentau_cli.policies.pretrained import guess_preset
    from opentau_cli.tools.export import MODEL_CONFIG, policy_fields

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


def pinned_model(source: str) -> tuple[str, dict]:
    """A model named by a Hub repo id, pinned to one commit and read from the Hugging Face cache: (its snapshot
    directory, {"hub": {repo_id, revision, commit}} for the origin); a local path as it is, {}."""
    from opentau_cli.policies.hub import pin

    pinned = pin(source)
    if pinned is None:
        return source, {}
    return str(pinned.path), {"hub": {"repo_id": pinned.repo_id, "revision": pinned.revision, "commit": pinned.commit,
                                      "cache": str(pinned.path)}}


def describe_hub(origin: dict) -> str | None:
    """'USER/REPO: revision main is commit SHA (Hugging Face cache: DIR)' for a model read by repo id, else None."""
    hub = origin.get("hub")
    return f"{hub['repo_id']}: revision {hub['revision']} is commit {hub['commit']} (Hugging Face cache: {hub['cache']})" if hub else None


def model_policy_config(source: str, overrides: dict) -> TrainConfig:
    from opentau_cli.policies.pretrained import Checkpoint

    with Checkpoint(source) as ckpt:
        cfg = _model_config(load_config(None, overrides), ckpt, overrides)
    cfg.policy = cfg.policy.model_copy(update={"pretrained_path": source})
    return cfg


def from_model(cfg: TrainConfig, source: str, dataset_stats: dict) -> tuple[torch.nn.Module, dict]:
    """The model's weights and its own statistics; the evaluated episodes' statistics only where it has none; which
    weights (ema | live) of which step an opentau export recorded (None: the model does not say)."""
    from opentau_cli.policies import build_pretrained
    from opentau_cli.tools.export import model_provenance

    # Built without random initialization (about one copy of the weights in host RAM); no random draws either:
    # sampling takes its noise from its own generator.
    policy, report = build_pretrained(cfg.policy, dataset_stats=dataset_stats, rng_draws=False)
    return policy, {"model": source, "layout": report.layout.label, "statistics": report.stats_source,
                    **model_provenance(source)}


# ------------------------------------------------------------------------------------------- the data
def sample(policy, batch: dict, device, generator: torch.Generator | list[torch.Generator]) -> torch.Tensor:
    """One action chunk per sample (unnormalized, n_action_steps x the action width). The noise comes from
    `generator`, or row i's from `generator[i]` (a closed-loop eval draws each episode's from its own seed, so an
    episode's actions do not depend on which others share its batch)."""
    from opentau_cli.train.trainer import to_device

    shape = (policy.cfg.chunk_size, policy.cfg.max_action_dim)
    if isinstance(generator, torch.Generator):
        noise = torch.randn(len(batch["task"]), *shape, generator=generator)
    else:
        noise = torch.stack([torch.randn(*shape, generator=g) for g in generator])
    return policy.sample_actions(to_device(batch, device), noise=noise.to(device)).cpu()


def device_named(name: str | None) -> torch.device:
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
