"""The house in layers (docs/ARCHITECTURE.md, "Layers"): the code's imports follow the table there, and no modules or
folders import each other in a cycle. Imports inside functions count: moving an import into a function does not
make a cycle go away. This reads the source with its own parser; it shares nothing with the product."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "opentau_cli"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def layer_table() -> dict[str, int]:
    """{folder or top-level module (without .py): layer number} from the doc's "Layers" table."""
    section = DOC.read_text().split("## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([\w.]+?)(?:/|\.py)` \|", section, re.M)
    return {name: int(level) for level, name in rows}


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The opentau_cli modules `name` imports anywhere in its file (a `from pkg import sub` names pkg.sub)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `edges` (a path that returns to its start), or None: depth-first search with colours."""
    colour, stack = {}, []

    def visit(node):
        colour[node] = "grey"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if colour.get(nxt) == "grey":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in colour and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = "black"
        return None

    for node in sorted(edges):
        if node not in colour and (found := visit(node)):
            return found
    return None


def package_edges(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> folders it imports; a package's own __init__ handing names on is part of that folder."""
    out: dict[str, set[str]] = {}
    for mod, targets in modules.items():
        for target in targets:
            a, b = folder_of(mod), folder_of(target)
            if a != b and mod != "opentau_cli" and target != "opentau_cli":
                out.setdefault(a, set()).add(b)
    return out


def test_no_module_imports_itself_back_through_others():
    assert find_cycle(graph()) is None


def test_no_folder_imports_itself_back_through_others():
    assert find_cycle(package_edges(graph())) is None


def test_every_folder_and_top_level_module_has_a_row_in_the_layers_table():
    table = layer_table()
    present = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert present == set(table)


def test_every_import_goes_down_the_layers_table():
    table = layer_table()
    wrong = []
    for mod, targets in graph().items():
        for target in targets:
            a, b = folder_of(mod), folder_of(target)
            if a == b or "opentau_cli" in (mod, target):
                continue
            if table[b] >= table[a]:
                wrong.append(f"{mod} (layer {table[a]}) imports {target} (layer {table[b]})")
    assert wrong == []


def test_no_module_imports_another_modules_private_name():
    files = module_files()
    wrong = []
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opentau_cli") and node.module != name:
                wrong += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert wrong == []


@pytest.mark.parametrize("edges, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
])
def test_the_cycle_finder_finds_a_cycle_of_three_and_none_in_a_chain(edges, cycle):
    assert find_cycle(edges) == cycle


def test_an_import_inside_a_function_counts(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from opentau_cli.train import worker\n")
    known = {"opentau_cli.train", "opentau_cli.train.worker", "opentau_cli.m"}
    assert imported_modules("opentau_cli.m", path, known) == {"opentau_cli.train.worker"}
