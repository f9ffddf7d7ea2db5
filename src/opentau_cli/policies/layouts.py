"""Published pi05 / pi0 checkpoint layouts: which one a checkpoint is (from its keys), how its names map onto
opentau's module and back (loading uses one direction, export the other), and where it keeps its normalization
statistics.

All published PyTorch layouts share the tree of openpi's JAX-to-PyTorch conversion (`paligemma_with_expert.
{paligemma,gemma_expert}...`); LeRobot and OpenTau add a `model.` prefix. transformers ships the mapping from the
LeRobot pi0 layout to its own PI0 names (`conversion_mapping.py`, "pi0"); opentau's module is built from the same
transformers pieces, so the names are that mapping followed by a few renames of our own (PI0's `model.vlm` /
`model.dit` / `embed_action_time` are opentau's `vlm` / `expert` / `embed_suffix`, SigLIP without its
`vision_model` level, pi05's adaRMS `dense` layers held directly by the norm).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from opentau_cli.errors import UserError

NATIVE, OPENPI, LEROBOT, OPENTAU = "native", "openpi", "lerobot", "opentau"
LAYOUT_NAMES = (NATIVE, OPENPI, LEROBOT, OPENTAU)
_LABELS = {NATIVE: "opentau's own", OPENPI: "openpi", LEROBOT: "LeRobot", OPENTAU: "OpenTau"}

EMBED_TOKENS = "vlm.language_model.embed_tokens.weight"
# OpenTau keeps its statistics as buffers of these modules, e.g. normalize_inputs.buffer_state.min.
_OPENTAU_STATS = re.compile(r"^(?:model\.)?(?:normalize_inputs|normalize_targets|normalize_actions|unnormalize_outputs)"
                            r"\.buffer_(state|actions)\.(\w+)$")
_OPENTAU_ONLY = ("discrete_action_embedding.", "da_head.")
# LeRobot names the features by their dataset keys; openpi by its own.
_LEROBOT_FEATURES = {"state": "observation.state", "action": "action"}
_OPENPI_FEATURES = {"state": "state", "action": "actions"}


@dataclass(frozen=True)
class Layout:
    """A checkpoint's spelling (`name`, one of LAYOUT_NAMES) and the policy it holds (pi05 or pi0)."""

    name: str
    policy_type: str
    # Some OpenTau pi05 checkpoints still call the time MLP `action_time_mlp_*` (OpenTau's loader renames it).
    legacy_time_mlp: bool = False

    @property
    def label(self) -> str:
        return f"{_LABELS[self.name]} {self.policy_type}"

    @property
    def stats_in_weights(self) -> bool:
        return self.name in (NATIVE, OPENTAU)


def detect_layout(keys, source: str = "the checkpoint") -> Layout:
    """The layout of a checkpoint from its tensor names (openpi decides from its path; names are what we have)."""
    keys = list(keys)
    published = [k for k in keys if "paligemma_with_expert." in k]
    if published:
        if any(k.startswith("model.paligemma_with_expert.") for k in published):
            # Only OpenTau writes normalize buffers or its discrete-action head into the weights; without them the
            # two read the same (and such an OpenTau file has no statistics for the LeRobot reader to miss).
            opentau = any(_OPENTAU_STATS.match(k) or any(m in k for m in _OPENTAU_ONLY) for k in keys)
            name = OPENTAU if opentau else LEROBOT
        else:
            name = OPENPI
        adarms = any(".gemma_expert." in k and ".dense." in k for k in published)
        time_mlp = any(re.search(r"(^|\.)time_mlp_in\.", k) for k in keys)
    elif any(k.startswith(("vlm.", "expert.", "embed_suffix.")) for k in keys):
        name = NATIVE
        adarms = time_mlp = any(k.startswith("embed_suffix.time_mlp_in.") for k in keys)
    else:
        shown = ", ".join(keys[:3]) or "none"
        raise UserError(f"{source}: not a pi05 or pi0 checkpoint: none of its {len(keys)} tensor names is an opentau, "
                        f"openpi, LeRobot or OpenTau one (first: {shown}).")
    state_token = any(re.search(r"(^|\.)state_proj\.", k) for k in keys)
    action_time = any(re.search(r"(^|\.)action_time_mlp_in\.", k) for k in keys)
    if (adarms or time_mlp) and not state_token:
        return Layout(name, "pi05", legacy_time_mlp=action_time and not time_mlp)
    if (state_token or action_time) and not adarms:
        return Layout(name, "pi0")
    raise UserError(f"{source}: cannot tell pi05 from pi0: it has {'both' if state_token else 'neither'} pi0's state "
                    "projection and pi05's time-conditioned (adaRMS) expert norms.")


def _renamings(layout: Layout) -> list:
    """The ordered transformers WeightRenamings from `layout`'s names to opentau's (empty for opentau's own)."""
    if layout.name == NATIVE:
        return []
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming

    shipped = get_checkpoint_conversion_mapping("pi0")  # LeRobot pi0 layout -> transformers PI0 names
    if layout.name == OPENPI:  # the same tree without LeRobot's `model.` prefix
        shipped = [t for t in shipped if not isinstance(t, PrefixChange)]
    ours = [
        WeightRenaming(r"^model\.vlm", "vlm"),
        WeightRenaming(r"^vlm\.vision_tower\.vision_model", "vlm.vision_tower"),
        WeightRenaming(r"^model\.dit", "expert"),
        WeightRenaming(r"^embed_action_time", "embed_suffix"),
    ]
    if layout.policy_type == "pi05":
        ours += [
            WeightRenaming(r"^time_mlp_", "embed_suffix.time_mlp_"),
            WeightRenaming(r"^expert\.layers\.(\d+)\.input_layernorm\.dense", r"expert.layers.\1.input_layernorm"),
            WeightRenaming(r"^expert\.layers\.(\d+)\.post_attention_layernorm\.dense", r"expert.layers.\1.post_attention_layernorm"),
            WeightRenaming(r"^expert\.norm\.dense", "expert.norm"),
        ]
    return shipped + ours


def our_name(key: str, layout: Layout) -> str:
    """A checkpoint tensor name in `layout` -> the name it has in opentau's policy state_dict."""
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = _renamings(layout)
    if layout.legacy_time_mlp:  # load-only: an export writes the current names
        renamings = [WeightRenaming("action_time_mlp_", "time_mlp_"), *renamings]
    return apply_renamings(key, renamings)


def published_names(key: str, layout: Layout) -> list[str]:
    """An opentau state_dict name -> its name(s) in `layout`: the tied token embedding is written as `lm_head`
    (openpi, LeRobot), or as both `embed_tokens` and `lm_head` (OpenTau). Statistics buffers are not weights of
    the published layouts: write them in the layout's own place instead (see `read_stats`)."""
    from transformers.core_model_loading import apply_renamings

    reverse = [t.reverse_transform() for t in reversed(_renamings(layout))]
    name = apply_renamings(key, reverse)
    if key == EMBED_TOKENS and layout.name == OPENTAU:
        prefix = name.removesuffix("lm_head.weight")
        return [f"{prefix}model.language_model.embed_tokens.weight", name]
    return [name]


def ignored_reason(key: str, mapped: str) -> str | None:
    """Why a checkpoint tensor that opentau does not hold is skipped on purpose (None: it is unexpected)."""
    if _OPENTAU_STATS.match(key):
        return "normalization statistics (read as statistics, not weights)"
    if any(m in key for m in _OPENTAU_ONLY):
        return "OpenTau's discrete-action head (opentau's discrete_action_loss uses the vocabulary's last rows instead)"
    if mapped == "expert.embed_tokens.weight":
        return "the action expert's token embedding (opentau's expert never reads token ids)"
    return None


# ------------------------------------------------------------------------------------------- statistics
def _lists(stats: dict) -> dict:
    return {name: [float(x) for x in (v.flatten().tolist() if hasattr(v, "flatten") else v)] for name, v in stats.items()}


def read_stats(layout: Layout, root: Path, keys, read_tensor) -> tuple[dict | None, str]:
    """Normalization statistics a checkpoint carries outside opentau's own buffers, as
    `{"state": {stat: [...]}, "action": {stat: [...]}}`, and where they were read. (None, why) when it has none.

    `root` is the directory holding the weights; `read_tensor(key)` reads one tensor of the weights.
    """
    if layout.name == NATIVE:
        return None, "opentau checkpoints keep them in the policy's own buffers"
    if layout.name == OPENTAU:
        stats: dict = {}
        for key in sorted(keys):
            m = _OPENTAU_STATS.match(key)
            if m:
                feature = "state" if m.group(1) == "state" else "action"
                stats.setdefault(feature, {}).setdefault(m.group(2), read_tensor(key))
        found = {f: _lists(s) for f, s in stats.items()}
        return (found, "its normalize_* / unnormalize_* buffers") if found else (None, "it has no normalize_* buffers")
    if layout.name == LEROBOT:
        return _lerobot_stats(root)
    return _openpi_stats(root)


def _lerobot_stats(root: Path) -> tuple[dict | None, str]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = root / "policy_preprocessor.json"
    files = []
    if config.is_file():
        try:
            steps = json.loads(config.read_text())["steps"]
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{config}: not a LeRobot processor config ({exc}).") from exc
        files = [root / s["state_file"] for s in steps if s.get("registry_name") == "normalizer_processor" and s.get("state_file")]
    else:
        files = sorted(root.glob("policy_preprocessor_step_*_normalizer_processor.safetensors"))
    if not files:
        return None, "it has no LeRobot normalizer files: policy_preprocessor.json"
    file = files[0]
    try:
        flat = load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{file}: not a readable LeRobot normalizer file ({exc}).") from exc
    stats = {}
    for feature, prefix in _LEROBOT_FEATURES.items():
        found = {k[len(prefix) + 1:]: v for k, v in flat.items() if k.startswith(prefix + ".") and "." not in k[len(prefix) + 1:]}
        if found:
            stats[feature] = _lists(found)
    return (stats, file.name) if stats else (None, f"{file.name} has no state or action statistics")


def _openpi_stats(root: Path) -> tuple[dict | None, str]:
    files = sorted(root.glob("assets/*/norm_stats.json"))
    if not files:
        return None, "it has no assets/<robot>/norm_stats.json"
    if len(files) > 1:
        raise UserError(f"{root}: several openpi statistics files ({', '.join(str(f.relative_to(root)) for f in files)}); "
                        "keep the one of the robot you fine-tune on.")
    try:
        norm = json.loads(files[0].read_text())["norm_stats"]
        stats = {f: _lists({k: v for k, v in norm[name].items() if v is not None}) for f, name in _OPENPI_FEATURES.items() if name in norm}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{files[0]}: not an openpi norm_stats.json ({exc}).") from exc
    return (stats, str(files[0].relative_to(root))) if stats else (None, f"{files[0].relative_to(root)} has no state or actions")


# The writers: what `read_stats` reads back, in each layout's own place (an export writes these).
LEROBOT_NORMALIZER = "policy_preprocessor_step_2_normalizer_processor.safetensors"
LEROBOT_UNNORMALIZER = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
_LEROBOT_NORM_MODES = {"pi05": "QUANTILES", "pi0": "MEAN_STD"}


def opentau_stats_tensors(stats: dict) -> dict:
    """OpenTau's statistics buffers (inside the weights): the state under normalize_inputs, the actions under both
    normalize_targets and unnormalize_outputs."""
    import torch

    tensors = {}
    for stat, values in stats["state"].items():
        tensors[f"normalize_inputs.buffer_state.{stat}"] = torch.tensor(values, dtype=torch.float32)
    for stat, values in stats["action"].items():
        for module in ("normalize_targets", "unnormalize_outputs"):
            tensors[f"{module}.buffer_actions.{stat}"] = torch.tensor(values, dtype=torch.float32)
    return tensors


def lerobot_image_features(cameras, resolution) -> dict:
    """LeRobot's input features of the cameras (None: a padded slot, not a feature), images (C, H, W)."""
    return {name: {"type": "VISUAL", "shape": [3, *resolution]} for name in cameras if name}


def write_lerobot_stats(directory: Path, stats: dict, policy_type: str, images: dict | None = None,
                        tokenizer_max_length: int = 48) -> list[Path]:
    """LeRobot's processor files: policy_preprocessor.json with its normalizer step's state file (state and action
    statistics by dataset key) and, for pi05, its state-binning and PaliGemma tokenizer steps; policy_postprocessor.json
    with the unnormalizer's (action statistics). `images`: lerobot_image_features of the cameras (identity-normalized)."""
    import torch
    from safetensors.torch import save_file

    mode = _LEROBOT_NORM_MODES[policy_type]
    features = {_LEROBOT_FEATURES["state"]: {"type": "STATE", "shape": [len(next(iter(stats["state"].values())))]},
                _LEROBOT_FEATURES["action"]: {"type": "ACTION", "shape": [len(next(iter(stats["action"].values())))]}}
    norm_map = {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode}
    state_width = features[_LEROBOT_FEATURES["state"]]["shape"][0]
    images = images or {}

    def flat(names):
        return {f"{_LEROBOT_FEATURES[f]}.{stat}": torch.tensor(v, dtype=torch.float32) for f in names for stat, v in stats[f].items()}

    save_file(flat(("state", "action")), str(directory / LEROBOT_NORMALIZER))
    save_file(flat(("action",)), str(directory / LEROBOT_UNNORMALIZER))
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "normalizer_processor", "config": {"eps": 1e-8, "features": {**images, **features}, "norm_map": norm_map},
         "state_file": LEROBOT_NORMALIZER},
        {"registry_name": "device_processor", "config": {"device": "cpu"}},
    ]}
    if policy_type == "pi05":  # the binned state in the prompt, then PaliGemma's tokenizer (LeRobot's pi05 steps)
        pre["steps"][3:3] = [
            {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {"max_state_dim": state_width, "task_key": "task"}},
            {"registry_name": "tokenizer_processor", "config": {
                "max_length": tokenizer_max_length, "task_key": "task", "padding_side": "right", "padding": "max_length",
                "truncation": True, "tokenizer_name": "google/paligemma-3b-pt-224"}},
        ]
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor",
         "config": {"eps": 1e-8, "features": {k: v for k, v in features.items() if v["type"] == "ACTION"}, "norm_map": norm_map},
         "state_file": LEROBOT_UNNORMALIZER},
        {"registry_name": "device_processor", "config": {"device": "cpu"}},
    ]}
    written = [directory / LEROBOT_NORMALIZER, directory / LEROBOT_UNNORMALIZER]
    for name, data in (("policy_preprocessor.json", pre), ("policy_postprocessor.json", post)):
        (directory / name).write_text(json.dumps(data, indent=2) + "\n")
        written.append(directory / name)
    return written


def write_openpi_stats(directory: Path, stats: dict, asset: str) -> Path:
    """openpi's assets/<asset>/norm_stats.json: mean / std / q01 / q99 per key (state, actions)."""
    path = directory / "assets" / asset / "norm_stats.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    norm = {name: stats[feature] for feature, name in _OPENPI_FEATURES.items()}
    path.write_text(json.dumps({"norm_stats": norm}, indent=2) + "\n")
    return path
