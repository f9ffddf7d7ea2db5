"""Training batches leave the data workers with uint8 images and the prompt's token ids (docs/ARCHITECTURE.md,
"Batch format"): the policy's prepared inputs are those of the former float32 batch tokenized in the forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import EXAMPLES
from opentau_cli.config.load import load_config
from opentau_cli.data import build_data, write_synth
from opentau_cli.policies import build_policy

pytestmark = [pytest.mark.full, pytest.mark.timeout(300)]  # a hung data worker fails the test instead of stalling CI

TINY = str(EXAMPLES / "pi05_tiny_config.json")


@pytest.fixture(scope="module")
def worker_batch(tmp_path_factory):
    """A policy built with the run's statistics, and the first training batch a real data worker made with its
    prompt rule (as train/trainer.py wires them)."""
    root = write_synth(tmp_path_factory.mktemp("synth") / "ds", episodes=3, steps_per_episode=8, cameras=1, seed=5)
    cfg = load_config(TINY, [f"--dataset.root={root}", "--dataset.num_workers=1", "--batch_size=4",
                             "--validation.val_split=0"], environ={})
    data = build_data(cfg)
    policy = build_policy(cfg.policy, data.stats)
    data.set_prompt_tokenizer(policy.prompt_tokenizer())
    try:
        batch = next(data.stream)
    finally:
        data.stream.close()
    return policy, data.stats, batch


def openpi_bins(normalized: np.ndarray) -> np.ndarray:
    """openpi's state discretization: np.digitize over 256 uniform bins of [-1, 1]."""
    return np.digitize(normalized, np.linspace(-1, 1, 256 + 1)[:-1]) - 1


def test_a_worker_batch_holds_uint8_images_and_the_ids_of_the_state_normalized_by_hand(worker_batch):
    policy, stats, batch = worker_batch
    assert batch["images"].dtype == torch.uint8  # a quarter of float32's bytes through queues and host-device copies
    assert batch["images"].nbytes * 4 == batch["images"].numel() * torch.float32.itemsize
    q01, q99 = (np.asarray(stats["state"][k], dtype=np.float32) for k in ("q01", "q99"))
    length = policy.cfg.tokenizer_max_length
    for i, (task, raw) in enumerate(zip(batch["task"], batch["state"].numpy())):
        normalized = (raw - q01) / (q99 - q01 + np.float32(1e-6)) * np.float32(2) - np.float32(1)  # quantile, fp32
        ids = policy.tokenizer.encode_prompt(task, tuple(int(b) for b in openpi_bins(normalized)), length)
        assert batch["input_ids"][i].tolist() == ids + [policy.tokenizer.pad_id] * (length - len(ids))
        assert batch["text_valid"][i].tolist() == [True] * len(ids) + [False] * (length - len(ids))
    assert batch["input_ids"].dtype == torch.int64 and batch["text_valid"].dtype == torch.bool


def test_the_policy_prepares_a_worker_batch_exactly_as_the_former_float32_batch_tokenized_in_the_forward(worker_batch):
    policy, _, batch = worker_batch
    former = {k: v for k, v in batch.items() if k not in ("input_ids", "text_valid")}
    former["images"] = torch.from_numpy(batch["images"].numpy().astype(np.float32) * np.float32(1 / 255))
    for with_actions in (True, False):
        now, then = policy._prepare(batch, with_actions), policy._prepare(former, with_actions)
        assert now.keys() == then.keys()
        for key in now:
            same = torch.equal(now[key], then[key]) if isinstance(now[key], torch.Tensor) else now[key] == then[key]
            assert same, key


def test_a_new_prompt_rule_mid_stream_reaches_the_workers_and_the_stream_continues_where_it_was(tmp_path):
    root = write_synth(tmp_path / "ds", episodes=3, steps_per_episode=8, cameras=1, seed=5)
    cfg = load_config(TINY, [f"--dataset.root={root}", "--dataset.num_workers=1", "--batch_size=4",
                             "--validation.val_split=0"], environ={})
    uninterrupted, data = build_data(cfg), build_data(cfg)
    policy = build_policy(cfg.policy, data.stats)
    shifted = {**data.stats, "state": {**data.stats["state"], "q99": [v + 1.0 for v in data.stats["state"]["q99"]]}}
    restored = build_policy(cfg.policy, shifted)  # as a checkpoint bringing other statistics
    try:
        expected = [next(uninterrupted.stream) for _ in range(3)]
        data.set_prompt_tokenizer(policy.prompt_tokenizer())
        next(data.stream), next(data.stream)
        data.set_prompt_tokenizer(restored.prompt_tokenizer())
        third = next(data.stream)
    finally:
        uninterrupted.stream.close(), data.stream.close()
    assert torch.equal(third["state"], expected[2]["state"]) and torch.equal(third["sample_key"], expected[2]["sample_key"])
    assert torch.equal(third["input_ids"], restored.prompt_tokenizer().batch_tokens(third)["input_ids"])
    assert not torch.equal(third["input_ids"], policy.prompt_tokenizer().batch_tokens(third)["input_ids"])
