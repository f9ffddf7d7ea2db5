"""From a TrainConfig to this rank's data: the episode split, the training stream and the validation loader."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from opentau_cli.config.model import MixtureMember, TrainConfig
from opentau_cli.data.dataset import LeRobotDataset
from opentau_cli.data.fingerprint import fingerprints
from opentau_cli.data.hub import revisions
from opentau_cli.data.meta import read_meta
from opentau_cli.data.mixture import MixtureDataset, MixtureSampler, into_policy_space, mixture_stats
from opentau_cli.data.normalization import mode_of
from opentau_cli.data.files import LOCAL
from opentau_cli.data.remote import member_files
from opentau_cli.data.sampler import BatchStream, ResumableSampler
from opentau_cli.data.synth import resolve_dataset_root
from opentau_cli.data.video import VideoFrames
from opentau_cli.errors import UserError


def split_episodes(root: str | Path, val_split: float, seed: int, episodes: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Hold out round(val_split * n) whole episodes (at least 1 when val_split > 0), chosen by seed alone.

    Every rank and every resume computes the same split because it depends only on (episode list, val_split, seed).
    A mixture splits each member this way.
    """
    all_eps = sorted(episodes) if episodes is not None else sorted(read_meta(resolve_dataset_root(root)).episodes)
    if val_split <= 0:
        return all_eps, []
    n_val = max(1, round(len(all_eps) * val_split))
    if n_val >= len(all_eps):
        raise UserError(
            f"validation.val_split={val_split} holds out {n_val} of {len(all_eps)} episodes of {root} and leaves none to train on."
        )
    order = np.random.default_rng([seed, 7919]).permutation(len(all_eps))  # a stream of its own, apart from the sampler's
    val = sorted(all_eps[i] for i in order[:n_val])
    held_out = set(val)
    return [e for e in all_eps if e not in held_out], val


@dataclass
class TrainData:
    stream: BatchStream
    val_loader: DataLoader | None
    stats: dict  # what the policy normalizes with
    state_dim: int
    action_dim: int
    train_dataset: LeRobotDataset | MixtureDataset
    val_dataset: LeRobotDataset | MixtureDataset | None
    names: list[str] = field(default_factory=list)  # the datasets, in config order
    weights: list[float] = field(default_factory=list)
    member_stats: list[dict] = field(default_factory=list)  # each dataset's own statistics
    revisions: dict = field(default_factory=dict)  # the Hub datasets' commits, {name: {repo_id, commit}}
    fingerprints: dict = field(default_factory=dict)  # the datasets' files, {name: fingerprint} (data/fingerprint.py)
    remote: bool = False  # some dataset is read from object storage (data/remote.py): its reads can wait, then fail

    @property
    def is_mixture(self) -> bool:
        return isinstance(self.train_dataset, MixtureDataset)

    def set_prompt_tokenizer(self, prompt) -> None:
        """Training and validation batches carry their prompt's token ids, made by `prompt` (the policy's rule and
        statistics: Pi05Policy.prompt_tokenizer) in the data workers."""
        self.stream.set_prompt_tokenizer(prompt)  # the validation loader shares the stream's collate


def make_dataset(cfg: TrainConfig, member: MixtureMember, root: Path, episodes: list[int], video: VideoFrames | None = None,
                 files=LOCAL) -> LeRobotDataset:
    """`files`: how its files are reached (data/remote.py member_files, which also gives `root`)."""
    d, p = cfg.dataset, cfg.policy
    return LeRobotDataset(
        root, episodes, chunk_size=p.chunk_size, image_resolution=tuple(p.image_resolution), num_cameras=d.num_cameras,
        camera_keys=member.camera_keys, state_key=member.state_key, action_key=member.action_key, prompt=member.prompt,
        video_cache_mb=d.video_cache_mb, video=video, files=files,
    )


def build_data(cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> TrainData:
    """This rank's training stream (batches of per_device_batch_size) and validation loader; stats of the train split."""
    import torch

    members = cfg.dataset.members()
    mixture = cfg.dataset.mixture is not None
    video = VideoFrames(cache_mb=cfg.dataset.video_cache_mb) if mixture else None  # one budget for all members
    trains, vals, roots, sources = [], [], [], []
    for i, member in enumerate(members):
        root, files = member_files(member, cfg.dataset, f"dataset.mixture[{i}]" if mixture else "dataset")
        roots.append(root)
        sources.append(files)
        train_eps, val_eps = split_episodes(root, cfg.validation.val_split, cfg.seed, member.episodes)
        train = make_dataset(cfg, member, root, train_eps, video, files)
        # The widths against policy.max_*_dim were checked before launch from meta/info.json (data/check.py): hold the
        # data to what its meta declares, so that check stands for the rows themselves.
        for key, width in ((member.state_key, train.state_dim), (member.action_key, train.action_dim)):
            if width != train.meta.width(key):
                raise UserError(f"{root}: '{key}' rows are {width} wide but meta/info.json declares {train.meta.width(key)}.")
        trains.append(train)
        vals.append(make_dataset(cfg, member, root, val_eps, video, files) if val_eps else None)
    member_stats = [t.stats for t in trains]

    if mixture:
        stats = mixture_stats(member_stats)
        mode = mode_of(cfg.policy.type)
        for own, datasets in zip(member_stats, zip(trains, vals)):
            for ds in (d for d in datasets if d is not None):
                ds.map_numbers(lambda x, own=own: into_policy_space(x, own["state"], stats["state"], mode),
                               lambda x, own=own: into_policy_space(x, own["action"], stats["action"], mode))
        train_ds = MixtureDataset(trains)
        val_ds = MixtureDataset([v for v in vals if v is not None]) if any(v is not None for v in vals) else None
        sampler = MixtureSampler([len(t) for t in trains], [m.weight for m in members], seed=cfg.seed, rank=rank,
                                 world_size=world_size)
    else:
        stats, train_ds, val_ds = member_stats[0], trains[0], vals[0]
        sampler = ResumableSampler(len(train_ds), seed=cfg.seed, rank=rank, world_size=world_size, shuffle=True)

    micro = cfg.per_device_batch_size or cfg.batch_size
    pin = torch.cuda.is_available()
    stream = BatchStream(train_ds, sampler, micro, accumulation=cfg.gradient_accumulation_steps,
                         num_workers=cfg.dataset.num_workers, pin_memory=pin)
    val_loader = None
    if val_ds is not None:
        val_sampler = ResumableSampler(len(val_ds), seed=cfg.seed, rank=rank, world_size=world_size, shuffle=False)
        if len(val_sampler) > 0:
            # Workers 0: validation is occasional, and idle persistent workers would only hold memory.
            val_loader = DataLoader(val_ds, batch_size=micro, sampler=val_sampler, num_workers=0, pin_memory=pin, collate_fn=stream.collate,
                                    generator=torch.Generator().manual_seed(cfg.seed))  # keeps the global RNG untouched
    return TrainData(stream=stream, val_loader=val_loader, stats=stats, state_dim=len(stats["state"]["mean"]),
                     action_dim=len(stats["action"]["mean"]), train_dataset=train_ds, val_dataset=val_ds,
                     names=[m.label for m in members], weights=[m.weight for m in members], member_stats=member_stats,
                     revisions=revisions(members, roots), fingerprints=fingerprints(members, roots, sources),
                     remote=any(files is not LOCAL for files in sources))
