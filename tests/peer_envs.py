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


def openpi_source() -> tuple[Path, str]:
    """The openpi checkout OPENPI_SRC names and the version its peer venv is built for (the commit, as
    scripts/peer_envs.sh names it). openpi's source is on GitHub only, out of CI's reach: without it, a skip."""
    import hashlib
    import subprocess

    root = os.environ.get("OPENPI_SRC")
    replace = Path(root or "-") / "src" / "openpi" / "models_pytorch" / "transformers_replace"
    if not replace.is_dir():
        pytest.skip("openpi's source is not available here (set OPENPI_SRC to a checkout; openpi is not on PyPI)")
    if (Path(root) / ".git").exists():
        found = subprocess.run(["git", "-C", root, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True)
        return Path(root), found.stdout.strip()
    # Not a git checkout: the script names the venv after its transformers_replace files (sha256sum of each, sorted).
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(replace)}\n"
                    for p in sorted(replace.rglob("*.py"), key=lambda p: f"./{p.relative_to(replace)}"))
    return Path(root), "src-" + hashlib.sha256(lines.encode()).hexdigest()[:7]
