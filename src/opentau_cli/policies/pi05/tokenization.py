"""Prompt tokenization: task text + the robot state discretized into 256 bins (pi05), and discrete action tokens.

Two tokenizers behind one small interface (`encode_prompt`, `action_token_ids`, `start_id`, `pad_id`):
- `ByteTokenizer` (built in, offline): ids 0-2 are pad/bos/eos, then one id per byte, then one id per state bin;
  discrete action tokens take the last ids of the model vocabulary.
- `HFTokenizer`: a local Hugging Face tokenizer directory (`tokenizer_path`). As in openpi's pi05 the state bins are
  written as numbers in the text ("Task: ..., State: 12 200 ...;\nAction: "); action tokens again take the last ids
  of the model vocabulary (openpi does the same with PaliGemma's reserved tail).
"""

from __future__ import annotations

from pathlib import Path

from opentau_cli.errors import UserError

STATE_BINS = 256
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_BYTE_OFFSET = 3
_STATE_OFFSET = _BYTE_OFFSET + 256


def clean_task(text: str) -> str:
    return text.strip().replace("_", " ").replace("\n", " ")


class ByteTokenizer:
    """UTF-8 bytes, plus one token per state bin. Needs a vocabulary of 515 + action bins ids."""

    pad_id, start_id = PAD_ID, BOS_ID
    reserved = _STATE_OFFSET + STATE_BINS

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode_prompt(self, task: str, state_bins: tuple[int, ...], max_length: int) -> list[int]:
        state_ids = [_STATE_OFFSET + b for b in state_bins]
        room = max_length - 1 - len(state_ids)
        if room < 0:
            raise UserError(
                f"policy.tokenizer_max_length={max_length} leaves no room for the {len(state_ids)} state tokens; raise it to at least {len(state_ids) + 2}."
            )
        text_ids = [_BYTE_OFFSET + b for b in clean_task(task).encode("utf-8")][:room]
        return [BOS_ID, *text_ids, *state_ids]


class HFTokenizer:
    """A local Hugging Face tokenizer directory (never downloads)."""

    def __init__(self, path: Path, vocab_size: int):
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise UserError(f"policy.tokenizer_path={path}: not a loadable Hugging Face tokenizer directory ({type(exc).__name__}: {exc}).") from exc
        self.vocab_size = vocab_size
        self.reserved = len(self.tok)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.start_id = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.pad_id

    def encode_prompt(self, task: str, state_bins: tuple[int, ...], max_length: int) -> list[int]:
        state = " ".join(str(b) for b in state_bins)
        ids = self.tok.encode(f"Task: {clean_task(task)}, State: {state};\nAction: ", add_special_tokens=False)
        if self.tok.bos_token_id is not None:
            ids = [self.tok.bos_token_id, *ids]
        # Truncating would cut the state off; say so instead of training on half a prompt.
        if len(ids) > max_length:
            raise UserError(f"A prompt needs {len(ids)} tokens with {self.tok.name_or_path}; raise policy.tokenizer_max_length (now {max_length}).")
        return ids


def load_tokenizer(tokenizer_path: Path | None, vocab_size: int):
    """The byte-level tokenizer, or the local HF one; checks that its ids fit the model vocabulary."""
    if tokenizer_path is None:
        tokenizer = ByteTokenizer(vocab_size)
    else:
        if not Path(tokenizer_path).is_dir():
            raise UserError(f"policy.tokenizer_path={tokenizer_path}: no such directory.")
        tokenizer = HFTokenizer(Path(tokenizer_path), vocab_size)
    if tokenizer.reserved > vocab_size:
        raise UserError(f"The tokenizer has {tokenizer.reserved} ids but the model vocabulary has only {vocab_size}.")
    return tokenizer


def action_token_id(vocab_size: int, bin_index):
    """Discrete action bin -> token id, counting down from the end of the vocabulary (works for tensors too)."""
    return vocab_size - 1 - bin_index


def encode_prompts(tokenizer, tasks: list[str], state_bins: list[tuple[int, ...]], max_length: int) -> tuple[list[list[int]], list[int]]:
    """Token ids padded to max_length, and the real lengths."""
    rows, lengths = [], []
    for task, bins in zip(tasks, state_bins):
        ids = tokenizer.encode_prompt(task, bins, max_length)
        lengths.append(len(ids))
        rows.append(ids + [tokenizer.pad_id] * (max_length - len(ids)))
    return rows, lengths
