"""One run at a time in a run directory: a live run's lock refuses a second launch (exit 2, naming it, nothing
written); a lock left by a SIGKILLed run, or by another host whose heartbeat stopped, never blocks the next one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import EXAMPLES
from opentau_cli.errors import UserError
from opentau_cli.process import runlock
from opentau_cli.store.layout import METRICS

pytestmark = pytest.mark.quick


def test_a_live_runs_lock_refuses_a_second_launch_naming_host_and_pid(tmp_path):
    mine = runlock.acquire(tmp_path)
    assert json.loads(runlock.lock_path(tmp_path).read_text())["pid"] == os.getpid() == mine["pid"]
    with pytest.raises(UserError, match=f"in use by a live run \\(pid {os.getpid()} on {socket.gethostname()}"):
        runlock.acquire(tmp_path)
    with pytest.raises(UserError, match="live run"):  # --break-lock never takes a lock whose holder is seen alive
        runlock.acquire(tmp_path, break_lock=True)
    runlock.release(tmp_path, mine)
    assert not runlock.lock_path(tmp_path).exists()


def test_a_lock_left_by_a_sigkilled_run_does_not_block_the_next(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from opentau_cli.process import runlock; runlock.acquire(sys.argv[1]); print('held', flush=True); "
        "time.sleep(600)"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match=f"pid {holder.pid}"):
        runlock.acquire(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert runlock.acquire(tmp_path)["pid"] == os.getpid()


def _other_hosts_lock(tmp_path, age_s: float) -> None:
    path = runlock.lock_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": "node-17.cluster", "pid": 4242, "pid_started": 0, "started": "then"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_another_hosts_lock_blocks_while_its_heartbeat_is_fresh_and_break_lock_takes_it(tmp_path):
    _other_hosts_lock(tmp_path, age_s=10)
    with pytest.raises(UserError, match="pid 4242 on node-17.cluster.*--break-lock"):
        runlock.acquire(tmp_path)
    assert runlock.acquire(tmp_path, break_lock=True)["host"] == socket.gethostname()


def test_another_hosts_lock_whose_heartbeat_stopped_is_taken_over(tmp_path):
    _other_hosts_lock(tmp_path, age_s=runlock.STALE_S + 1)
    assert runlock.acquire(tmp_path)["pid"] == os.getpid()


def test_release_leaves_a_lock_that_another_run_took_over(tmp_path):
    mine = runlock.acquire(tmp_path)
    _other_hosts_lock(tmp_path, age_s=0)
    runlock.release(tmp_path, mine)
    assert json.loads(runlock.lock_path(tmp_path).read_text())["host"] == "node-17.cluster"


def test_train_overwrite_on_a_live_run_exits_2_and_deletes_nothing(tmp_path, isolated_env, monkeypatch):
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app

    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS).write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    mine = runlock.acquire(run)  # this test process plays the live run
    r = CliRunner().invoke(app, ["train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={run}",
                                 "--overwrite=true", "--steps=2"])
    assert r.exit_code == 2, r.output
    assert f"in use by a live run (pid {os.getpid()}" in r.stderr and "Traceback" not in r.output
    assert (run / METRICS).is_file() and sorted(p.name for p in run.iterdir()) == ["logs", METRICS]
    runlock.release(run, mine)


def test_the_plans_check_refuses_as_acquire_does_and_takes_nothing(tmp_path):
    """`check_free` (the plan's: before any other refusal, process/runlock.py) says what `acquire` would, and writes nothing."""
    runlock.check_free(tmp_path)  # no lock
    assert list(tmp_path.iterdir()) == []
    mine = runlock.acquire(tmp_path)
    with pytest.raises(UserError) as planned:
        runlock.check_free(tmp_path)
    with pytest.raises(UserError) as launched:
        runlock.acquire(tmp_path)
    assert str(planned.value) == str(launched.value) and f"pid {os.getpid()}" in str(planned.value)
    runlock.release(tmp_path, mine)
    _other_hosts_lock(tmp_path, age_s=10)
    before = runlock.lock_path(tmp_path).read_text()
    with pytest.raises(UserError, match="node-17.cluster.*--break-lock"):
        runlock.check_free(tmp_path)
    runlock.check_free(tmp_path, break_lock=True)  # the launch will take it over
    _other_hosts_lock(tmp_path, age_s=runlock.STALE_S + 1)
    runlock.check_free(tmp_path)  # stale: the launch will take it over
    assert runlock.lock_path(tmp_path).read_text() == before  # never removed nor rewritten by the check


def test_a_rank_that_outlives_its_launcher_keeps_the_run_locked_until_it_is_gone(tmp_path):
    """The launcher's lock is left behind by a SIGKILL while one of its ranks still lives (it dies with the launcher
    a moment later: runtime.die_with_parent). Until that rank is gone, neither a new launch nor the plan's check takes
    the directory; then the lock and the dead rank's registration are taken over."""
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from opentau_cli.process import runlock; runlock.acquire(sys.argv[1]); print('held', flush=True); "
        "time.sleep(600)"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().strip() == "held"  # the launcher takes the lock before it starts its ranks
    rank = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from opentau_cli.process import runlock; runlock.register_rank(sys.argv[1]); print('rank', flush=True); "
        "time.sleep(600)"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "rank"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        with pytest.raises(UserError, match=f"in use by a live run \\(pid {rank.pid} on "):
            runlock.acquire(tmp_path)
        with pytest.raises(UserError, match=f"pid {rank.pid}"):
            runlock.check_free(tmp_path)
        runlock.lock_path(tmp_path).unlink()  # even without the launcher's lock file, the live rank holds the run
        with pytest.raises(UserError, match=f"pid {rank.pid}"):
            runlock.acquire(tmp_path)
    finally:
        rank.send_signal(signal.SIGKILL)
        rank.wait()
    mine = runlock.acquire(tmp_path)
    assert list(runlock.ranks_dir(tmp_path).glob("*.json")) == []
    runlock.release(tmp_path, mine)
