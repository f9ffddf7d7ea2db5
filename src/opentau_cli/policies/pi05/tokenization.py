"""Prompt tokenization: task text + the robot state discretized into 256 bins (pi05), and discrete action tokens.

Two tokenizers behind one small interface (`encode_prompt`, `start_id`, `pad_id`, `reserved`):
- `HFTokenizer`: a local Hugging Face tokenizer directory (`tokenizer_path`); with PaliGemma's tokenizer it gives the
  ids the published pi05 was trained on. Prompts are openpi's: pi05 "Task: <task>, State: <bins>;\nAction: " with
  the bins written as numbers, pi0 "<task>\n" (its state goes to the expert); BOS first; too long prompts are
  truncated with a warning.
- `ByteTokenizer` (built in, offline; for tests and tiny presets): ids 0-2 are pad/bos/eos, then one id per byte,
  then one id per state bin.
Discrete action tokens take the last ids of the model vocabulary (openpi does the same with PaliGemma's tail).

`PromptTokenizer` is the whole prompt rule in one place (normalize the state with the policy's statistics, bin its
real dims, encode, pad): the data workers run it on each training batch, the policy on batches that come without
token ids (docs/ARCHITECTURE.md, "Batch format").
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from opentau_cli.data.normalization import normalize
from opentau_cli.errors import UserError

STATE_BINS = 256
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_BYTE_OFFSET = 3
_STATE_OFFSET = _BYTE_OFFSET + 256


def clean_task(text: str) -> str:
    return text.strip().replace("_", " ").replace("\n", " ")


def state_bins(normalized_state: torch.Tensor) -> list[tuple[int, ...]]:
    """openpi's bins of the quantile-normalized state: bin i holds [-1 + i/128, -1 + (i+1)/128).

    Values below -1 give -1 and values from 1 - 1/128 up give 255, exactly as np.digitize(x, linspace(-1, 1, 257)[:-1]) - 1.
    """
    edges = torch.linspace(-1.0, 1.0, STATE_BINS + 1, dtype=torch.float64, device=normalized_state.device)[:-1]
    bins = torch.bucketize(normalized_state.double(), edges, right=True) - 1
    return [tuple(row) for row in bins.tolist()]


class ByteTokenizer:
    """UTF-8 bytes, plus one token per state bin. Needs a vocabulary of 515 + action bins ids."""

    pad_id, start_id = PAD_ID, BOS_ID
    reserved = _STATE_OFFSET + STATE_BINS

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode_prompt(self, task: str, state_bins: tuple[int, ...] | None, max_length: int) -> list[int]:
        # Out-of-range states (openpi's bin -1) share the lowest bin: this tokenizer has exactly 256 state ids.
        state_ids = [_STATE_OFFSET + min(max(b, 0), STATE_BINS - 1) for b in state_bins or ()]
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

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_prompt(self, task: str, state_bins: tuple[int, ...] | None, max_length: int) -> list[int]:
        text = clean_task(task)
        if state_bins is None:  # pi0: the newline, encoded on its own, is the "start of answer" token
            ids = self._encode(text) + self._encode("\n")
        else:
            ids = self._encode(f"Task: {text}, State: {' '.join(str(b) for b in state_bins)};\nAction: ")
        if self.tok.bos_token_id is not None:
            ids = [self.tok.bos_token_id, *ids]
        if len(ids) > max_length:
            warnings.warn(
                f"A prompt of {len(ids)} tokens is truncated to policy.tokenizer_max_length={max_length}; raise it if this happens often.",
                stacklevel=2,
            )
            ids = ids[:max_length]
        return ids


def load_tokenizer(tokenizer_path: Path | None, vocab_size: int):
    """The byte-level tokenizer (no path), or the Hugging Face tokenizer in a local directory; checks that its ids fit
    the model vocabulary. A hub repo id is resolved to its local snapshot directory before this is called."""
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


def encode_prompts(tokenizer, tasks: list[str], bins_per_sample: list[tuple[int, ...]] | None, max_length: int) -> tuple[list[list[int]], list[int]]:
    """Token ids padded to max_length, and the real lengths; `bins_per_sample` None: no state in the prompt (pi0)."""
    rows, lengths = [], []
    for task, bins in zip(tasks, bins_per_sample or [None] * len(tasks)):
        ids = tokenizer.encode_prompt(task, bins, max_length)
        lengths.append(len(ids))
        rows.append(ids + [tokenizer.pad_id] * (max_length - len(ids)))
    return rows, lengths


class PromptTokenizer:
    """Task text (+ for pi05 the state, normalized in fp32 with the policy's statistics and binned over each sample's
    real dims) -> token ids padded to `max_length` and their valid mask. Picklable: a DataLoader worker gets a copy.

    `state_stats` are the policy's state statistics buffers on the host (None: pi0, whose prompt holds no state).
    Computes on the host, so the bins do not depend on the device the policy runs on."""

    def __init__(self, tokenizer, max_length: int, state_stats: dict[str, torch.Tensor] | None, mode: str):
        self.tokenizer, self.max_length, self.state_stats, self.mode = tokenizer, max_length, state_stats, mode

    def __call__(self, tasks: list[str], state: torch.Tensor, widths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, max_length) int64 ids and bool valid mask; `widths`: each sample's real state dims (default: all)."""
        bins = None
        if self.state_stats is not None:
            normalized = normalize(state.detach().to("cpu", torch.float32), self.state_stats, self.mode)
            widths = widths if widths is not None else [normalized.shape[-1]] * len(tasks)
            bins = [row[:width] for row, width in zip(state_bins(normalized), widths)]
        ids, lengths = encode_prompts(self.tokenizer, list(tasks), bins, self.max_length)
        valid = torch.arange(self.max_length)[None] < torch.tensor(lengths, dtype=torch.int64)[:, None]
        return torch.tensor(ids, dtype=torch.int64), valid

    def batch_tokens(self, batch: dict) -> dict[str, torch.Tensor]:
        """`input_ids` and `text_valid` of a batch in the batch format (its `state_dim`, when a mixture's, gives the widths)."""
        widths = torch.as_tensor(batch["state_dim"]).reshape(-1).tolist() if "state_dim" in batch else None
        ids, valid = self(batch["task"], batch["state"], widths)
        return {"input_ids": ids, "text_valid": valid}
