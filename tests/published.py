"""Test helpers: published checkpoints written as openpi, LeRobot and OpenTau write them (their file formats as
documented by those projects, not through opentau's own code), and a Hugging Face cache laid out exactly as
huggingface_hub lays it out."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from opentau_cli.policies.layouts import LEROBOT, OPENPI, OPENTAU, Layout, published_names


def stats_of(policy, feature: str) -> dict[str, list[float]]:
    """A policy's statistics of `feature` ("state" / "action") over its real dims, by statistic name."""
    width = int(getattr(policy, f"{feature}_dim").item())
    names = [n[len(feature) + 1:] for n, _ in policy.named_buffers() if n.startswith(f"{feature}_") and n != f"{feature}_dim"]
    return {name: getattr(policy, f"{feature}_{name}")[:width].tolist() for name in names}


def write_published(policy, directory: Path, layout_name: str, *, robot: str = "my_robot") -> Path:
    """`policy` saved in a published layout: weights renamed, statistics in that layout's own place."""
    directory.mkdir(parents=True, exist_ok=True)
    layout = Layout(layout_name, policy.cfg.type)
    params = {name for name, _ in policy.named_parameters()}
    tensors = {}
    for name, tensor in policy.state_dict().items():
        if name in params:
            for published in published_names(name, layout):
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


def hub_cache(cache: Path, repo_id: str, folder: Path, *, revision: str = "main") -> str:
    """Put `folder`'s files into a Hugging Face cache the way huggingface_hub's downloads leave it:
    `models--org--name/blobs/<etag>`, `snapshots/<commit>/<file>` as relative symlinks to the blobs,
    `refs/<revision>` holding the commit, and the commit's tree listing under `trees/`. Returns the commit."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    files = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = file.relative_to(folder).as_posix()
        data = file.read_bytes()
        lfs = rel.endswith(".safetensors")
        etag = hashlib.sha256(data).hexdigest() if lfs else _git_blob_id(data)  # LFS files are named by sha256
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        files[rel] = {"size": len(data), "blob_id": _git_blob_id(data), **({"lfs_sha256": etag, "lfs_size": len(data)} if lfs else {})}
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": files}, indent=1))
    return commit


