"""Weighted mixtures of LeRobot datasets: the draw order, exact resumption, per-dataset statistics and validation."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from conftest import EXAMPLES
from opentau_cli.config.load import load_config
from opentau_cli.data import BatchStream, LeRobotDataset, ResumableSampler, build_data, write_synth
from opentau_cli.data.mixture import MixtureSampler, draw_counts
from opentau_cli.data.normalization import IDENTITY, normalize, unnormalize

pytestmark = [pytest.mark.full, pytest.mark.timeout(300)]  # a hung data worker fails the test instead of stalling CI

TINY = str(EXAMPLES / "pi05_tiny_config.json")
STATE_SCALE = 50.0


def widen_state(root, width: int) -> None:
    """Make a v2.1 synth dataset's state `width` wide and STATE_SCALE times larger (another robot), with no stats in
    meta/ (they are then computed from the data)."""
    for path in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        state = np.asarray(table.column("observation.state").combine_chunks().flatten().to_numpy(), np.float32).reshape(len(table), -1)
        wide = np.concatenate([state, state[:, :1] * np.arange(1, width - state.shape[1] + 1)], axis=1) * STATE_SCALE
        column = pa.FixedSizeListArray.from_arrays(pa.array(wide.reshape(-1)), width)
        pq.write_table(table.set_column(table.schema.get_field_index("observation.state"), "observation.state", column), path)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.state"]["shape"] = [width]
    info_path.write_text(json.dumps(info))
    (root / "meta" / "stats.json").unlink()
    (root / "meta" / "episodes_stats.jsonl").unlink()


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """A v2.1 dataset of 4-dim state (PNG cameras) and a v3.0 one (mp4 cameras under other names), widened to 6."""
    tmp = tmp_path_factory.mktemp("mixture")
    a = write_synth(tmp / "a", episodes=5, steps_per_episode=6, cameras=1, seed=1)
    b = write_synth(tmp / "b_v21", episodes=4, steps_per_episode=5, cameras=2, seed=2)
    widen_state(b, 6)
    c = write_synth(tmp / "c", episodes=3, steps_per_episode=7, cameras=2, seed=3, fmt="v3.0", video=True)
    return a, b, c


def mixture_args(*members: dict, extra=()) -> list[str]:
    return [f"--dataset.mixture={json.dumps(list(members))}", "--dataset.num_cameras=2", "--validation.val_split=0.25",
            "--batch_size=4", *extra]


def config(members, *, weights=(3, 1), extra=()):
    a, b, _ = members
    return load_config(TINY, mixture_args({"root": str(a), "weight": weights[0]},
                                          {"root": str(b), "weight": weights[1], "name": "wide",
                                           "camera_keys": {"observation.images.front": "camera0"}}, extra=extra), environ={})


def test_draws_per_epoch_follow_the_weights_exactly_and_sum_to_the_frames():
    assert draw_counts([3, 1], 28).tolist() == [21, 7]
    assert draw_counts([1, 1, 1], 10).tolist() == [4, 3, 3]  # largest remainder, ties to the first
    sampler = MixtureSampler([18, 10], [3, 1], seed=5)
    for epoch in range(3):
        order = sampler.global_order(epoch)
        assert len(order) == 28 and np.bincount(order >= 18).tolist() == [21, 7]


def test_the_order_is_a_function_of_seed_and_epoch_and_the_same_on_every_world_size():
    a, b = MixtureSampler([18, 10], [3, 1], seed=5), MixtureSampler([18, 10], [3, 1], seed=5)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    assert list(MixtureSampler([18, 10], [3, 1], seed=6)) != list(a)
    order = a.global_order(0)
    for world in (2, 3):
        shards = [MixtureSampler([18, 10], [3, 1], seed=5, rank=r, world_size=world).indices() for r in range(world)]
        used = len(shards[0]) * world
        # Rank r holds positions r, r + world, ... of the one global order: together the first `used` of them.
        assert [shards[p % world][p // world] for p in range(used)] == order[:used].tolist()


def test_a_member_drawn_more_often_than_it_has_frames_goes_through_all_of_them_before_repeating():
    sampler = MixtureSampler([4, 30], [1, 1], seed=0)  # member 0 gets 17 draws from 4 frames
    draws = [int(i) for i in sampler.global_order(0) if i < 4]
    assert len(draws) == 17
    for start in range(0, 16, 4):
        assert sorted(draws[start:start + 4]) == [0, 1, 2, 3]
    big = [int(i) - 4 for i in sampler.global_order(0) if i >= 4]
    assert len(big) == 17 == len(set(big))  # under-drawn: no repeats


def test_samples_per_dataset_follow_from_the_stream_position_and_a_resumed_stream_continues_exactly(members):
    cfg = config(members)
    data = build_data(cfg, rank=1, world_size=2)
    stream = data.stream
    per_epoch = stream.batches_per_epoch
    delivered = [next(stream) for _ in range(per_epoch + 2)]  # into the second epoch
    state = stream.state_dict()
    counts = stream.samples_per_dataset()
    # All ranks together drew the first positions of each epoch's global order (2 ranks x batch 4 per batch).
    sampler = stream.sampler
    expected = sampler.drawn(0, per_epoch * 4 * 2) + sampler.drawn(1, 2 * 4 * 2)
    assert counts == expected.tolist() and sum(counts) == (per_epoch + 2) * 4 * 2
    after = [next(stream) for _ in range(3)]
    resumed = build_data(cfg, rank=1, world_size=2).stream
    resumed.load_state_dict(state)
    assert resumed.samples_per_dataset() == counts
    again = [next(resumed) for _ in range(3)]
    for x, y in zip(after, again):
        assert torch.equal(x["state"], y["state"]) and torch.equal(x["images"], y["images"]) and x["task"] == y["task"]
    assert not torch.equal(delivered[0]["state"], after[0]["state"])
    stream.close()
    resumed.close()


def test_each_member_reaches_the_policy_normalized_with_its_own_statistics_and_padded(members):
    from opentau_cli.data.normalization import normalize as policy_normalize

    cfg = config(members)
    data = build_data(cfg)
    a, b, _ = members
    assert data.names == ["a", "wide"] and data.weights == [3.0, 1.0]
    assert len(data.stats["state"]["q01"]) == 6 and len(data.stats["action"]["q01"]) == 2  # the widest member
    assert data.stats["state"]["q01"][:4] == data.member_stats[0]["state"]["q01"]
    assert data.stats["state"]["q01"][4:] == [IDENTITY["q01"]] * 2
    policy_stats = {k: torch.tensor(v, dtype=torch.float32) for k, v in data.stats["state"].items()}
    mixture = data.train_dataset
    for k, root in enumerate((a, b)):
        own = {s: np.asarray(v) for s, v in data.member_stats[k]["state"].items()}
        raw = LeRobotDataset(root, mixture.members[k].episodes, chunk_size=10, image_resolution=(32, 32), num_cameras=2)
        for local in (0, len(raw) - 1):
            seen = policy_normalize(mixture[int(mixture.offsets[k]) + local]["state"], policy_stats, "quantile")
            expected = np.zeros(6)
            x = raw[local]["state"].numpy()
            expected[: len(x)] = normalize(x.astype(np.float64), own, "quantile")
            assert np.allclose(seen.numpy(), expected, atol=1e-4), (k, local)
    assert max(abs(v) for v in data.member_stats[1]["state"]["q99"]) > 10  # the wide member really is on another scale


def test_each_members_prompt_holds_its_own_number_of_state_tokens_as_when_it_is_served_alone(members):
    """Training on the mixture and serving one member (export / eval --dataset: its own statistics and rows) build
    the same pi05 prompt: the narrow member's 4 state dims, not the 6 its rows are padded to."""
    import copy

    from opentau_cli.data.build import make_dataset
    from opentau_cli.data.sampler import collate
    from opentau_cli.policies import build_policy
    from opentau_cli.policies.pi05.tokenization import STATE_BINS, ByteTokenizer

    cfg = config(members)
    data = build_data(cfg)
    mixture = data.train_dataset
    trained = build_policy(cfg.policy, data.stats)
    for k, (member, width) in enumerate(zip(cfg.dataset.members(), (4, 6))):
        own = mixture.members[k]
        locals_ = [0, 3, len(own) - 1]
        batch = collate([mixture[int(mixture.offsets[k]) + i] for i in locals_])
        assert batch["state"].shape == (3, 6) and batch["state_dim"].tolist() == [width] * 3
        assert batch["action_dim"].tolist() == [2] * 3
        served = copy.deepcopy(trained)
        served.set_stats(data.member_stats[k])
        alone = make_dataset(cfg, member, own.root, own.episodes)
        alone_batch = collate([alone[i] for i in locals_])
        assert alone_batch["state"].shape == (3, width) and "state_dim" not in alone_batch
        ids = trained._prepare(batch, with_actions=False)["input_ids"]
        assert torch.equal(ids, served._prepare(alone_batch, with_actions=False)["input_ids"]), member.label
        state_tokens = ((ids >= ByteTokenizer.reserved - STATE_BINS) & (ids < ByteTokenizer.reserved)).sum(dim=1)  # its last ids
        assert state_tokens.tolist() == [width] * 3, member.label


def test_data_workers_bin_each_members_state_with_its_own_statistics_and_width(members):
    """The ids a worker makes for a mixture batch are, per sample, the tokenizer's on the member's own raw state
    normalized by hand with the member's own statistics, over its own dims (as when it is served alone)."""
    from opentau_cli.policies import build_policy

    cfg = config(members, extra=["--dataset.num_workers=1"])
    data = build_data(cfg)
    policy = build_policy(cfg.policy, data.stats)
    data.set_prompt_tokenizer(policy.prompt_tokenizer())
    mixture, sampler, length = data.train_dataset, data.stream.sampler, cfg.policy.tokenizer_max_length
    alone = [LeRobotDataset(m.root, m.episodes, chunk_size=10, image_resolution=(32, 32), num_cameras=2) for m in mixture.members]
    seen = set()
    try:
        for _ in range(4):
            batch = next(data.stream)
            for i, (epoch, position) in enumerate(batch["sample_key"].tolist()):
                index = int(sampler.global_order(epoch)[position])
                k = mixture.member_of(index)
                own, state = data.member_stats[k]["state"], alone[k][index - int(mixture.offsets[k])]["state"].numpy()
                q01, q99 = (np.asarray(own[s], dtype=np.float32) for s in ("q01", "q99"))
                normalized = (state - q01) / (q99 - q01 + np.float32(1e-6)) * np.float32(2) - np.float32(1)
                bins = np.digitize(normalized, np.linspace(-1, 1, 257)[:-1]) - 1  # openpi's
                assert len(bins) == (4, 6)[k]
                ids = policy.tokenizer.encode_prompt(batch["task"][i], tuple(int(b) for b in bins), length)
                assert batch["input_ids"][i].tolist() == ids + [policy.tokenizer.pad_id] * (length - len(ids)), (k, position)
                seen.add(k)
    finally:
        data.stream.close()
    assert seen == {0, 1}


def test_one_normalization_serves_the_data_layers_numpy_arrays_and_the_policys_tensors():
    """opentau_cli.data.normalization is the one formula: the data layer calls it on numpy arrays, the policy on tensors."""
    from opentau_cli.data.normalization import MEAN_STD, QUANTILE

    rng = np.random.default_rng(0)
    stats = {"mean": rng.normal(size=5), "std": rng.uniform(0.1, 2, 5), "q01": rng.uniform(-3, -1, 5), "q99": rng.uniform(1, 3, 5)}
    torch_stats = {k: torch.tensor(v) for k, v in stats.items()}
    x = rng.normal(size=(7, 3)) * 3
    for mode in (QUANTILE, MEAN_STD):
        on_arrays = normalize(x, stats, mode)
        assert isinstance(on_arrays, np.ndarray)
        assert np.allclose(on_arrays, normalize(torch.tensor(x), torch_stats, mode).numpy(), rtol=0, atol=1e-12)
        assert np.allclose(unnormalize(on_arrays, stats, mode), x, rtol=0, atol=1e-9)  # the exact inverse on arrays too


def test_v21_and_v30_members_with_their_own_camera_mappings_make_one_batch_format(members):
    a, _, c = members
    cfg = load_config(TINY, mixture_args({"root": str(a)},
                                         {"root": str(c), "camera_keys": {"observation.images.front": "camera1"}, "prompt": "unused"}),
                      environ={})
    data = build_data(cfg)
    batch = next(data.stream)
    assert batch["images"].shape == (4, 2, 3, 32, 32) and batch["state"].shape == (4, 4)
    mixture = data.train_dataset
    first_of_c = mixture[int(mixture.offsets[1])]
    assert first_of_c["image_masks"].tolist() == [False, True] and first_of_c["images"][1].float().std() > 0
    assert mixture[0]["image_masks"].tolist() == [True, False]
    data.stream.close()


def test_validation_holds_out_whole_episodes_of_every_member(members):
    data = build_data(config(members))
    train, val = data.train_dataset, data.val_dataset
    assert [len(m.episodes) for m in val.members] == [1, 1]  # round(0.25 x 5) and round(0.25 x 4)
    for t, v in zip(train.members, val.members):
        assert not set(t.episodes) & set(v.episodes) and t.root == v.root
    assert data.val_loader is not None and len(data.val_loader.sampler) == len(val)


def test_a_single_dataset_root_is_read_as_before(members):
    a, _, _ = members
    cfg = load_config(TINY, [f"--dataset.root={a}", "--validation.val_split=0", "--validation.val_freq=0", "--batch_size=4"], environ={})
    data = build_data(cfg)
    assert isinstance(data.stream.sampler, ResumableSampler) and data.names == ["a"]
    assert data.stats == data.member_stats[0] == data.train_dataset.stats
    reference = BatchStream(LeRobotDataset(a, chunk_size=10, image_resolution=(32, 32), num_cameras=1),
                            ResumableSampler(len(data.train_dataset), seed=cfg.seed), 4)
    assert torch.equal(next(data.stream)["state"], next(reference)["state"])
    assert data.stream.samples_per_dataset() == [4]


def test_dataset_info_of_a_config_describes_each_member_its_weight_and_share(members, tmp_path):
    from opentau_cli.cli.main import app

    a, b, _ = members
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"dataset": {"num_cameras": 2, "mixture": [
        {"root": str(a), "weight": 3}, {"root": str(b), "weight": 1, "name": "wide"}]}, "validation": {"val_split": 0.25}}))
    r = CliRunner().invoke(app, ["dataset", "info", str(path), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["mixture"] and info["draws_per_epoch"] == 4 * 6 + 3 * 5
    rows = {m["name"]: m for m in info["members"]}
    # 39 x 3/4 = 29.25 and 39 x 1/4 = 9.75: the larger remainder takes the last draw.
    assert (rows["a"]["weight"], rows["a"]["draws_per_epoch"], rows["wide"]["draws_per_epoch"]) == (3, 29, 10)
    assert rows["a"]["share"] == pytest.approx(29 / 39) and rows["wide"]["passes_per_epoch"] == pytest.approx(10 / 15)
    assert (rows["wide"]["train_episodes"], rows["wide"]["val_episodes"], rows["wide"]["state"]) == (3, 1, "observation.state (6)")
    text = CliRunner().invoke(app, ["dataset", "info", str(path)]).stdout
    assert "a mixture of 2 datasets" in text and "74.4%" in text and "wide" in text


def test_a_copy_of_a_member_with_another_name_is_a_member_of_its_own(members):
    """Two members may read the same folder (e.g. two episode ranges of one dataset) when their names differ."""
    a, _, _ = members
    cfg = load_config(TINY, mixture_args({"root": str(a), "episodes": [0, 1, 2], "name": "first"},
                                         {"root": str(a), "episodes": [3, 4], "name": "last", "weight": 2},
                                         extra=["--validation.val_split=0", "--validation.val_freq=0"]), environ={})
    data = build_data(cfg)
    assert [m.episodes for m in data.train_dataset.members] == [[0, 1, 2], [3, 4]]
    assert data.stream.sampler.counts.tolist() == [10, 20]


def test_a_mixture_started_from_pretrained_weights_normalizes_with_its_members_statistics(members, tmp_path, monkeypatch):
    """The pretrained checkpoint brings statistics of its own (same widths); the mixture's members were carried into
    the mixture's, so the built policy must hold those."""
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import save_model

    from opentau_cli.config import AccelerateSetup
    from opentau_cli.policies import build_policy
    from opentau_cli.train.trainer import build_trainer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    other = {"state": {s: [v * 7.0 + 1] * 6 for s, v in IDENTITY.items()},
             "action": {s: [v * 3.0 - 2] * 2 for s, v in IDENTITY.items()}}
    cfg = config(members, extra=["--validation.val_split=0", "--validation.val_freq=0"])
    save_model(build_policy(cfg.policy, other), str(tmp_path / "model.safetensors"))
    cfg.policy.pretrained_path = tmp_path / "model.safetensors"
    try:
        trainer = build_trainer(cfg, AccelerateSetup())
        model = trainer.accelerator.unwrap_model(trainer.model)
        for feature in ("state", "action"):
            for stat, values in trainer.data.stats[feature].items():
                held = getattr(model, f"{feature}_{stat}")[: len(values)]
                assert torch.allclose(held, torch.tensor(values, dtype=torch.float32)), (feature, stat)
        trainer.data.stream.close()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_the_changes_between_two_mixtures_are_named_member_and_field():
    from opentau_cli.data.mixture import mixture_changes

    saved = config(("a", "b", None)).dataset.model_dump(mode="json")["mixture"]
    assert mixture_changes(saved, [dict(m) for m in saved]) == []
    reweighted = [dict(saved[0]), {**saved[1], "weight": 2.0, "state_key": "observation.joints"}]
    assert mixture_changes(saved, reweighted) == [
        "dataset.mixture[1] (wide).state_key: checkpoint 'observation.state', now 'observation.joints'",
        "dataset.mixture[1] (wide).weight: checkpoint 1.0, now 2.0"]
    assert mixture_changes(saved, [saved[0], {**saved[1], "root": "elsewhere/b"}]) == [
        "dataset.mixture[1] (wide).root: checkpoint 'b', now 'elsewhere/b'"]
    assert mixture_changes(saved, saved[:1]) == ["dataset.mixture datasets: checkpoint a, wide, now a"]
    assert mixture_changes(saved, None) == ["dataset.mixture: checkpoint 2 datasets, now none"]
    assert mixture_changes(None, saved) == ["dataset.mixture: checkpoint none, now 2 datasets"]
