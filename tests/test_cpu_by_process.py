"""scripts/cpu_by_process.py, the last table of scripts/test.sh: a process started while it watches is counted under
its kind with the CPU the kernel charged it (read here by the parent, from the child's rusage), and under the test
module that started it."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

pytestmark = pytest.mark.full

# A rank by its command line (the kinds are told apart by what the command line names), busy for about a second.
BUSY_RANK = ("import time  # opentau_cli.train.worker\n"
             "end = time.process_time() + 1.0\nwhile time.process_time() < end: pass")


def test_a_process_started_while_watching_is_counted_under_its_kind_module_and_command_with_its_cpu(tmp_path):
    command = tmp_path / "bin" / "opentau"  # an `opentau checkpoint made_up` by its command line, busy for a second
    command.parent.mkdir()
    command.write_text(BUSY_RANK)
    watch = subprocess.Popen([sys.executable, str(REPO / "scripts" / "cpu_by_process.py")], stdout=subprocess.PIPE,
                             text=True)
    time.sleep(0.5)  # its first look: what runs already is counted from then on
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTEST_CURRENT_TEST": "tests/test_made_up.py::test_busy (call)"}
    subprocess.run([sys.executable, "-c", BUSY_RANK], env=env, check=True)
    middle = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, str(command), "checkpoint", "made_up", str(tmp_path), "--verify"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    charged = (middle.ru_utime + middle.ru_stime) - (before.ru_utime + before.ru_stime)
    charged_command = (after.ru_utime + after.ru_stime) - (middle.ru_utime + middle.ru_stime)
    time.sleep(0.5)
    watch.send_signal(signal.SIGTERM)
    out, _ = watch.communicate(timeout=30)
    assert watch.returncode == 0

    row = re.search(r"^\s*(\d+) s\s+\d+%\s+(\d+) x\s+[\d.]+ s  ranks \(train and profile workers\)$", out, re.M)
    assert row, out
    # The whole machine is watched: another pytest worker's ranks may count in the same row, never in the module's.
    # Its last look can be up to a fifth of a second before the process ends, and the table rounds to a second.
    assert int(row.group(2)) >= 1 and int(row.group(1)) >= charged - 0.7, (out, charged)
    module = re.search(r"^\s*(\d+) s  tests/test_made_up\.py$", out, re.M)
    assert module and abs(int(module.group(1)) - charged) <= 0.7, (out, charged)
    listed = re.search(r"^\s*(\d+) s\s+(\d+) x\s+[\d.]+ s  checkpoint made_up$", out, re.M)
    assert listed and int(listed.group(2)) == 1, out
    assert abs(int(listed.group(1)) - charged_command) <= 0.7, (out, charged_command)
