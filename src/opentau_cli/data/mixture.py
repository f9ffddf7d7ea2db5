"""Weighted mixtures of LeRobot datasets (docs/ARCHITECTURE.md, "Data order" and "Normalization statistics").

Order. A mixture epoch is a fixed number of draws: as many as the members have training frames together. Member k
gets round(draws * weight_k / sum of weights) of them (largest remainder, so the shares are exact every epoch); which
draw goes to which member is a permutation per (seed, epoch), and each member's draws walk through permutations of its
own frames per (seed, epoch, member, pass), so a member drawn more often than it has frames goes through all of them
before repeating one. That global order is split across ranks exactly like a single dataset's (rank r takes every
world-size-th position, the remainder dropped), so after b batches the ranks together have drawn the first
b x batch x world_size positions of the epoch, and the samples drawn from each member follow from the position alone.

Statistics. The policy holds one set of statistics; a mixture has one per member. The policy is given the first
member's (widened to the widest member with the identity values), and every other member's state and actions are
carried into that space as they are loaded: normalizing them with the policy's statistics then gives exactly what
normalizing with the member's own gives. Narrower members are padded with what normalizes to 0.
"""

from __future__ import annotations

import numpy as np
import torch

from opentau_cli.data.normalization import IDENTITY, STATS, normalize, unnormalize


def widen(stats: dict, width: int) -> dict:
    """Per-feature statistics padded with the identity values to `width` dims."""
    out = {}
    for stat in STATS:
        values = list(stats[stat])
        out[stat] = values + [IDENTITY[stat]] * (width - len(values))
    return out


def _arrays(stats: dict) -> dict[str, np.ndarray]:
    return {stat: np.asarray(stats[stat], dtype=np.float64) for stat in STATS}


def mixture_stats(member_stats: list[dict]) -> dict:
    """The statistics the policy gets for a mixture: the first member's, widened to the widest member."""
    out = {}
    for feature in ("state", "action"):
        width = max(len(s[feature]["mean"]) for s in member_stats)
        out[feature] = widen(member_stats[0][feature], width)
    return out


def select_member(cfg, name: str | None):
    """The dataset of a config (a run's mixture, or its one dataset) that `--dataset NAME` picks (default: the
    first); another name is refused naming the datasets."""
    from opentau_cli.errors import UserError

    members = cfg.dataset.members()
    labels = [m.label for m in members]
    if name is not None and name not in labels:
        raise UserError(f"--dataset {name}: no dataset of that name; the datasets are {', '.join(labels)}.")
    return members[labels.index(name) if name is not None else 0]


def member_statistics(state: dict, member) -> dict:
    """A mixture member's own statistics (its widths) as training_state.json records them: what serves its robot."""
    return next(d["stats"] for d in state["datasets"] if d["name"] == member.label)


def mixture_changes(saved: list[dict] | None, now: list[dict] | None) -> list[str]:
    """What differs between a checkpoint's dataset.mixture and a launch's (both as train_config.json holds them)."""
    from opentau_cli.config.model import MixtureMember

    if saved == now:
        return []
    if saved is None or now is None:
        sizes = ["none" if members is None else f"{len(members)} datasets" for members in (saved, now)]
        return [f"dataset.mixture: checkpoint {sizes[0]}, now {sizes[1]}"]
    labels = [[MixtureMember.model_validate(m).label for m in members] for members in (saved, now)]
    if labels[0] != labels[1]:
        return [f"dataset.mixture datasets: checkpoint {', '.join(labels[0])}, now {', '.join(labels[1])}"]
    return [f"dataset.mixture[{i}] ({label}).{key}: checkpoint {old.get(key)!r}, now {new.get(key)!r}"
            for i, (label, old, new) in enumerate(zip(labels[0], saved, now))
            # A Hub member's revision is data/hub.py's resume check to decide (pinned, or changed when told).
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key) and key != "revision"]


def into_policy_space(values: np.ndarray, own: dict, target: dict, mode: str) -> np.ndarray:
    """A member's (frames, w) values -> (frames, W) values that the policy, normalizing with `target` (W wide),
    sees exactly as normalized with the member's `own` statistics; dims past w normalize to 0."""
    width = len(target["mean"])
    own_arrays, target_arrays = _arrays(own), _arrays(target)
    out = np.empty((values.shape[0], width), dtype=np.float64)
    out[:, :] = unnormalize(np.zeros(width), target_arrays, mode)
    out[:, : values.shape[1]] = unnormalize(normalize(values.astype(np.float64), own_arrays, mode), target_arrays, mode)
    return out.astype(np.float32)


def draw_counts(weights: list[float], draws: int) -> np.ndarray:
    """Draws per member in one epoch: proportional to the weights, rounded by largest remainder (sums to `draws`)."""
    share = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * draws
    counts = np.floor(share).astype(np.int64)
    short = draws - int(counts.sum())
    counts[np.argsort(-(share - counts), kind="stable")[:short]] += 1
    return counts


class MixtureSampler(torch.utils.data.Sampler):
    """The global order of a mixture epoch (see the module doc), split across ranks like `ResumableSampler`.

    Indices are positions in the members' concatenation (member k's frames start at offsets[k]).
    """

    def __init__(self, sizes: list[int], weights: list[float], *, seed: int, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.sizes = [int(n) for n in sizes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_samples = int(sum(self.sizes))
        self.counts = draw_counts(weights, self.num_samples)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.world_size

    @property
    def num_datasets(self) -> int:
        return len(self.sizes)

    def global_order(self, epoch: int | None = None) -> np.ndarray:
        """Every draw of the epoch, in order (global indices); the same on every rank and every world size."""
        epoch = self.epoch if epoch is None else epoch
        members = np.random.default_rng([self.seed, epoch]).permutation(np.repeat(np.arange(self.num_datasets), self.counts))
        order = np.empty(self.num_samples, dtype=np.int64)
        for k, (size, count) in enumerate(zip(self.sizes, self.counts)):
            passes = [np.random.default_rng([self.seed, epoch, k, p]).permutation(size) for p in range(-(-int(count) // size))]
            order[members == k] = self.offsets[k] + (np.concatenate(passes)[:count] if passes else np.empty(0, np.int64))
        return order

    def indices(self) -> list[int]:
        used = len(self) * self.world_size
        return self.global_order()[:used][self.rank :: self.world_size].tolist()

    def __iter__(self):
        return iter(self.indices())

    def drawn(self, epoch: int, positions: int) -> np.ndarray:
        """Samples of each member among the first `positions` draws of `epoch`."""
        member = np.searchsorted(self.offsets[1:], self.global_order(epoch)[:positions], side="right")
        return np.bincount(member, minlength=self.num_datasets)


class MixtureDataset(torch.utils.data.Dataset):
    """The members one after the other: index i is frame i - offsets[k] of member k.

    Each sample carries its member's own widths (`state_dim`, `action_dim`: docs/ARCHITECTURE.md, "Batch format"),
    so that the policy bins only the member's real state dims into the prompt and trains only its real action dims,
    as when the member is served on its own.
    """

    def __init__(self, members: list):
        self.members = members
        self.offsets = np.concatenate([[0], np.cumsum([len(m) for m in members])]).astype(np.int64)
        # A member's `stats` are of its own values (its rows may have been widened into the policy's space).
        self.widths = [(len(m.stats["state"]["mean"]), len(m.stats["action"]["mean"])) for m in members]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def member_of(self, idx: int) -> int:
        return int(np.searchsorted(self.offsets[1:], idx, side="right"))

    def __getitem__(self, idx: int) -> dict:
        k = self.member_of(int(idx))
        state_dim, action_dim = self.widths[k]
        return {**self.members[k][int(idx) - int(self.offsets[k])],
                "state_dim": torch.tensor(state_dim, dtype=torch.int64), "action_dim": torch.tensor(action_dim, dtype=torch.int64)}
