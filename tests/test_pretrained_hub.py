"""`policy.pretrained_path` and `policy.tokenizer_path` as Hugging Face repo ids, resolved offline from a cache laid
out exactly as huggingface_hub lays it out (never the network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentau_cli.config.model import PolicyConfig
from opentau_cli.errors import UserError
from opentau_cli.policies import build_policy, load_pretrained
from opentau_cli.policies.hub import check_weights_source, resolve
from opentau_cli.policies.layouts import LEROBOT, Layout
from opentau_cli.store.hub import parse_repo_id
from published import hub_cache, save_word_tokenizer, write_published

pytestmark = pytest.mark.full


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 with an empty cache of this test's own (read by huggingface_hub at import: patched too)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def tiny_cfg(**overrides) -> PolicyConfig:
    base = dict(preset="pi05_tiny", chunk_size=10, n_action_steps=8, max_state_dim=8, max_action_dim=8,
                image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False)
    return PolicyConfig(**{**base, **overrides})


def published_repo(tmp_path: Path, cache: Path, repo_id: str, *, seed: int, revision: str = "main") -> tuple[torch.nn.Module, str]:
    torch.manual_seed(seed)
    policy = build_policy(tiny_cfg())
    folder = write_published(policy, tmp_path / f"upload-{seed}", LEROBOT)
    return policy, hub_cache(cache, repo_id, folder, revision=revision)


def test_repo_ids_are_org_name_with_an_optional_revision():
    assert parse_repo_id("lerobot/pi05_base") == ("lerobot/pi05_base", None)
    assert parse_repo_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_repo_id("org/name@refs/pr/3") == ("org/name", "refs/pr/3")
    for not_a_repo in ("pi05_base", "outputs/train/run/model.safetensors", "org/name@", "org/na--me", "/abs/path"):
        assert parse_repo_id(not_a_repo) is None, not_a_repo


def test_a_repo_id_loads_offline_from_a_cache_laid_out_as_the_hub_client_lays_it(tmp_path, offline_cache):
    from huggingface_hub import hf_hub_download, snapshot_download

    policy, commit = published_repo(tmp_path, offline_cache, "lerobot/pi05_tiny_test", seed=1)
    snapshot = offline_cache / "models--lerobot--pi05_tiny_test" / "snapshots" / commit
    # The hub client itself resolves this cache: it is laid out as its downloads leave it.
    assert Path(snapshot_download("lerobot/pi05_tiny_test", local_files_only=True)) == snapshot
    weights = Path(hf_hub_download("lerobot/pi05_tiny_test", "model.safetensors", local_files_only=True))
    assert weights == snapshot / "model.safetensors" and weights.is_symlink() and weights.resolve().parent.name == "blobs"
    assert resolve("lerobot/pi05_tiny_test") == snapshot

    torch.manual_seed(99)
    fresh = build_policy(tiny_cfg())
    report = load_pretrained(fresh, "lerobot/pi05_tiny_test")
    assert report.clean and report.layout == Layout(LEROBOT, "pi05") and report.resolved == str(snapshot)
    for name, param in policy.named_parameters():
        assert torch.equal(dict(fresh.named_parameters())[name], param), name
    assert "policy_preprocessor_step_2_normalizer_processor.safetensors" in report.stats_source  # read from the snapshot
    assert check_weights_source("lerobot/pi05_tiny_test") is None


def test_a_revision_after_the_at_sign_loads_that_revision(tmp_path, offline_cache):
    published_repo(tmp_path, offline_cache, "org/policy", seed=1)
    tagged, _ = published_repo(tmp_path, offline_cache, "org/policy", seed=2, revision="v2")
    fresh = build_policy(tiny_cfg())
    load_pretrained(fresh, "org/policy@v2")
    assert torch.equal(fresh.action_out_proj.weight, tagged.action_out_proj.weight)
    assert check_weights_source("org/policy@v3") is not None


def test_offline_without_the_repo_in_the_cache_says_what_to_do_in_one_sentence(offline_cache):
    with pytest.raises(UserError) as err:
        load_pretrained(build_policy(tiny_cfg()), "lerobot/pi05_base")
    message = str(err.value)
    assert "\n" not in message and "HF_HUB_OFFLINE" in message and "hf download lerobot/pi05_base" in message
    assert str(offline_cache) in message
    assert check_weights_source("lerobot/pi05_base") == message  # what the config rules report before any launch
    with pytest.raises(UserError, match=r"policy.tokenizer_path=google/paligemma-3b-pt-224: not a local path"):
        build_policy(tiny_cfg(tokenizer_path="google/paligemma-3b-pt-224"))


def test_local_paths_are_checked_without_the_hub(tmp_path, offline_cache):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert check_weights_source(tmp_path / "model.safetensors") is None
    assert check_weights_source(tmp_path / "missing" / "model.safetensors") == (
        f"policy.pretrained_path '{tmp_path / 'missing' / 'model.safetensors'}' does not exist.")
    with pytest.raises(UserError, match="no such file or directory"):
        resolve(tmp_path / "missing" / "model.safetensors")


def test_an_incomplete_cached_snapshot_is_refused_offline(tmp_path, offline_cache):
    _, commit = published_repo(tmp_path, offline_cache, "org/partial", seed=1)
    (offline_cache / "models--org--partial" / "snapshots" / commit / "model.safetensors").unlink()  # interrupted download
    with pytest.raises(UserError, match="not in the Hugging Face cache"):
        resolve("org/partial")


def test_a_tokenizer_repo_id_resolves_to_its_cached_snapshot(tmp_path, offline_cache):
    vocab = save_word_tokenizer(tmp_path / "tok")
    hub_cache(offline_cache, "google/paligemma-test", tmp_path / "tok")
    policy = build_policy(tiny_cfg(tokenizer_path="google/paligemma-test"))
    assert policy.tokenizer.tok.convert_tokens_to_ids("cube") == vocab["cube"]
    assert check_weights_source("google/paligemma-test", "policy.tokenizer_path") is None
