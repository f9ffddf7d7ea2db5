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
    message = f"{venv} is not built: run scripts/peer_envs.sh {name}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)
