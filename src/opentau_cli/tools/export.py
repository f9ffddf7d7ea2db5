"""Export a training checkpoint as a plain model in a published layout (OpenTau, LeRobot or openpi): weights renamed
through `policies.layouts`, the normalization statistics in that layout's own place, and a config file in its
convention. DeepSpeed shards are gathered by consolidate's streaming reader; every tensor is read when its turn
comes, and the whole output is written in a hidden sibling directory and renamed into place, so a failure leaves
nothing behind.

    opentau (OpenTau)  model.safetensors with normalize_inputs / normalize_targets / unnormalize_outputs buffers; config.json
    lerobot            model.safetensors; policy_preprocessor.json / policy_postprocessor.json + normalizer files; config.json
    openpi             model.safetensors; assets/<dataset>/norm_stats.json; config.json

A LoRA checkpoint (policy.lora) is first merged into its base (policies/lora.py: base + (alpha / rank) * B @ A, the
base found from its reference and checked against its hashes), in memory; from there it is a plain policy's tensors.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opentau_cli.config.model import MixtureMember, PolicyConfig, TrainConfig
from opentau_cli.data.mixture import member_statistics, select_member
from opentau_cli.errors import RunError, UserError
from opentau_cli.policies.layouts import (
    LEROBOT, OPENPI, OPENTAU, Layout, lerobot_image_features, opentau_stats_tensors, published_names, write_lerobot_stats,
    write_openpi_stats,
)
from opentau_cli.store.dcp import model_entries
from opentau_cli.store.faults import fault_point
from opentau_cli.store.format import check_readable
from opentau_cli.store.layout import DS_TAG, EMA_WEIGHTS, MODEL_WEIGHTS, TRAIN_CONFIG, WEIGHTS_INDEX, is_dcp_checkpoint
from opentau_cli.store.outputs import check_target, publishing, writable_parent
from opentau_cli.store.safetensors_writer import TensorEntry, write_safetensors
from opentau_cli.store.shard_reader import ShardFormatError
from opentau_cli.store.zero import read_zero_checkpoint
from opentau_cli.tools.consolidate import wants_ema, weights_kind
from opentau_cli.tools.remote import remote_origin

EXPORT_LAYOUTS = (OPENTAU, LEROBOT, OPENPI)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_CONFIG = "config.json"
COMMAND = "checkpoint export"  # its name in the output convention's marker and the safetensors producer (store/outputs.py)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}
# The published variants of the full-size preset (openpi's and LeRobot's names for its two Gemma sizes).
_VARIANTS = {"pi05": ("gemma_2b", "gemma_300m")}


@dataclass
class SavedPolicy:
    """A training checkpoint: its resolved config and every tensor of the policy's state_dict, unread."""

    path: Path
    config: TrainConfig
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    weights: str = "live"  # which weights `entries` holds: ema | live
    step: int | None = None  # the checkpoint's step (its training_state.json)


@dataclass
class ExportResult:
    output: Path
    files: list[Path]
    num_tensors: int
    total_bytes: int
    weights: str = "live"  # ema | live: which of the checkpoint's weights were exported
    step: int | None = None  # the exported checkpoint's step
    checkpoint: Path | str | None = None  # the checkpoint directory the target resolved to (e.g. RUN:best's; its URL)


# An exported model's record of where it came from: in model.safetensors' metadata (every layout) and under this key of
# config.json (the OpenTau and openpi layouts; their loaders ignore it, LeRobot's config parser would refuse it).
PROVENANCE_KEY = "opentau"


# ------------------------------------------------------------------------------------------- reading a checkpoint
def _safetensors_entries(files: list[Path]) -> dict[str, TensorEntry]:
    from safetensors import SafetensorError, safe_open

    entries = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    entries[key] = TensorEntry(key, tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()],
                                               lambda file=file, key=key: _read_tensor(file, key))
        except (SafetensorError, OSError, KeyError) as exc:
            raise UserError(f"{file}: not a readable safetensors file ({exc}).") from None
    return entries


def _read_tensor(file: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(key)


def open_saved_policy(target: Path, weights: str | None = None) -> SavedPolicy:
    """A run directory (its newest complete checkpoint) or a checkpoint directory: its train_config.json, and its
    weights from model.safetensors (or shards + index), else gathered from its DeepSpeed ZeRO shards. `weights`:
    ema | live | None (the EMA when the checkpoint holds one): a single / DDP checkpoint's ema.safetensors replaces
    the trained tensors; a DeepSpeed one's EMA partitions are cut by the ZeRO reader's plan (store/zero.py)."""
    from opentau_cli.config.load import load_config
    from opentau_cli.store.runs import find_checkpoint

    ckpt = find_checkpoint(Path(target))
    check_readable(ckpt)
    if not (ckpt / TRAIN_CONFIG).is_file():
        raise UserError(f"{ckpt} has no {TRAIN_CONFIG}: not a checkpoint written by `opentau train`.")
    config = load_config(ckpt / TRAIN_CONFIG, {})
    ema = wants_ema(ckpt, weights)
    deepspeed = (ckpt / DS_TAG).is_dir()
    fsdp = is_dcp_checkpoint(ckpt)  # FSDP2: its DCP shards (store/dcp.py), its EMA among them
    consolidated = (ckpt / MODEL_WEIGHTS).is_file() or (ckpt / WEIGHTS_INDEX).is_file()
    if deepspeed and (not consolidated or weights_kind(ckpt / MODEL_WEIGHTS) != ("ema" if ema else "live")):
        entries = {e.name: e for e in read_zero_checkpoint(ckpt, ema=ema).entries}
    elif fsdp and (not consolidated or weights_kind(ckpt / MODEL_WEIGHTS) != ("ema" if ema else "live")):
        entries = {e.name: e for e in model_entries(ckpt, ema=ema)}
    elif (ckpt / MODEL_WEIGHTS).is_file():
        entries = _safetensors_entries([ckpt / MODEL_WEIGHTS])
    elif (ckpt / WEIGHTS_INDEX).is_file():
        from opentau_cli.policies.pretrained import weight_files

        entries = _safetensors_entries(weight_files(ckpt))
    else:
        entries = {e.name: e for e in read_zero_checkpoint(ckpt).entries}
    if ema and not deepspeed and not fsdp:  # the trained tensors' EMA, by the same names
        averaged = _safetensors_entries([ckpt / EMA_WEIGHTS])
        unknown = sorted(set(averaged) - set(entries))
        if unknown:
            raise UserError(f"{ckpt / EMA_WEIGHTS} holds tensors the weights do not ({unknown[:3]}): not this checkpoint's EMA.")
        entries.update(averaged)
    return SavedPolicy(ckpt, config, entries, "ema" if ema else "live", _step(ckpt))


def policy_layout(policy_cfg: PolicyConfig) -> tuple[dict[str, tuple], set[str]]:
    """The policy's state_dict shapes and the names of its parameters, from a build on the meta device."""
    from opentau_cli.policies import build_policy

    with torch.device("meta"):
        policy = build_policy(policy_cfg)
    return {k: tuple(v.shape) for k, v in policy.state_dict().items()}, {n for n, _ in policy.named_parameters()}


def check_entries(saved: SavedPolicy, shapes: dict[str, tuple]) -> None:
    """The checkpoint holds exactly the tensors of the policy its config describes (else it is another preset's)."""
    missing = sorted(set(shapes) - set(saved.entries))
    wrong = sorted(k for k in shapes if k in saved.entries and tuple(saved.entries[k].shape) != shapes[k])
    if missing or wrong:
        what = "; ".join(part for part in (
            f"{len(missing)} missing: {', '.join(missing[:3])}" if missing else "",
            f"{len(wrong)} of another shape: {', '.join(f'{k} {list(saved.entries[k].shape)} vs {list(shapes[k])}' for k in wrong[:3])}" if wrong else "",
        ) if part)
        raise UserError(f"{saved.path}: its weights do not fit the {saved.config.policy.preset} policy its {TRAIN_CONFIG} "
                        f"describes ({what}).")


def statistics(saved: SavedPolicy) -> dict:
    """The normalization statistics the policy holds, over its real state / action dims (all four: mean, std, q01, q99)."""
    from opentau_cli.policies.pi05.modeling import STATS

    out = {}
    for feature in ("state", "action"):
        width = int(saved.entries[f"{feature}_dim"].produce().reshape(-1)[0])
        out[feature] = {stat: saved.entries[f"{feature}_{stat}"].produce().float()[:width].tolist() for stat in STATS}
    return out


# ------------------------------------------------------------------------------------------- config files
def camera_features(cfg: TrainConfig, member: MixtureMember) -> list[str | None]:
    """The dataset feature of each camera slot (None: a slot the policy saw padded): the training dataset's cameras
    when its meta/ is readable, else the configured mapping, else one name per slot."""
    from opentau_cli.data.meta import camera_slots, read_meta
    from opentau_cli.data.synth import resolve_dataset_root

    num = cfg.dataset.num_cameras
    try:
        meta = read_meta(resolve_dataset_root(member.root))
    except (UserError, OSError):
        meta = None
    if meta is not None:
        return camera_slots(meta, member.camera_keys, num)
    slots: list[str | None] = [f"observation.images.camera{i}" for i in range(num)]
    for feature, slot in member.camera_keys.items():
        slots[int(slot.removeprefix("camera"))] = feature
    return slots


def model_config(layout: str, policy_cfg: PolicyConfig, stats: dict, dtype: str, cameras: list[str | None] = ()) -> dict:
    """The model's config.json in `layout`'s convention (what its own loader reads); `cameras` are the dataset's
    camera features, which LeRobot's policy builds its image inputs from."""
    p = policy_cfg
    variants = _VARIANTS.get(p.preset)
    if layout == OPENPI:  # what openpi's PyTorch conversion writes next to model.safetensors
        config = {"action_dim": p.max_action_dim, "action_horizon": p.chunk_size, "max_token_len": p.tokenizer_max_length,
                  "pi05": p.type == "pi05", "precision": {"fp32": "float32", "bf16": "bfloat16"}[dtype]}
    else:
        config = {"type": p.type, "n_obs_steps": 1, "chunk_size": p.chunk_size, "n_action_steps": p.n_action_steps,
                  "max_state_dim": p.max_state_dim, "max_action_dim": p.max_action_dim, "tokenizer_max_length": p.tokenizer_max_length,
                  "freeze_vision_encoder": p.freeze_vision_encoder, "train_expert_only": p.train_expert_only}
        if layout == LEROBOT:
            mode = "QUANTILES" if p.type == "pi05" else "MEAN_STD"
            state_width = len(stats["state"]["q01"])
            if p.type == "pi05":  # LeRobot bins the state after padding it to max_state_dim; openpi (and opentau) bin
                config["max_state_dim"] = state_width  # the real dims only: no padding gives LeRobot the same prompt
            images = lerobot_image_features(cameras, p.image_resolution)
            config.update({
                "image_resolution": list(p.image_resolution), "num_inference_steps": p.num_inference_steps,
                "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
                "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode},
                "input_features": {**images, "observation.state": {"type": "STATE", "shape": [state_width]}},
                "output_features": {"action": {"type": "ACTION", "shape": [len(stats["action"]["q01"])]}},
            })
        else:  # OpenTau (a LeRobot fork): images resized with padding, `num_steps` Euler steps
            config.update({"resize_imgs_with_padding": list(p.image_resolution), "num_steps": p.num_inference_steps})
    if variants:
        config["paligemma_variant"], config["action_expert_variant"] = variants
    if layout != LEROBOT and cameras:
        # openpi's and OpenTau's loaders ignore this key; `opentau serve` reads it, so that a model trained on several
        # cameras is served with all of them (docs/ARCHITECTURE.md, "Exports in the peers' own code").
        config["input_features"] = {**lerobot_image_features(cameras, p.image_resolution),
                                    "observation.state": {"type": "STATE", "shape": [len(stats["state"]["q01"])]}}
    return config


def policy_fields(config: dict) -> dict:
    """PolicyConfig fields read back from an exported config.json of any layout (the inverse of `model_config`)."""
    fields = {}
    for ours, names in (("chunk_size", ("chunk_size", "action_horizon")), ("n_action_steps", ("n_action_steps", "action_horizon")),
                        ("max_state_dim", ("max_state_dim", "action_dim")), ("max_action_dim", ("max_action_dim", "action_dim")),
                        ("tokenizer_max_length", ("tokenizer_max_length", "max_token_len")),
                        ("image_resolution", ("image_resolution", "resize_imgs_with_padding")),
                        ("num_inference_steps", ("num_inference_steps", "num_steps"))):
        found = next((config[n] for n in names if n in config), None)
        if found is not None:
            fields[ours] = found
    if config.get("type") in ("pi05", "pi0"):
        fields["type"] = config["type"]
    elif "pi05" in config:
        fields["type"] = "pi05" if config["pi05"] else "pi0"
    return fields


# ------------------------------------------------------------------------------------------- writing
def _asset_name(member: MixtureMember) -> str:
    """openpi names a robot's assets after its dataset: the served dataset's name ('demo' for the bundled one)."""
    return member.label.strip("/").replace("/", "_") or "robot"


def _output_dtype(name: str, dtype: torch.dtype, entry: TensorEntry) -> TensorEntry:
    """bf16 as openpi lays it out: the fp32 set (patch / position embeddings, norms, action / time projections) stays fp32."""
    from opentau_cli.policies.pi05.modeling import FP32_PARAMETERS

    keep = dtype == torch.float32 or any(fragment in name for fragment in FP32_PARAMETERS)
    target = torch.float32 if keep else dtype
    if not entry.dtype.is_floating_point or entry.dtype == target:
        return entry
    produce = entry.produce
    return TensorEntry(entry.name, entry.shape, target, lambda: produce().to(target))


def weight_entries(saved: SavedPolicy, params: set[str], layout: Layout, dtype: torch.dtype) -> list[TensorEntry]:
    """The policy's parameters under `layout`'s names (the tied token embedding under each of its names)."""
    out = []
    for name in sorted(params):
        entry = _output_dtype(name, dtype, saved.entries[name])
        for published in published_names(name, layout):
            out.append(TensorEntry(published, entry.shape, entry.dtype, entry.produce))
    return out


OPENPI_EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"


def export(target: Path, output: Path, *, layout: str = OPENTAU, dtype: str = "fp32", dataset: str | None = None,
           progress=None, force: bool = False, weights: str | None = None) -> ExportResult:
    """Write the policy of a run / checkpoint directory as a plain model in `layout`, serving `dataset` (a name of the
    run's datasets; default: the first) with that dataset's statistics. `progress(done_bytes, total_bytes)` follows
    the weights being written. Raises UserError / RunError."""
    if layout not in EXPORT_LAYOUTS:
        raise UserError(f"--layout must be one of {', '.join(EXPORT_LAYOUTS)}, not '{layout}'.")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, not '{dtype}'.")
    output = Path(output)
    check_target(output, force=force, source=target, command=COMMAND)  # the output convention: opentau_cli/store/outputs.py
    where = writable_parent(output)
    saved = open_saved_policy(target, weights)
    member = select_member(saved.config, dataset)
    if saved.config.policy.lora.enabled:
        saved.entries = _merged_lora(saved)
    shapes, params = policy_layout(saved.config.policy)
    check_entries(saved, shapes)
    published = Layout(layout, saved.config.policy.type)
    try:
        stats = _served_statistics(saved, member)
    except ShardFormatError as exc:  # a shard that reads as truncated or corrupt only when its data is read
        raise UserError(str(exc)) from None
    entries = weight_entries(saved, params, published, DTYPES[dtype])
    if layout in (OPENPI, LEROBOT):
        entries.append(_expert_lm_head(saved.config.policy, DTYPES[dtype], "model." if layout == LEROBOT else ""))
    cameras = camera_features(saved.config, member)
    if layout == OPENTAU:
        for name, tensor in opentau_stats_tensors(stats).items():
            entries.append(TensorEntry(name, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t))
    total = sum(e.nbytes for e in entries)
    free = shutil.disk_usage(where).free
    if free < total:
        raise UserError(f"Not enough disk space for {output}: the model needs {total / 1e9:.2f} GB, {free / 1e9:.2f} GB are free.")

    remote = remote_origin(saved.path)  # a cached copy of a checkpoint in remote storage is named by its URL
    shown = remote["address"] if remote is not None else None
    metadata = {"format": "pt", "producer": f"opentau {COMMAND}", "layout": layout, "step": str(saved.step),
                "dataset": member.label, "weights": saved.weights}
    config = model_config(layout, saved.config.policy, stats, dtype, cameras)
    if layout != LEROBOT:
        config[PROVENANCE_KEY] = {"weights": saved.weights, "step": saved.step}
    try:
        with publishing(output, force=force, source=target, command=COMMAND, recorded=shown) as staging:
            staging.mkdir()
            done = [0]

            def wrote(entry: TensorEntry) -> None:
                fault_point("tensor_written", output / MODEL_WEIGHTS)
                done[0] += entry.nbytes
                if progress is not None:
                    progress(done[0], total)

            files = [write_safetensors(staging / MODEL_WEIGHTS, entries, metadata, wrote)]
            if layout == LEROBOT:
                files += write_lerobot_stats(staging, stats, published.policy_type,
                                             lerobot_image_features(cameras, saved.config.policy.image_resolution),
                                             saved.config.policy.tokenizer_max_length)
            elif layout == OPENPI:
                files.append(write_openpi_stats(staging, stats, _asset_name(member)))
            (staging / MODEL_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            files.append(staging / MODEL_CONFIG)
    except ShardFormatError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise RunError(f"Writing the exported model to {output} failed ({exc.strerror or exc}); nothing was left behind.") from None
    return ExportResult(output, [output / f.relative_to(staging) for f in files], len(entries), total,
                        saved.weights, saved.step, shown or saved.path)


def _expert_lm_head(policy_cfg: PolicyConfig, dtype: torch.dtype, prefix: str = "") -> TensorEntry:
    """The action expert's output head, which openpi's and LeRobot's own checkpoints carry and their strict loaders
    require (`prefix`: LeRobot's `model.`); the expert's hidden states never reach it (the action projection reads
    them), so zeros stand for it."""
    from opentau_cli.policies.pi05.configuration import arch_config

    arch = arch_config(policy_cfg)
    shape = (arch.vlm_config.text_config.vocab_size, arch.dit_config.hidden_size)
    return TensorEntry(prefix + OPENPI_EXPERT_LM_HEAD, shape, dtype, lambda: torch.zeros(shape, dtype=dtype))


def _served_statistics(saved: SavedPolicy, member: MixtureMember) -> dict:
    """A mixture member's own statistics (the policy holds the first member's, widened), else the policy's own."""
    from opentau_cli.store.runs import read_training_state

    if saved.config.dataset.mixture is None:
        return statistics(saved)
    return member_statistics(read_training_state(saved.path), member)


def _merged_lora(saved: SavedPolicy) -> dict[str, TensorEntry]:
    """A LoRA checkpoint's tensors merged into its base: the entries of the plain policy."""
    from opentau_cli.policies.lora import check_base, merged_state_dict
    from opentau_cli.store.runs import read_training_state

    check_base(saved.path, read_training_state(saved.path), saved.config)
    merged = merged_state_dict(saved.config, {name: entry.produce() for name, entry in saved.entries.items()})
    return {name: TensorEntry(name, tuple(t.shape), t.dtype, lambda t=t: t) for name, t in merged.items()}


def _step(ckpt: Path) -> int | None:
    from opentau_cli.store.runs import read_training_state

    try:
        step = read_training_state(ckpt).get("step")
    except UserError:
        return None
    return step if isinstance(step, int) else None


def model_provenance(source: str | Path) -> dict:
    """{"weights": ema | live | None, "step": int | None} of a model: what `checkpoint export` recorded in its
    model.safetensors metadata; None where the model does not say (another producer, or an export written before
    opentau recorded the weights)."""
    from safetensors import SafetensorError, safe_open

    from opentau_cli.policies.pretrained import Checkpoint, weight_files

    with Checkpoint(source) as ckpt:
        files = weight_files(ckpt.path)
    try:
        with safe_open(str(files[0]), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (OSError, SafetensorError, IndexError):
        metadata = {}
    if metadata.get("producer") != "opentau checkpoint export":
        return {"weights": None, "step": None}
    step = metadata.get("step", "")
    return {"weights": metadata.get("weights"), "step": int(step) if step.isdigit() else None}
