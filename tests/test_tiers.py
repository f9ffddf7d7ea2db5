"""The tiers of the suite: every test module says on its `pytestmark` line whether it is in the quick tier
(`./scripts/test.sh --quick`) or the whole suite only, and the quick tier reaches every package of opentau."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "src" / "opentau_cli"
TIERS = ("quick", "full")


def module_marks(path: Path) -> list[str]:
    """The `pytest.mark.NAME` names of a module's top-level `pytestmark`."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return [v.attr for v in values if isinstance(v, ast.Attribute) and ast.unparse(v.value) == "pytest.mark"]
    return []


def imported_packages(path: Path) -> set[str]:
    """The folders (and top-level modules) of opentau_cli a test module imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "opentau_cli" and len(parts) > 1:
                found.add(parts[1])
    return found


MODULES = sorted(TESTS.glob("test_*.py"))


def test_every_test_module_names_exactly_one_tier_on_its_pytestmark_line():
    wrong = {p.name: [m for m in module_marks(p) if m in TIERS] for p in MODULES}
    assert {name: tiers for name, tiers in wrong.items() if len(tiers) != 1} == {}


def test_the_quick_tier_imports_every_package_of_opentau():
    quick = [p for p in MODULES if "quick" in module_marks(p)]
    reached = set().union(*(imported_packages(p) for p in quick))
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert sorted(packages - reached) == []
