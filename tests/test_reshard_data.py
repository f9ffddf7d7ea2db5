"""Elastic resume, data side: a run resumed on another number of processes (the global batch kept) consumes exactly
the samples of the uninterrupted run's order, none repeated or skipped (docs/ARCHITECTURE.md, "Data order")."""

from __future__ import annotations

import pytest
import torch

from opentau_cli.data import BatchStream, ResumableSampler
from opentau_cli.data.mixture import MixtureSampler

pytestmark = pytest.mark.full


class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"index": torch.tensor(int(i)), "state": torch.zeros(1)}  # the stream counts a batch by its states


def _streams(n, world, batch, accum, mixture):
    out = []
    for rank in range(world):
        if mixture:
            sampler = MixtureSampler([n // 3, n - n // 3], [1.0, 2.0], seed=5, rank=rank, world_size=world)
        else:
            sampler = ResumableSampler(n, seed=5, rank=rank, world_size=world)
        out.append(BatchStream(Indices(n), sampler, batch, accumulation=accum))
    return out


def _consume(streams, steps, accum) -> list[list[int]]:
    """Per optimizer step: the indices all ranks consumed, rank by rank (as sets per step: order within one step is
    irrelevant to the update)."""
    taken = []
    for _ in range(steps):
        step = []
        for _ in range(accum):
            for s in streams:
                step += next(s)["index"].tolist()
        taken.append(sorted(step))
    return taken


# (samples, processes, per-device batch, accumulation) before -> (processes, per-device batch, accumulation) after,
# each keeping the global batch.
TRANSITIONS = [
    (53, (2, 3, 1), (1, 6, 1)),
    (53, (1, 6, 1), (2, 3, 1)),
    (53, (2, 2, 2), (4, 2, 1)),
    (61, (3, 2, 2), (2, 6, 1)),
    (61, (2, 3, 2), (1, 4, 3)),
    (61, (4, 1, 3), (3, 4, 1)),
]


@pytest.mark.parametrize("mixture", [False, True], ids=["dataset", "mixture"])
@pytest.mark.parametrize("n,before,after", TRANSITIONS)
def test_resharded_stream_continues_the_uninterrupted_order(n, before, after, mixture):
    (w0, b0, a0), (w1, b1, a1) = before, after
    assert w0 * b0 * a0 == w1 * b1 * a1
    steps_per_epoch = n // (w0 * b0 * a0)
    stop, total = steps_per_epoch // 2 + 1, 2 * steps_per_epoch + 3  # resume mid-epoch, run across two boundaries
    reference = _consume(_streams(n, w0, b0, a0, mixture), total, a0)

    first = _streams(n, w0, b0, a0, mixture)
    taken = _consume(first, stop, a0)
    saved = first[0].state_dict()
    assert all(s.state_dict() == saved for s in first)
    resumed = _streams(n, w1, b1, a1, mixture)
    for s in resumed:
        s.load_state_dict(saved)
    taken += _consume(resumed, total - stop, a1)

    assert taken == reference
    epoch = [i for step in reference[:steps_per_epoch] for i in step]
    assert len(set(epoch)) == len(epoch) or mixture  # a mixture may draw a member's frame twice by design


def test_position_is_topology_free():
    streams = _streams(40, 2, 3, 2, mixture=False)
    _consume(streams, 2, 2)
    assert streams[0].state_dict() == {"epoch": 0, "batch": 4, "position": 24}


def test_old_state_without_position_resumes_by_batch():
    s = _streams(40, 2, 3, 1, mixture=False)[1]
    s.load_state_dict({"epoch": 0, "batch": 2})
    assert s.state_dict() == {"epoch": 0, "batch": 2, "position": 12}


def test_epoch_holds_whole_optimizer_steps():
    # 53 samples, global batch 2 x 3 x 2 = 12: 4 steps (48 samples) per epoch, 8 micro-batches per rank.
    assert _streams(53, 2, 3, 2, mixture=False)[0].batches_per_epoch == 8
