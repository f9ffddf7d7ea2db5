"""Every file a command writes gets the mode `open()` gives under the user's umask (a team's shared run directory
stays readable to the team), whoever writes it: the shared DDP and ZeRO-3 reference runs (tests/conftest.py) are
written under REFERENCE_UMASK, the ZeRO-3 one with DeepSpeed's shards, an EMA and asynchronous saves (the writer
process's files); consolidation's output is written under the same umask here. Export and eval outputs and a
single-process checkpoint are test_output_convention's. `opentau serve` writes no file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from conftest import REFERENCE_UMASK, run_cli
from opentau_cli.store.layout import CHECKPOINTS

pytestmark = [pytest.mark.full, pytest.mark.e2e]

WANTED = 0o666 & ~REFERENCE_UMASK


def _modes(root: Path) -> dict[str, int]:
    """Every regular file under `root` (links not followed) -> its permission bits."""
    modes = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                modes[os.path.relpath(os.path.join(dirpath, name), root)] = stat.S_IMODE(st.st_mode)
    return modes


def _off(modes: dict[str, int]) -> dict[str, str]:
    """The files whose mode is not the umask's (an executable script may keep its x bits on top of it)."""
    return {name: oct(mode) for name, mode in modes.items() if mode & ~0o111 != WANTED}


@pytest.mark.parametrize("reference", ["ddp_reference", "zero3_reference"])
def test_every_file_of_a_run_follows_the_umask_under_ddp_and_deepspeed_with_async_saves(reference, request):
    run = request.getfixturevalue(reference)
    modes = _modes(run)
    assert any(name.startswith(CHECKPOINTS) for name in modes) and "metrics.jsonl" in modes
    if reference == "zero3_reference":  # DeepSpeed's own shards, written by the asynchronous writer
        assert any(name.endswith("_optim_states.pt") for name in modes), sorted(modes)
    assert _off(modes) == {}


def test_consolidate_output_follows_the_umask(zero3_reference, tmp_path):
    out = tmp_path / "made" / "consolidated"
    result = run_cli(["checkpoint", "consolidate", str(zero3_reference / CHECKPOINTS / "last"), "--output", str(out),
                      "--max-shard-size", "100KB"], umask=REFERENCE_UMASK)
    assert result.returncode == 0, result.stderr[-3000:]
    modes = _modes(out)
    assert "model.safetensors.index.json" in modes and len(modes) > 2  # shards and their index
    assert _off(modes) == {}


def test_consolidate_output_elsewhere_leaves_the_checkpoint_untouched(zero3_reference, tmp_path):
    """`consolidate CKPT --output ELSEWHERE` reads the checkpoint only: not a byte, a mode or a time of it changes (its
    manifest was rewritten, under the consolidating process's umask, though nothing was added to it)."""
    from conftest import tree

    ckpt = zero3_reference / CHECKPOINTS / "000003"
    before = {p: (p.stat().st_mtime_ns, p.stat().st_mode) for p in ckpt.rglob("*")}
    hashes = tree(ckpt)
    result = run_cli(["checkpoint", "consolidate", str(ckpt), "--output", str(tmp_path / "out.safetensors")], umask=0o022)
    assert result.returncode == 0, result.stderr[-3000:]
    assert tree(ckpt) == hashes and {p: (p.stat().st_mtime_ns, p.stat().st_mode) for p in ckpt.rglob("*")} == before
