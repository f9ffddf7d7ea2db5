"""The deterministic, rank-aware sampler and the resumable endless batch stream."""

from __future__ import annotations

import re

import numpy as np
import torch
from torch.utils.data import DataLoader

from opentau_cli.errors import RunError, UserError


class ResumableSampler(torch.utils.data.Sampler):
    """Sample order = f(seed, epoch); each rank takes every world_size-th index of it.

    The remainder that does not divide by world_size is dropped so every rank has the same number of samples
    (collectives never wait on a rank that ran out). Which samples are dropped changes with the epoch.
    """

    def __init__(self, num_samples: int, *, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.num_samples, self.seed, self.rank, self.world_size, self.shuffle = num_samples, seed, rank, world_size, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.world_size

    def indices(self) -> list[int]:
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        used = len(self) * self.world_size
        return order[:used][self.rank :: self.world_size].tolist()

    def __iter__(self):
        return iter(self.indices())

    num_datasets = 1

    def drawn(self, epoch: int, positions: int) -> np.ndarray:
        """Samples of each dataset among the first `positions` of `epoch`'s order (one dataset: all of them)."""
        return np.array([positions], dtype=np.int64)


class _EpochBatches:
    """The batch sampler the DataLoader iterates: one epoch's batches from a starting batch on.

    It lives in the main process (workers only receive indices), so BatchStream can move it between epochs
    while persistent workers stay alive.
    """

    def __init__(self, sampler: ResumableSampler, batch_size: int, batches_per_epoch: int):
        self.sampler, self.batch_size, self.batches_per_epoch = sampler, batch_size, batches_per_epoch
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        idx = self.sampler.indices()
        for b in range(self.start, self.batches_per_epoch):
            yield idx[b * self.batch_size : (b + 1) * self.batch_size]


def _plain_error(e: Exception) -> Exception:
    """An error of ours raised in a DataLoader worker (UserError, data/remote.py's DataUnavailable) comes back with the
    worker's traceback as its text; keep the last line."""
    text = str(e)
    m = re.findall(rf"{type(e).__name__}: (.*)", text)
    return type(e)(m[-1].strip()) if m else e


def collate(samples: list[dict]) -> dict:
    """Stack samples into a batch with numpy: single-threaded, so a busy trainer's intra-op threads are not woken
    (with num_workers=0, torch.stack of 224px images measured 58 ms a batch on a loaded 2-core machine, np.stack ~2 ms)."""
    out = {}
    for key, first in samples[0].items():
        if isinstance(first, torch.Tensor):
            out[key] = torch.from_numpy(np.stack([s[key].numpy() for s in samples]))
        else:
            out[key] = [s[key] for s in samples]
    return out


class PromptCollate:
    """`collate`, then the prompt's token ids (`input_ids`, `text_valid`) by the policy's rule when one is given
    (policies/pi05/tokenization.py PromptTokenizer): as the DataLoader's collate_fn it runs in the data workers, so
    the training step neither tokenizes nor reads the state back from the device (docs/ARCHITECTURE.md, "Batch format")."""

    def __init__(self, prompt=None):
        self.prompt = prompt

    def __call__(self, samples: list[dict]) -> dict:
        batch = collate(samples)
        if self.prompt is not None:
            batch.update(self.prompt.batch_tokens(batch))
        return batch


def epoch_steps(num_samples: int, global_batch: int) -> int:
    """Optimizer steps in one epoch: the epoch's usable length is `num_samples` rounded down to a multiple of the
    global batch (per-device batch x processes x accumulation), so two launches with the same global batch split
    every epoch at the same positions whatever their topology (docs/ARCHITECTURE.md, "Data order")."""
    return num_samples // global_batch


class BatchStream:
    """Endless batches across epochs; `state_dict()` counts batches handed to the caller (not prefetched ones).

    `accumulation` micro-batches of `batch_size` per rank make one optimizer step; an epoch holds whole steps only.
    """

    def __init__(self, dataset, sampler: ResumableSampler, batch_size: int, *, accumulation: int = 1, num_workers: int = 0,
                 pin_memory: bool = False, start_epoch: int = 0, start_batch: int = 0):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.global_micro_batch = batch_size * sampler.world_size
        self.batches_per_epoch = epoch_steps(sampler.num_samples, self.global_micro_batch * accumulation) * accumulation
        if self.batches_per_epoch == 0:
            raise UserError(
                f"one rank's share of the data ({len(sampler)} samples) is smaller than the batch size ({batch_size}"
                + (f" x {accumulation} accumulation steps" if accumulation > 1 else "")
                + "): use a smaller batch, fewer processes or more episodes."
            )
        self._batches = _EpochBatches(sampler, batch_size, self.batches_per_epoch)
        self.collate = PromptCollate()
        self._loader = DataLoader(
            dataset,
            batch_sampler=self._batches,
            collate_fn=self.collate,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=num_workers > 0,
            prefetch_factor=2 if num_workers > 0 else None,
            # Each new iterator draws a worker base seed; from a generator of our own, not the global torch RNG,
            # so starting an epoch or resuming does not shift the model's random stream.
            generator=torch.Generator().manual_seed(sampler.seed),
        )
        self._it = None
        self._drawn_in_epoch: dict[int, np.ndarray] = {}  # completed epochs' draws per dataset
        self.load_state_dict({"epoch": start_epoch, "batch": start_batch})

    def state_dict(self) -> dict:
        """`position`: samples of the epoch's global order that all ranks together have consumed, the topology-free
        form of `batch` that a launch with another number of processes or batch size resumes from."""
        return {"epoch": self.epoch, "batch": self.batch, "position": self.batch * self.global_micro_batch}

    def samples_per_dataset(self) -> list[int]:
        """Samples drawn from each dataset so far by all ranks together: the first batch x batch_size x world_size
        positions of each epoch's global order (docs/ARCHITECTURE.md, "Data order"), so no collective is needed."""
        per_epoch = self.batches_per_epoch * self.global_micro_batch
        total = np.zeros(self.sampler.num_datasets, dtype=np.int64)
        for epoch in range(self.epoch):
            if epoch not in self._drawn_in_epoch:
                self._drawn_in_epoch[epoch] = self.sampler.drawn(epoch, per_epoch)
            total += self._drawn_in_epoch[epoch]
        total += self.sampler.drawn(self.epoch, self.batch * self.global_micro_batch)
        return [int(n) for n in total]

    def load_state_dict(self, state: dict) -> None:
        """Continue at a saved position; with `position` (any topology's state) at that global sample position."""
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if "position" in state:
            position = int(state["position"])
            if position % self.global_micro_batch:
                raise ValueError(f"data position {position} is not a multiple of this launch's global micro-batch "
                                 f"({self.batch_size} x {self.sampler.world_size} processes)")
            batch = position // self.global_micro_batch
        epoch, batch = epoch + batch // self.batches_per_epoch, batch % self.batches_per_epoch
        self.epoch, self.batch = epoch, batch
        self._batches.epoch, self._batches.start = epoch, batch
        self._it = None  # the next __next__ starts a fresh pass (persistent workers drop what they prefetched)

    def set_prompt_tokenizer(self, prompt) -> None:
        """Tokenize prompts in the workers with `prompt` from the next batch on. Running workers hold a copy of the
        previous one: they are stopped, and the stream continues at its position with new ones."""
        self.collate.prompt = prompt
        if self._it is not None or getattr(self._loader, "_iterator", None) is not None:
            self.close()
            self.load_state_dict(self.state_dict())

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.batch >= self.batches_per_epoch:
            self.load_state_dict({"epoch": self.epoch + 1, "batch": 0})
        if self._it is None:
            self._it = iter(self._loader)
        try:
            batch = next(self._it)
        except StopIteration:  # only if the epoch ended early; move on as the counters say
            self.load_state_dict({"epoch": self.epoch + 1, "batch": 0})
            self._it = iter(self._loader)
            batch = next(self._it)
        except (UserError, RunError) as e:
            raise _plain_error(e) from None
        batch["sample_key"] = self.sample_keys(self.epoch, self.batch, len(batch["state"]))
        self.batch += 1
        return batch

    def sample_keys(self, epoch: int, batch: int, size: int) -> torch.Tensor:
        """(epoch, position in the epoch's global order) of each sample of this rank's `batch`: rank r's k-th sample
        of an epoch is global position k x world_size + r (ResumableSampler), the same on any topology."""
        local = batch * self.batch_size + torch.arange(size, dtype=torch.int64)
        return torch.stack([torch.full_like(local, epoch), local * self.sampler.world_size + self.sampler.rank], dim=1)

    def close(self) -> None:
        """Stop worker processes now rather than at garbage collection. A worker already stopped by a signal (the
        launcher stops every rank's process group when one rank fails) is no error of closing: the rank's own error,
        if it has one, stays the one it reports."""
        it, self._it = self._it, None
        iterators = [it, getattr(self._loader, "_iterator", None)]
        self._loader._iterator = None
        for iterator in iterators:
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                try:
                    iterator._shutdown_workers()
                except RuntimeError as e:
                    if "is killed by signal" not in str(e):
                        raise
