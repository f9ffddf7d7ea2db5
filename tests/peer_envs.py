"""The peers' own packages, in the venvs scripts/peer_envs.sh builds (one per package and version)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "scripts" / "peer_envs.sh"


def peer_python(name: str, version: str) -> str:
    """The Python of the peer venv `name`-`version`. Missing: a failure in CI (scripts/test.sh builds it first), a
    skip elsewhere that says how to build it."""
    root = Path(os.environ.get("OPENTAU_PEERS_DIR") or Path.home() / ".cache" / "opentau" / "peers")
    venv = root / f"{name}-{version}"
    if (venv / ".complete").is_file():
        return str(venv / "bin" / "python")
    _missing(f"{venv} is not built: run scripts/peer_envs.sh {name}")


PINNED_OPENPI = REPO.parent / "shared" / "peers" / "openpi-15a9616"  # openpi's files at that commit, unchanged


def _missing(message: str):
    """A peer that is not here: a failure under CI (CI has it), a skip that says why elsewhere."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def openpi_root() -> Path:
    """openpi's source: the checkout OPENPI_SRC names, else the pinned copy beside the checkout (openpi is on GitHub
    only; scripts/peer_envs.sh builds its peer venv from the same default)."""
    root = Path(os.environ.get("OPENPI_SRC") or PINNED_OPENPI)
    if not (root / "src" / "openpi" / "models_pytorch" / "transformers_replace").is_dir():
        _missing(f"openpi's source is not at {root} (set OPENPI_SRC to a checkout of it; openpi is not on PyPI)")
    return root


def openpi_source() -> tuple[Path, str]:
    """openpi's source (openpi_root) and the version its peer venv is built for, as scripts/peer_envs.sh names it:
    the checkout's commit, the commit a pinned copy is named after (openpi-<commit>), else a hash of its files."""
    import hashlib
    import re
    import subprocess

    root = openpi_root()
    replace = root / "src" / "openpi" / "models_pytorch" / "transformers_replace"
    pinned = re.fullmatch(r"openpi-([0-9a-f]{7,40})", root.name)
    if (root / ".git").exists():
        found = subprocess.run(["git", "-C", root, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True)
        return root, found.stdout.strip()
    if pinned:
        return root, pinned.group(1)[:7]
    # Not a git checkout: the script names the venv after its transformers_replace files (sha256sum of each, sorted).
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(replace)}\n"
                    for p in sorted(replace.rglob("*.py"), key=lambda p: f"./{p.relative_to(replace)}"))
    return root, "src-" + hashlib.sha256(lines.encode()).hexdigest()[:7]


def lerobot_sim_python() -> str:
    """The Python of LeRobot 0.4.4 with openpi's transformers_replace files and the simulators (scripts/peer_envs.sh
    lerobot-sim): LeRobot's env wrappers, eval pipeline and pi05."""
    _, commit = openpi_source()
    return peer_python("lerobot-sim", f"0.4.4-openpi-{commit}")


def byte_level_tokenizer(directory: Path) -> Path:
    """A byte-level Hugging Face tokenizer that puts BOS first (as PaliGemma's does), small enough for pi05_small's
    vocabulary: opentau, LeRobot and openpi all tokenize the prompt with it in place of PaliGemma's (a download)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(specials + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>").save_pretrained(directory)
    config = directory / "tokenizer_config.json"  # the class name that the peers' transformers 4.53 knows too
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def sizes_for_peers(preset: str) -> dict:
    """The model's sizes for the peers' classes, which know only PaliGemma-3B's (their `gemma_2b` / `gemma_300m`)."""
    from opentau_cli.policies.pi05.configuration import PRESETS

    p = PRESETS[preset]
    vlm, expert = p["vlm"], p["expert"]

    def gemma(width, depth, mlp):
        return {"width": width, "depth": depth, "mlp_dim": mlp, "num_heads": vlm["num_attention_heads"],
                "num_kv_heads": vlm["num_key_value_heads"], "head_dim": vlm["head_dim"]}

    return {"vocab_size": vlm["vocab_size"], "vlm": {"width": vlm["hidden_size"]}, "vision": dict(p["vision"]),
            "gemma": {"gemma_2b": gemma(vlm["hidden_size"], vlm["num_hidden_layers"], vlm["intermediate_size"]),
                      "gemma_300m": gemma(expert["hidden_size"], expert["num_hidden_layers"], expert["intermediate_size"])}}
