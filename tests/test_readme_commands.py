"""The commands of the README and of the reference pages in docs/ work on a fresh clone as written.

Every ```bash block of README.md and of docs/*.md runs, the README's first, then each page in the order the README
first links it (a page it does not link after those, by name), in one scratch directory that holds a copy of the
repository's configs/ (the blocks' relative paths), with the installed CLI first on PATH, offline, on one OpenMP thread
per process and without the user's Accelerate default config. A command that trains for its config's own number of
steps (no `--steps` on its line) is shortened by `OPENTAU_STEPS` (the documented environment override, which a
command-line `--steps` beats), so the whole test stays within minutes. A block that needs what CI does not have (a GPU,
the network, a cluster) is marked just above it with `<!-- readme-test: skip: <why> -->`; the reason is required.
Blocks are found when the test runs, so a block added to the README or to a page of docs/ is tested (or must say why
not) without touching this file. A block that runs says what it makes with `<!-- readme-test: makes: PATH ... -->` just
above it: each path (relative to the scratch directory) must exist afterwards and hold something, so a command that
exits 0 without doing its job fails too; a block that makes no file says what it prints instead
(`<!-- readme-test: prints: TEXT -->`).

The full pi05 preset starts from weights and a tokenizer on the Hub, so its blocks are skipped; docs/configuration.md
says how its `config validate` examples run offline (`OFFLINE_FLAGS`), and every such example, skipped block or not,
is run so, expecting what its page shows: success, or the refusal its `# Error:` comment quotes.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, run_cli_in_process

pytestmark = [pytest.mark.full, pytest.mark.slow]  # a minute or more: starts first (tests/conftest.py)

README = REPO / "README.md"
DOCS = REPO / "docs"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip:?\s*(.*?)\s*-->")
MAKES = re.compile(r"<!--\s*readme-test:\s*makes:\s*(.*?)\s*-->")
PRINTS = re.compile(r"<!--\s*readme-test:\s*prints:\s*(.*?)\s*-->")
# A block that runs as an sbatch script on the tests' SLURM cluster: tests/test_slurm.py runs it, not this module.
SLURM = re.compile(r"<!--\s*readme-test:\s*slurm:\s*(.*?)\s*-->")
TIMEOUT_S = 900  # per block


@dataclass
class Block:
    page: str  # the file, relative to the repository: README.md, docs/training.md, ...
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # the reason, when marked; "" when marked without one
    makes: tuple[str, ...] = ()  # what it must leave behind (`makes:` marker)
    prints: str | None = None  # what its output must hold (`prints:` marker)
    slurm: str | None = None  # run on the SLURM cluster by tests/test_slurm.py (`slurm:` marker, with why)

    def __str__(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
        return f"{self.page}:{self.line} ({first.strip()[:70]})"


def pages() -> list[Path]:
    """README.md, then the pages of docs/ in the order the README first links them, then any page it does not link (by
    name): a reader's order, so a page's block may use what an earlier page's block made (the README's tiny run)."""
    linked = [DOCS / name for name in re.findall(r"\]\(docs/([\w.-]+\.md)", README.read_text())]
    rest = sorted(set(DOCS.glob("*.md")) - set(linked))
    return [README, *dict.fromkeys(p for p in linked if p.is_file()), *rest]


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Every ```bash block of one page, with the marker, if any, on the last non-blank line above its fence."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start = i
            above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            marker, makes, prints = SKIP.search(above), MAKES.search(above), PRINTS.search(above)
            slurm = SLURM.search(above)
            blocks.append(Block(page, start + 1, "\n".join(body) + "\n", marker.group(1) if marker else None,
                                tuple(makes.group(1).split()) if makes else (), prints.group(1) if prints else None,
                                slurm.group(1) if slurm else None))
        i += 1
    return blocks


BLOCKS = [block for path in pages() for block in readme_blocks(path.read_text(), str(path.relative_to(REPO)))]


def test_the_readme_has_command_blocks_and_each_skipped_one_says_why():
    assert len(BLOCKS) >= 5
    unexplained = [str(b) for b in BLOCKS if b.skip == ""]
    assert unexplained == [], "a <!-- readme-test: skip: ... --> marker without a reason"
    runnable = [b for b in BLOCKS if b.skip is None and b.slurm is None]
    assert runnable, "no block of the README or docs/ runs in CI"
    unchecked = [str(b) for b in runnable if not b.makes and not b.prints]
    assert unchecked == [], "a block that runs must say what it makes or prints (<!-- readme-test: makes: PATH ... -->)"


def test_the_quick_start_scripts_are_not_run_here():
    """scripts/test.sh is what CI runs (it would run this test again); scripts/demo.sh sets up .venv first."""
    for script in ("./scripts/test.sh", "./scripts/demo.sh"):
        holding = [b for b in BLOCKS if script in b.code]
        assert holding and all(b.skip for b in holding), f"{script}: its block must be marked skipped"


def _holds_something(path: Path) -> bool:
    """A non-empty file, or a directory with something in it."""
    return path.is_file() and path.stat().st_size > 0 or path.is_dir() and any(path.iterdir())


def _scratch(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A fresh-clone-like working directory and the environment a user's shell would have after setup."""
    cwd = tmp / "clone"
    cwd.mkdir()
    shutil.copytree(REPO / "configs", cwd / "configs")
    shutil.copy2(REPO / "convert_checkpoint.sh", cwd / "convert_checkpoint.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTAU_") or k == "OPENTAU_CACHE_DIR"}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        HF_HOME=str(tmp / "hf_home"),  # no user Accelerate default config, no Hub cache
        HF_HUB_OFFLINE="1",
        OPENTAU_STEPS="4",  # e.g. the mixture example's 200 steps of video decoding: minutes on a CI machine
        # One OpenMP thread per process: on CI's two cores, shared with the other pytest worker, a second thread of
        # `opentau eval` or of a single-process run only spins (conftest.SINGLE_PROCESS_ENV). A 2-process launch gets
        # one per process on two cores anyway.
        OMP_NUM_THREADS="1",
    )
    env.pop("ACCELERATE_CONFIG_DIR", None)
    return cwd, env


def test_every_readme_block_that_needs_no_gpu_or_network_runs_as_written(tmp_path):
    # No runnable block at all is a broken README or docs/ page, never a reason to skip.
    assert any(b.skip is None and b.slurm is None for b in BLOCKS), "README.md and docs/ hold no runnable block"
    cwd, env = _scratch(tmp_path)
    failed = []
    for block in (b for b in BLOCKS if b.skip is None and b.slurm is None):  # every block, so one failure does not hide the next
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=env, capture_output=True,
                                text=True, timeout=TIMEOUT_S)
        if result.returncode:
            failed.append(f"{block} failed with exit code {result.returncode}\n--- block\n{block.code}--- stderr (end)\n"
                          f"{result.stderr[-3000:]}\n--- stdout (end)\n{result.stdout[-1000:]}")
            continue
        empty = [path for path in block.makes if not _holds_something(cwd / path)]
        if empty:
            failed.append(f"{block} exited 0 but did not make {', '.join(empty)}")
        if block.prints and block.prints not in result.stdout + result.stderr:
            failed.append(f"{block} exited 0 but did not print {block.prints!r}")
    assert not failed, "\n\n".join(failed)


# What docs/configuration.md tells a user without the Hub to add to a full-pi05 `config validate`.
OFFLINE_FLAGS = ("--policy.pretrained_path=null", "--policy.tokenizer_path=null")
FULL_PI05 = ["opentau", "config", "validate", "configs/examples/pi05_config.json"]


@dataclass
class Example:
    block: Block
    argv: list[str]
    error: str | None  # the refusal the page shows under it (`# Error: ...`), else None: it passes


def full_pi05_validates(blocks: list[Block]) -> list[Example]:
    """Every `opentau config validate configs/examples/pi05_config.json ...` command of the blocks (lines
    continued with a backslash joined, trailing comments dropped), with the `# Error:` comment that follows it."""
    found = []
    for block in blocks:
        lines = block.code.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            if not line.lstrip().startswith(" ".join(FULL_PI05[:3])):
                continue
            argv = shlex.split(line, comments=True)
            if argv[:4] != FULL_PI05:
                continue
            error = None
            if i + 1 < len(lines) and lines[i + 1].lstrip().startswith("# Error:"):
                error = lines[i + 1].lstrip()[2:]
            found.append(Example(block, argv, error))
    return found


def test_the_readme_says_how_full_pi05_examples_validate_offline():
    text = "\n".join(path.read_text() for path in pages())
    assert full_pi05_validates(BLOCKS), "no full-pi05 `config validate` example left in the README or docs/"
    assert " ".join(OFFLINE_FLAGS) in text, f"the README or docs/ must say to add `{' '.join(OFFLINE_FLAGS)}` offline"


def test_every_full_pi05_validate_example_runs_offline_with_the_readmes_flags(tmp_path, monkeypatch):
    """In-process (`config validate` launches nothing; the installed script running such a line from bash is
    docs/configuration.md's runnable full-pi05 `config validate` block, in the test above): in the scratch directory,
    with the environment `_scratch` gives a shell."""
    from huggingface_hub import constants

    cwd, env = _scratch(tmp_path)
    for name in list(os.environ):
        if name not in env:
            monkeypatch.delenv(name)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: as HF_HUB_OFFLINE=1 makes it in a shell
    failed = []
    for example in full_pi05_validates(BLOCKS):
        argv = example.argv + [f for f in OFFLINE_FLAGS if f not in example.argv]
        assert argv[0] == "opentau"
        result = run_cli_in_process(argv[1:], cwd=cwd, env=env)
        lines = result.stderr.strip().splitlines()
        errors = [ln for ln in lines if ln.startswith("Error:")]
        if example.error is None:
            ok = result.returncode == 0
        else:  # the refusal as the page quotes it, up to its first number (the plan's numbers are the plan's)
            words = re.split(r"\d", example.error, maxsplit=1)[0]
            ok = result.returncode == 2 and len(errors) == 1 and errors[0].startswith(words)
        if not ok:
            failed.append(f"{example.block}: {shlex.join(argv)} exited {result.returncode}, the page expects "
                          f"{example.error or 'success'}\n{result.stderr[-2000:]}")
    assert not failed, "\n\n".join(failed)
