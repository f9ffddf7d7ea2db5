"""From a TrainConfig to this rank's data: the episode split, the training stream and the validation loader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from opentau_cli.config.model import TrainConfig
from opentau_cli.data.dataset import LeRobotDataset
from opentau_cli.data.meta import read_meta
from opentau_cli.data.sampler import BatchStream, ResumableSampler, collate
from opentau_cli.data.synth import resolve_dataset_root
from opentau_cli.errors import UserError


def split_episodes(root: str | Path, val_split: float, seed: int, episodes: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Hold out round(val_split * n) whole episodes (at least 1 when val_split > 0), chosen by seed alone.

    Every rank and every resume computes the same split because it depends only on (episode list, val_split, seed).
    """
    all_eps = sorted(episodes) if episodes is not None else sorted(read_meta(resolve_dataset_root(root)).episodes)
    if val_split <= 0:
        return all_eps, []
    n_val = max(1, round(len(all_eps) * val_split))
    if n_val >= len(all_eps):
        raise UserError(
            f"validation.val_split={val_split} holds out {n_val} of {len(all_eps)} episodes and leaves none to train on."
        )
    order = np.random.default_rng([seed, 7919]).permutation(len(all_eps))  # a stream of its own, apart from the sampler's
    val = sorted(all_eps[i] for i in order[:n_val])
    held_out = set(val)
    return [e for e in all_eps if e not in held_out], val


@dataclass
class TrainData:
    stream: BatchStream
    val_loader: DataLoader | None
    stats: dict
    state_dim: int
    action_dim: int
    train_dataset: LeRobotDataset
    val_dataset: LeRobotDataset | None


def make_dataset(cfg: TrainConfig, root: Path, episodes: list[int]) -> LeRobotDataset:
    d, p = cfg.dataset, cfg.policy
    return LeRobotDataset(
        root, episodes, chunk_size=p.chunk_size, image_resolution=tuple(p.image_resolution), num_cameras=d.num_cameras,
        camera_keys=d.camera_keys, state_key=d.state_key, action_key=d.action_key, prompt=d.prompt, video_cache_mb=d.video_cache_mb,
    )


def build_data(cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> TrainData:
    """This rank's training stream (batches of per_device_batch_size) and validation loader; stats of the train split."""
    import torch

    root = resolve_dataset_root(cfg.dataset.root)
    train_eps, val_eps = split_episodes(root, cfg.validation.val_split, cfg.seed, cfg.dataset.episodes)
    train = make_dataset(cfg, root, train_eps)
    # The widths against policy.max_*_dim were checked before launch from meta/info.json (data/check.py): hold the
    # data to what its meta declares, so that check stands for the rows themselves.
    for key, width in ((cfg.dataset.state_key, train.state_dim), (cfg.dataset.action_key, train.action_dim)):
        if width != train.meta.width(key):
            raise UserError(f"{root}: '{key}' rows are {width} wide but meta/info.json declares {train.meta.width(key)}.")
    micro = cfg.per_device_batch_size or cfg.batch_size
    pin = torch.cuda.is_available()
    sampler = ResumableSampler(len(train), seed=cfg.seed, rank=rank, world_size=world_size, shuffle=True)
    stream = BatchStream(train, sampler, micro, num_workers=cfg.dataset.num_workers, pin_memory=pin)
    val_ds, val_loader = None, None
    if val_eps:
        val_ds = make_dataset(cfg, root, val_eps)
        val_sampler = ResumableSampler(len(val_ds), seed=cfg.seed, rank=rank, world_size=world_size, shuffle=False)
        if len(val_sampler) > 0:
            # Workers 0: validation is occasional, and idle persistent workers would only hold memory.
            val_loader = DataLoader(val_ds, batch_size=micro, sampler=val_sampler, num_workers=0, pin_memory=pin, collate_fn=collate,
                                    generator=torch.Generator().manual_seed(cfg.seed))  # keeps the global RNG untouched
    return TrainData(stream=stream, val_loader=val_loader, stats=train.stats, state_dim=train.state_dim,
                     action_dim=train.action_dim, train_dataset=train, val_dataset=val_ds)
