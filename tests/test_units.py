"""One size convention for every option that takes a size (--max-shard-size, --memory-limit)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from opentau_cli.cli.main import app
from opentau_cli.errors import UserError
from opentau_cli.profiling.run import parse_memory_limit
from opentau_cli.units import SIZE_HELP, parse_size

pytestmark = pytest.mark.quick


@pytest.mark.parametrize(
    "text, size",
    [
        ("5GB", 5 * 10**9), ("5gb", 5 * 10**9), ("5G", 5 * 10**9), ("500MB", 500 * 10**6), ("3KB", 3000), ("1TB", 10**12),
        ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * 2**30)), (" 8 GB ", 8 * 10**9), ("1000", 1000),
        ("7B", 7),
    ],
)
def test_decimal_units_are_powers_of_1000_and_binary_units_powers_of_1024(text, size):
    assert parse_size(text, "--max-shard-size") == size


@pytest.mark.parametrize("text", ["lots", "5XB", "GB", "-5GB", "5 G B", "", "0", "0GB"])
def test_what_is_not_a_positive_size_is_refused_naming_the_option(text):
    with pytest.raises(UserError, match=r"^--max-shard-size (must be a positive size|'.*' is not a size; write e\.g\. 5GB)"):
        parse_size(text, "--max-shard-size")


def test_a_memory_limit_no_worker_can_start_under_is_refused():
    assert parse_memory_limit("8GB") == 8 * 10**9
    with pytest.raises(UserError, match="below 64 MiB"):
        parse_memory_limit("60MiB")


@pytest.mark.parametrize("command", [["checkpoint", "consolidate"], ["profile"]])
def test_every_help_that_takes_a_size_states_the_convention(command):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    assert SIZE_HELP in " ".join(result.output.split())
