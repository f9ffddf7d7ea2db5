"""Test helpers: published checkpoints written as openpi, LeRobot and OpenTau write them (their file formats as
documented by those projects, not through opentau's own code), and a Hugging Face cache laid out exactly as
huggingface_hub lays it out."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from opentau_cli.policies.layouts import LEROBOT, OPENPI, OPENTAU


# Written out from the published layouts (the tree of openpi's PyTorch conversion) for the real pi05 dimensions:
# SigLIP 1152 x 27 layers, MLP 4304, patch 14 at 224 px (16 x 16 = 256 positions); Gemma 2048 x 18 layers,
# 8 heads / 1 KV head / head dim 256, MLP 16384, vocab 257152; expert 1024 x 18, MLP 4096; action dim 32.
SIGLIP, SIGLIP_MLP, SIGLIP_LAYERS, PATCH, POSITIONS = 1152, 4304, 27, 14, 256
GEMMA, GEMMA_MLP, GEMMA_LAYERS, VOCAB = 2048, 16384, 18, 257152
EXPERT, EXPERT_MLP, EXPERT_LAYERS = 1024, 4096, 18
HEADS, KV_HEADS, HEAD_DIM, ACTION_DIM = 8, 1, 256, 32


def published_keys(policy_type: str, prefix: str, *, embed_tokens: bool, expert_lm_head: bool = False) -> dict[str, tuple]:
    keys: dict[str, tuple] = {}
    vision = f"{prefix}paligemma_with_expert.paligemma.model.vision_tower.vision_model."
    keys[vision + "embeddings.patch_embedding.weight"] = (SIGLIP, 3, PATCH, PATCH)
    keys[vision + "embeddings.patch_embedding.bias"] = (SIGLIP,)
    keys[vision + "embeddings.position_embedding.weight"] = (POSITIONS, SIGLIP)
    for i in range(SIGLIP_LAYERS):
        layer = f"{vision}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            keys[f"{layer}{norm}.weight"] = keys[f"{layer}{norm}.bias"] = (SIGLIP,)
        keys[f"{layer}mlp.fc1.weight"], keys[f"{layer}mlp.fc1.bias"] = (SIGLIP_MLP, SIGLIP), (SIGLIP_MLP,)
        keys[f"{layer}mlp.fc2.weight"], keys[f"{layer}mlp.fc2.bias"] = (SIGLIP, SIGLIP_MLP), (SIGLIP,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            keys[f"{layer}self_attn.{proj}.weight"], keys[f"{layer}self_attn.{proj}.bias"] = (SIGLIP, SIGLIP), (SIGLIP,)
    keys[vision + "post_layernorm.weight"] = keys[vision + "post_layernorm.bias"] = (SIGLIP,)
    projector = f"{prefix}paligemma_with_expert.paligemma.model.multi_modal_projector.linear."
    keys[projector + "weight"], keys[projector + "bias"] = (GEMMA, SIGLIP), (GEMMA,)
    language = f"{prefix}paligemma_with_expert.paligemma.model.language_model."
    if embed_tokens:
        keys[language + "embed_tokens.weight"] = (VOCAB, GEMMA)
    keys[f"{prefix}paligemma_with_expert.paligemma.lm_head.weight"] = (VOCAB, GEMMA)

    def gemma_layer(layer: str, width: int, mlp: int) -> None:
        keys[f"{layer}self_attn.q_proj.weight"] = (HEADS * HEAD_DIM, width)
        keys[f"{layer}self_attn.k_proj.weight"] = keys[f"{layer}self_attn.v_proj.weight"] = (KV_HEADS * HEAD_DIM, width)
        keys[f"{layer}self_attn.o_proj.weight"] = (width, HEADS * HEAD_DIM)
        keys[f"{layer}mlp.gate_proj.weight"] = keys[f"{layer}mlp.up_proj.weight"] = (mlp, width)
        keys[f"{layer}mlp.down_proj.weight"] = (width, mlp)

    for i in range(GEMMA_LAYERS):
        gemma_layer(f"{language}layers.{i}.", GEMMA, GEMMA_MLP)
        keys[f"{language}layers.{i}.input_layernorm.weight"] = keys[f"{language}layers.{i}.post_attention_layernorm.weight"] = (GEMMA,)
    keys[language + "norm.weight"] = (GEMMA,)
    expert = f"{prefix}paligemma_with_expert.gemma_expert.model."
    for i in range(EXPERT_LAYERS):
        gemma_layer(f"{expert}layers.{i}.", EXPERT, EXPERT_MLP)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if policy_type == "pi05":  # adaRMS: Linear(1024 -> 3 * 1024) for scale, shift, gate
                keys[f"{expert}layers.{i}.{norm}.dense.weight"], keys[f"{expert}layers.{i}.{norm}.dense.bias"] = (3 * EXPERT, EXPERT), (3 * EXPERT,)
            else:
                keys[f"{expert}layers.{i}.{norm}.weight"] = (EXPERT,)
    if policy_type == "pi05":
        keys[expert + "norm.dense.weight"], keys[expert + "norm.dense.bias"] = (3 * EXPERT, EXPERT), (3 * EXPERT,)
    else:
        keys[expert + "norm.weight"] = (EXPERT,)
    if expert_lm_head:
        keys[f"{prefix}paligemma_with_expert.gemma_expert.lm_head.weight"] = (VOCAB, EXPERT)
    head = {"action_in_proj": (EXPERT, ACTION_DIM), "action_out_proj": (ACTION_DIM, EXPERT)}
    if policy_type == "pi05":
        head.update(time_mlp_in=(EXPERT, EXPERT), time_mlp_out=(EXPERT, EXPERT))
    else:
        head.update(state_proj=(EXPERT, ACTION_DIM), action_time_mlp_in=(EXPERT, 2 * EXPERT), action_time_mlp_out=(EXPERT, EXPERT))
    for name, shape in head.items():
        keys[f"{prefix}{name}.weight"], keys[f"{prefix}{name}.bias"] = shape, (shape[0],)
    return keys


def stats_of(policy, feature: str) -> dict[str, list[float]]:
    """A policy's statistics of `feature` ("state" / "action") over its real dims, by statistic name."""
    width = int(getattr(policy, f"{feature}_dim").item())
    names = [n[len(feature) + 1:] for n, _ in policy.named_buffers() if n.startswith(f"{feature}_") and n != f"{feature}_dim"]
    return {name: getattr(policy, f"{feature}_{name}")[:width].tolist() for name in names}


# Where each part of opentau's policy sits in the published tree (the tree of openpi's PyTorch conversion, which
# LeRobot and OpenTau prefix with `model.`), written from the published layouts, not from opentau's name mapping:
# the fixtures must not share a mistake with the code they test.
_PUBLISHED_PLACES = [  # (opentau's name prefix, the published one), first match wins
    ("vlm.vision_tower.", "paligemma_with_expert.paligemma.model.vision_tower.vision_model."),
    ("vlm.multi_modal_projector.", "paligemma_with_expert.paligemma.model.multi_modal_projector."),
    ("vlm.language_model.", "paligemma_with_expert.paligemma.model.language_model."),
    ("expert.", "paligemma_with_expert.gemma_expert.model."),
    ("embed_suffix.", ""),  # action_in_proj, time_mlp_* (pi05); state_proj, action_time_mlp_* (pi0): top level
    ("action_out_proj.", "action_out_proj."),
]
_ADARMS_NORM = re.compile(r"^(paligemma_with_expert\.gemma_expert\.model\.(?:layers\.\d+\.(?:input_layernorm|post_attention_layernorm)|norm))\.(weight|bias)$")


def spec_published_names(ours: str, layout_name: str, policy_type: str) -> list[str]:
    """The published name(s) of opentau's parameter `ours`, from the published layouts: the token embedding is
    written as the tied `lm_head` (openpi, LeRobot) or as both `embed_tokens` and `lm_head` (OpenTau); pi05's
    expert norms are adaRMS `dense` layers."""
    prefix = "" if layout_name == OPENPI else "model."
    if ours == "vlm.language_model.embed_tokens.weight":
        lm_head = f"{prefix}paligemma_with_expert.paligemma.lm_head.weight"
        if layout_name == OPENTAU:
            return [f"{prefix}paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight", lm_head]
        return [lm_head]
    ours_prefix, theirs = next((o, t) for o, t in _PUBLISHED_PLACES if ours.startswith(o))
    name = theirs + ours[len(ours_prefix):]
    if policy_type == "pi05":
        name = _ADARMS_NORM.sub(r"\1.dense.\2", name)
    return [prefix + name]


def write_published(policy, directory: Path, layout_name: str, *, robot: str = "my_robot") -> Path:
    """`policy` saved in a published layout: weights under their published names (`spec_published_names`),
    statistics in that layout's own place."""
    directory.mkdir(parents=True, exist_ok=True)
    params = {name for name, _ in policy.named_parameters()}
    tensors = {}
    for name, tensor in policy.state_dict().items():
        if name in params:
            for published in spec_published_names(name, layout_name, policy.cfg.type):
                assert published not in tensors, published
                tensors[published] = tensor.detach().clone().contiguous()
    state, action = stats_of(policy, "state"), stats_of(policy, "action")
    if layout_name == OPENTAU:  # buffers of OpenTau's normalize modules
        for stat, values in state.items():
            tensors[f"normalize_inputs.buffer_state.{stat}"] = torch.tensor(values)
        for stat, values in action.items():
            tensors[f"normalize_targets.buffer_actions.{stat}"] = torch.tensor(values)
            tensors[f"unnormalize_outputs.buffer_actions.{stat}"] = torch.tensor(values)
        tensors["model.paligemma_with_expert.discrete_action_embedding.weight"] = torch.zeros(4, 8)
    save_file(tensors, str(directory / "model.safetensors"))
    if layout_name == LEROBOT:  # policy_preprocessor.json + the normalizer step's state file
        state_file = "policy_preprocessor_step_2_normalizer_processor.safetensors"
        flat = {f"observation.state.{k}": torch.tensor(v) for k, v in state.items()}
        flat.update({f"action.{k}": torch.tensor(v) for k, v in action.items()})
        flat["observation.images.top.mean"] = torch.zeros(3, 1, 1)
        save_file(flat, str(directory / state_file))
        steps = [
            {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}},
            {"registry_name": "normalizer_processor", "config": {"eps": 1e-8, "norm_map": {"STATE": "QUANTILES", "ACTION": "QUANTILES"}},
             "state_file": state_file},
        ]
        (directory / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": steps}))
        (directory / "config.json").write_text(json.dumps({"type": policy.cfg.type}))
    if layout_name == OPENPI:  # assets/<robot>/norm_stats.json
        assets = directory / "assets" / robot
        assets.mkdir(parents=True)
        (assets / "norm_stats.json").write_text(json.dumps({"norm_stats": {"state": state, "actions": action}}))
    return directory


def write_header_only(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> Path:
    """A safetensors file whose data is a sparse hole: real headers of a full-size model at no disk cost."""
    size = {"BF16": 2, "F32": 4}[dtype]
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = size
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _cache_blob(storage: Path, commit: str, rel: str, blob: Path, etag: str) -> None:
    """`blob` moved to `blobs/<etag>`, and `snapshots/<commit>/<rel>` a relative symlink to it."""
    target = storage / "blobs" / etag
    target.parent.mkdir(parents=True, exist_ok=True)
    blob.replace(target)
    link = storage / "snapshots" / commit / rel
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _cache_refs(storage: Path, commit: str, revision: str, files: dict) -> None:
    """`refs/<revision>` holding the commit, and the commit's tree listing under `trees/`."""
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": files}, indent=1))


def _storage(cache: Path, repo_id: str, revision: str) -> tuple[Path, str]:
    return cache / f"models--{repo_id.replace('/', '--')}", hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()


def hub_cache(cache: Path, repo_id: str, folder: Path, *, revision: str = "main") -> str:
    """Put `folder`'s files into a Hugging Face cache the way huggingface_hub's downloads leave it:
    `models--org--name/blobs/<etag>`, `snapshots/<commit>/<file>` as relative symlinks to the blobs,
    `refs/<revision>` holding the commit, and the commit's tree listing under `trees/`. Returns the commit."""
    storage, commit = _storage(cache, repo_id, revision)
    files = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = file.relative_to(folder).as_posix()
        data = file.read_bytes()
        lfs = rel.endswith(".safetensors")
        etag = hashlib.sha256(data).hexdigest() if lfs else _git_blob_id(data)  # LFS files are named by sha256
        staged = storage / "blobs" / f"{etag}.incomplete"
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_bytes(data)
        _cache_blob(storage, commit, rel, staged, etag)
        files[rel] = {"size": len(data), "blob_id": _git_blob_id(data), **({"lfs_sha256": etag, "lfs_size": len(data)} if lfs else {})}
    _cache_refs(storage, commit, revision, files)
    return commit


def hub_cache_header_only(cache: Path, repo_id: str, shapes: dict[str, tuple[int, ...]], *, revision: str = "main") -> Path:
    """A repo holding a full-size `model.safetensors` with real headers and sparse data (`write_header_only`), written
    in place in the cache as `hub_cache` lays it out; never read back. Its blob is named by a hash of its header, not
    of its contents (hashing gigabytes of holes would read them), which no offline lookup checks. Returns the blob."""
    storage, commit = _storage(cache, repo_id, revision)
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    staged = write_header_only(storage / "blobs" / "model.safetensors.incomplete", shapes)
    with open(staged, "rb") as f:
        header = f.read(8 + struct.unpack("<Q", f.read(8))[0])
    etag, size = hashlib.sha256(header).hexdigest(), staged.stat().st_size
    _cache_blob(storage, commit, "model.safetensors", staged, etag)
    _cache_refs(storage, commit, revision, {"model.safetensors": {"size": size, "blob_id": etag[:40], "lfs_sha256": etag, "lfs_size": size}})
    return storage / "blobs" / etag


def save_word_tokenizer(path: Path) -> dict[str, int]:
    """A small word-level Hugging Face tokenizer directory (pad id 0, a BOS token) that AutoTokenizer loads offline:
    the shape of PaliGemma's tokenizer files, not its vocabulary. Returns the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[BOS]", "[UNK]", "Task", "State", "Action", ":", ";", ",", "pick", "up", "the", "cube"] + [str(i) for i in range(256)]
    vocab = {w: i for i, w in enumerate(words)}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", bos_token="[BOS]", unk_token="[UNK]").save_pretrained(str(path))
    return vocab
