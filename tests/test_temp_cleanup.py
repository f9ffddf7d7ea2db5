"""tests/conftest.py removes what a test module left in the temporary directory once the module passed: a real pytest
session over made-up modules, with this suite's conftest as its plugin, read from outside afterwards."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.quick

SHARED = '''
import pytest

@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("session-shared")
'''
PASSING = '''
import pytest

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("passing_runs")

def test_uses_both(shared, runs):
    (runs / "checkpoint").write_bytes(b"x" * 1000)
'''
FAILING = '''
import pytest

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("failing_runs")

def test_fails(runs):
    assert False
'''
LATER = '''
def test_the_session_fixture_is_still_there(shared):
    assert shared.is_dir()
'''


def test_a_passing_modules_temporary_directories_go_a_failing_ones_and_session_fixtures_stay(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, text in {"shared_fixture.py": SHARED, "test_a_passing.py": PASSING, "test_b_failing.py": FAILING,
                       "test_c_later.py": LATER}.items():
        (suite / name).write_text(text)
    base = tmp_path / "base"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(suite)])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "shared_fixture", "-p", "no:xdist",
                           "-p", "no:cacheprovider", f"--basetemp={base}", f"--rootdir={suite}", str(suite)], cwd=suite,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 failed, 2 passed" in done.stdout, done.stdout[-3000:]
    left = sorted(p.name for p in base.iterdir() if not p.is_symlink())
    assert [n for n in left if n.startswith("passing_runs")] == []  # its module passed
    assert [n for n in left if n.startswith("failing_runs")] == ["failing_runs0"]  # kept to read
    assert [n for n in left if n.startswith("session-shared")] == ["session-shared0"]  # the later module used it


def test_every_session_fixture_names_its_temporary_directory_session():
    """A session fixture's directory outlives the module that first asked for it: conftest's SESSION_TEMP prefix keeps
    the module clean-up off it. Every `mktemp` (and S3 server) in a session fixture of the suite is named so."""
    unnamed = []
    for path in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not any("session" in ast.unparse(d) for d in node.decorator_list):
                continue
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and ast.unparse(call.func).endswith(("mktemp", "start_s3_server")):
                    if not any("SESSION_TEMP" in ast.unparse(arg) for arg in call.args):
                        unnamed.append(f"{path.name}:{call.lineno}")
    assert unnamed == []
