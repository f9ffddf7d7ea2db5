"""The deterministic rank-aware sampler, the resumable BatchStream, and the whole-episode validation split."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch

from opentau_cli.data import BatchStream, LeRobotDataset, ResumableSampler, split_episodes, write_synth

pytestmark = [pytest.mark.quick, pytest.mark.timeout(300)]  # a hung data worker fails the test instead of stalling CI


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = write_synth(tmp_path_factory.mktemp("synth") / "ds", episodes=5, steps_per_episode=9, cameras=1, seed=1)
    return LeRobotDataset(root, chunk_size=4, image_resolution=(16, 16), num_cameras=1)


def frames(batch) -> list[tuple]:
    """Identify each sample of a batch by its state (unique per frame in the synth data)."""
    return [tuple(s.tolist()) for s in batch["state"]]


def test_order_is_a_function_of_seed_and_epoch():
    a, b = ResumableSampler(50, seed=3), ResumableSampler(50, seed=3)
    assert list(a) == list(b) and sorted(a) == list(range(50))
    a.set_epoch(1)
    assert list(a) != list(b) and sorted(a) == list(range(50))
    assert list(ResumableSampler(50, seed=4)) != list(b)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rank_shards_are_disjoint_equal_and_cover_the_epoch(world_size):
    n = 103
    shards = [list(ResumableSampler(n, seed=7, rank=r, world_size=world_size)) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == n // world_size
    seen = [i for s in shards for i in s]
    assert len(seen) == len(set(seen)) == n - n % world_size
    assert set(ResumableSampler(n, seed=7, world_size=1).indices()[: len(seen)]) == set(seen)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restored_position_reproduces_the_remaining_batches_exactly(dataset, num_workers):
    def stream(**kw):
        sampler = ResumableSampler(len(dataset), seed=11, rank=1, world_size=2)
        return BatchStream(dataset, sampler, 4, num_workers=num_workers, pin_memory=False, **kw)

    full = stream()
    per_epoch = full.batches_per_epoch
    assert per_epoch == (45 // 2) // 4 == 5
    reference = [frames(next(full)) for _ in range(13)]  # crosses two epoch boundaries
    full.close()

    first = stream()
    for _ in range(7):
        next(first)
    saved = first.state_dict()
    assert saved == {"epoch": 1, "batch": 2, "position": 16}  # counts delivered batches, not what workers prefetched
    first.close()

    resumed = stream()
    resumed.load_state_dict(saved)
    rest = [frames(next(resumed)) for _ in range(6)]
    resumed.close()
    assert rest == reference[7:]
    started = stream(start_epoch=1, start_batch=2)
    assert frames(next(started)) == reference[7]
    # Rewinding a stream whose workers already prefetched ahead drops what they prefetched.
    started.load_state_dict({"epoch": 0, "batch": 1})
    assert [frames(next(started)) for _ in range(2)] == reference[1:3]
    started.close()


class SlowOnceFlagged(torch.utils.data.Dataset):
    """The dataset, each item taking 5 s once `flag` exists: a data worker busy reading when its stream closes."""

    def __init__(self, dataset, flag):
        self.dataset, self.flag = dataset, flag

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        if self.flag.exists():
            time.sleep(5)
        return self.dataset[i]


def test_closing_a_stream_whose_data_worker_a_signal_stopped_raises_nothing(dataset, tmp_path):
    # The launcher stops every rank's process group (data workers included) when one rank fails: a rank that is
    # closing its stream meanwhile must report its own error, not its worker's end.
    flag = tmp_path / "slow"
    s = BatchStream(SlowOnceFlagged(dataset, flag), ResumableSampler(len(dataset), seed=2), 3, num_workers=1)
    next(s)
    flag.touch()
    next(s), next(s)  # batches the worker prefetched before the flag; it now reads slowly
    worker = s._loader._iterator._workers[0]
    # From a process that is not this one's child (its end would be a SIGCHLD of its own), while close() waits for the
    # worker: a worker exits quietly on its own parent's SIGTERM.
    subprocess.run(["sh", "-c", f"(sleep 1; kill -TERM {worker.pid}) >/dev/null 2>&1 &"], check=True)
    s.close()
    assert worker.exitcode == -signal.SIGTERM
    assert s._loader._iterator is None


def test_each_epoch_delivers_a_new_order_of_the_same_samples(dataset):
    s = BatchStream(dataset, ResumableSampler(len(dataset), seed=2), 5, num_workers=0)
    epochs = [[f for _ in range(s.batches_per_epoch) for f in frames(next(s))] for _ in range(2)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])
    assert len(set(epochs[0])) == 45


def test_val_split_holds_out_whole_episodes_the_same_way_every_time(dataset):
    train, val = split_episodes(dataset.root, 0.4, seed=1000)
    assert len(val) == 2 and sorted(train + val) == [0, 1, 2, 3, 4] and not set(train) & set(val)
    assert split_episodes(dataset.root, 0.4, seed=1000) == (train, val)  # what every rank / a resume computes
    assert split_episodes(dataset.root, 0.0, seed=1000) == ([0, 1, 2, 3, 4], [])
    held_out = LeRobotDataset(dataset.root, val, chunk_size=4, image_resolution=(16, 16), num_cameras=1)
    assert len(held_out) == 2 * 9 and set(held_out._frame_ep.tolist()) == set(val)


def test_stream_batches_are_collated_in_the_batch_format(dataset):
    s = BatchStream(dataset, ResumableSampler(len(dataset), seed=0), 3, num_workers=0)
    b = next(s)
    assert b["images"].shape == (3, 1, 3, 16, 16) and b["image_masks"].dtype == torch.bool
    assert b["actions"].shape == (3, 4, 2) and b["action_is_pad"].shape == (3, 4) and len(b["task"]) == 3


def test_pulling_batches_and_starting_epochs_leaves_the_global_torch_rng_alone(dataset):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    s = BatchStream(dataset, ResumableSampler(len(dataset), seed=2), 5, num_workers=0)
    for _ in range(s.batches_per_epoch + 2):  # crosses an epoch: a new DataLoader iterator
        next(s)
    s.load_state_dict({"epoch": 0, "batch": 3})
    next(s)
    assert torch.equal(torch.rand(3), expected)


def test_build_data_gives_every_rank_the_same_held_out_episodes_and_disjoint_shards(dataset, isolated_env):
    from opentau_cli.config.load import load_config
    from opentau_cli.data import build_data

    cfg = load_config(None, [f"--dataset.root={dataset.root}", "--dataset.num_workers=0", "--batch_size=2", "--validation.val_split=0.4",
                             "--policy.chunk_size=4", "--policy.n_action_steps=4", "--policy.image_resolution=[16,16]"])
    ranks = [build_data(cfg, rank, 2) for rank in range(2)]
    assert ranks[0].val_dataset.episodes == ranks[1].val_dataset.episodes and len(ranks[0].val_dataset.episodes) == 2
    assert not set(ranks[0].train_dataset.episodes) & set(ranks[0].val_dataset.episodes)
    assert ranks[0].stats == ranks[1].stats and ranks[0].stream.batches_per_epoch == ranks[1].stream.batches_per_epoch
    val = [[f for b in r.val_loader for f in frames(b)] for r in ranks]
    assert len(val[0]) == len(val[1]) == 9 and not set(val[0]) & set(val[1])
    train = [[f for _ in range(r.stream.batches_per_epoch) for f in frames(next(r.stream))] for r in ranks]
    # 27 train frames: 13 per rank (1 dropped), 6 full batches of 2 each.
    assert ranks[0].stream.batches_per_epoch == 6
    assert not set(train[0]) & set(train[1]) and len(set(train[0]) | set(train[1])) == 24
