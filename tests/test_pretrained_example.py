"""configs/examples/pi05_config.json fine-tunes from lerobot/pi05_base with PaliGemma's tokenizer: it passes its checks
from a Hugging Face cache that holds both (laid out as `hf download` leaves it, the weights as sparse full-size
headers), and without them, offline or without network, it is refused in one line before anything starts."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import EXAMPLES, offline_hub
from opentau_cli.cli.main import app
from opentau_cli.config import Machine, load_config
from opentau_cli.errors import UserError
from opentau_cli.policies import check_pretrained
from opentau_cli.policies.hub import check_sources, resolve
from opentau_cli.policies.layouts import LEROBOT, Layout
from opentau_cli.policies.pi05.tokenization import load_tokenizer
from opentau_cli.process import launch
from opentau_cli.store.hub import hub_reachable
from published import hub_cache_header_only, published_keys

pytestmark = pytest.mark.full

FULL = str(EXAMPLES / "pi05_config.json")
EIGHT_GPUS = Machine(cuda=True, gpus=8)


@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch):
    def launched(*_args, **_kwargs):
        raise AssertionError("train got past its checks and would have launched")

    monkeypatch.setattr(launch, "run", launched)
    monkeypatch.setattr(Machine, "this", classmethod(lambda cls: EIGHT_GPUS))


def refusals(out: Path) -> tuple:
    """`opentau train` and `opentau config validate --gpus 8` of the example config: both results."""
    runner = CliRunner()
    train = runner.invoke(app, ["train", f"--config_path={FULL}", f"--output_dir={out}"])
    validate = runner.invoke(app, ["config", "validate", FULL, "--gpus", "8", f"--output_dir={out}"])
    return train, validate


def test_the_example_config_names_the_published_base_and_paligemmas_tokenizer():
    policy = json.loads(Path(FULL).read_text())["policy"]
    assert (policy["pretrained_path"], policy["tokenizer_path"]) == ("lerobot/pi05_base", "google/paligemma-3b-pt-224")


def test_the_cache_holds_full_size_weights_as_holes_and_a_tokenizer_that_loads_offline(published_pi05_hub, published_pi05_cache):
    from huggingface_hub import hf_hub_download

    weights = Path(hf_hub_download("lerobot/pi05_base", "model.safetensors", local_files_only=True))
    assert weights.is_symlink() and weights.resolve().parent.name == "blobs"
    size = 8 + sum(2 * n for n in (_numel(s) for s in published_keys("pi05", "model.", embed_tokens=False).values()))
    assert weights.stat().st_size > size > 6.5e9  # every bf16 tensor of the 3.3B model, after the header
    assert weights.resolve().stat().st_blocks * 512 < 4 * 2**20  # only the header is on disk

    cfg = load_config(FULL, [], environ={})
    report = check_pretrained(cfg.policy)  # the 3.3B policy on the meta device, matched from the headers alone
    assert report.layout == Layout(LEROBOT, "pi05") and report.clean
    tokenizer = load_tokenizer(resolve(cfg.policy.tokenizer_path, "policy.tokenizer_path"), 257152)
    assert tokenizer.pad_id == 0 and tokenizer.start_id == tokenizer.tok.convert_tokens_to_ids("[BOS]") == 1


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("cached", [(), ("lerobot/pi05_base",)], ids=["empty cache", "weights cached, tokenizer not"])
def test_offline_without_the_sources_in_the_cache_train_and_validate_refuse_in_one_line(isolated_env, monkeypatch, cached):
    cache = isolated_env / "hf_cache"
    cache.mkdir()
    for repo in cached:
        hub_cache_header_only(cache, repo, published_keys("pi05", "model.", embed_tokens=False))
    offline_hub(monkeypatch, cache)
    before = sorted(cache.rglob("*"))
    train, validate = refusals(isolated_env / "run")

    assert train.exit_code == validate.exit_code == 2, train.output
    assert validate.stderr == train.stderr and validate.stdout == ""
    lines = train.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in train.output  # each problem said once, in one sentence
    missing = [r for r in ("lerobot/pi05_base", "google/paligemma-3b-pt-224") if r not in cached]
    for repo in missing:
        assert f"`hf download {repo}`" in lines[0]
    assert "HF_HUB_OFFLINE is set: unset it" in lines[0] and str(cache) in lines[0]
    assert ("lerobot/pi05_base" in lines[0]) == ("lerobot/pi05_base" in missing)
    assert not (isolated_env / "run").exists() and sorted(cache.rglob("*")) == before  # nothing written


@pytest.fixture
def unreachable_hub(isolated_env, monkeypatch):
    """Not offline, an empty cache, and a Hub endpoint that refuses connections (a bound port nobody listens on)."""
    from huggingface_hub import HfApi, constants

    cache = isolated_env / "hf_cache"
    cache.mkdir()
    offline_hub(monkeypatch, cache)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{bound.getsockname()[1]}")

        def asked(*_args, **_kwargs):
            raise AssertionError("asked the Hub after it was found unreachable")

        monkeypatch.setattr(HfApi, "repo_info", asked)
        hub_reachable.cache_clear()
        yield cache
        hub_reachable.cache_clear()


def test_without_network_the_sources_are_refused_after_one_probe_of_the_hub(unreachable_hub):
    sources = {"policy.pretrained_path": "lerobot/pi05_base", "policy.tokenizer_path": "google/paligemma-3b-pt-224"}
    [problem] = check_sources(sources)
    assert "cannot be reached" in problem and "`hf download lerobot/pi05_base`" in problem
    assert "`hf download google/paligemma-3b-pt-224`" in problem
    with pytest.raises(UserError, match="the Hugging Face Hub cannot be reached"):
        resolve("lerobot/pi05_base")  # loading goes straight to the cache too
    assert hub_reachable.cache_info().misses == 1  # one probe for every check and load of the process

    _, validate = refusals(unreachable_hub.parent / "run")
    assert validate.exit_code == 2 and validate.stderr.strip() == f"Error: {problem}"
