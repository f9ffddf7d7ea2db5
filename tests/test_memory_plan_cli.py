"""A run that does not fit the card is refused by the CLI before anything is written: `opentau config validate
--gpu-memory` and `opentau train --gpu-memory` exit 2 with one line naming the settings that would fit, and the
setting it names passes; every --gpu-memory states how a card's size is read."""

from __future__ import annotations

import pytest

from conftest import EXAMPLES, SUITE_CACHE, run_cli_in_process

pytestmark = pytest.mark.full

TINY = str(EXAMPLES / "pi05_tiny_config.json")


@pytest.fixture(autouse=True)
def _suite_cache(one_thread, monkeypatch):
    """The suite's step-measurement cache, as tests/test_memory_plan.py says why."""
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(SUITE_CACHE))


def files_under(path):
    return sorted(p.relative_to(path) for p in path.rglob("*"))


def test_config_validate_refuses_a_run_too_big_for_the_card_in_one_line_naming_what_fits_and_writes_nothing(tmp_path):
    from opentau_cli.config import AccelerateSetup, load_config
    from opentau_cli.plan.memory import plan_memory

    run = tmp_path / "run"
    overrides = [f"--output_dir={run}", "--batch_size=16", "--policy.image_resolution=[224,224]"]
    smaller = ["--per_device_batch_size=8", "--gradient_accumulation_steps=2"]
    # A card between the plans of 16 and of 8 per device (the same batch_size through accumulation), in whole MiB
    # as nvidia-smi shows a card.
    single = AccelerateSetup(backend="single")
    too_big = plan_memory(load_config(TINY, overrides, environ={}), single)
    fits = plan_memory(load_config(TINY, [*overrides, *smaller], environ={}), single)
    card_mib = (too_big.total + fits.total) // 2 // 2**20
    assert fits.total < card_mib * 2**20 < too_big.total
    before = files_under(tmp_path)
    args = ["config", "validate", TINY, f"--gpu-memory={card_mib}MiB", *overrides]
    refused = run_cli_in_process(args)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith("Error: The run needs about ") and f"but the card has {card_mib / 1024:.1f} GiB" in lines[0]
    assert "these would fit: " in lines[0]
    assert "--per_device_batch_size=8 --gradient_accumulation_steps=2 (the same batch_size)" in lines[0]
    assert files_under(tmp_path) == before and not run.exists()

    accepted = run_cli_in_process([*args, *smaller])
    assert accepted.returncode == 0, accepted.stderr
    row = next(line for line in accepted.stdout.splitlines() if line.strip().startswith("memory plan"))
    assert f"; fits a {card_mib / 1024:.1f} GiB card (margin" in row

    train = run_cli_in_process(["train", f"--config_path={TINY}", f"--gpu-memory={card_mib}MiB", *overrides])
    assert train.returncode == 2, train.stdout + train.stderr
    assert train.stderr.strip().splitlines() == lines  # the same one line, before anything is launched
    assert files_under(tmp_path) == before and not run.exists()


@pytest.mark.parametrize("command", [["config", "validate"], ["train"], ["resume"]])
def test_every_gpu_memory_option_states_that_80gb_is_the_card_sold_as_80_gb(command):
    from opentau_cli.units import CARD_SIZE_HELP

    result = run_cli_in_process([*command, "--help"], env={"COLUMNS": "400"})
    assert result.returncode == 0
    assert CARD_SIZE_HELP in " ".join(result.stdout.split())
