"""Faults at the edges (issue #45), each reproduced through the installed CLI: a full disk during a DDP save, a
read-only output directory, an interrupted consolidation or export, a preemption notice during a restart or before the
first step, restarts that run out, advice that must not loop, and what a person sees on a terminal.

Each ends in one sentence naming the cause and the way out (exit 2 for a setting, 1 for a fault, 0 for a preemption),
never a hang or a traceback, with nothing lost. The full and read-only disks are real tmpfs mounts: they need root
(CI runs as root); elsewhere those tests skip and say why, and under CI they fail instead.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import EXAMPLES, SINGLE_PROCESS_ENV, opentau_bin, own_cache, refused, run_cli, run_cli_in_process, tree
from opentau_cli.store.layout import CHECKPOINTS, METRICS, MODEL_WEIGHTS, read_last
from opentau_cli.store.manifest import read_manifest, verify_manifest

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

TINY = EXAMPLES / "pi05_tiny_config.json"
DDP = EXAMPLES / "accelerate_cpu_ddp_config.yaml"
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks


def train_args(run: Path, *extra: str) -> list[str]:
    return ["train", f"--config_path={TINY}", f"--output_dir={run}", "--validation.val_freq=0", *extra]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("Error:")]


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("."))


# Real filesystems that are full or read-only: tmpfs mounts, which need root.

def need_mounts(what: str) -> None:
    reason = None
    if os.geteuid() != 0:
        reason = f"{what} is a real tmpfs mount, which needs root (CI runs as root)"
    elif shutil.which("mount") is None:
        reason = f"{what} is a real tmpfs mount, and this machine has no mount command"
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@contextmanager
def tmpfs(path: Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode:
        reason = f"cannot mount a tmpfs at {path}: {mounted.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# 1. A full disk during a save: every rank stops at once with the same sentence; the previous checkpoint stays `last`.

@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    """A DDP run on a 30 MB disk: its checkpoint of step 2 (18 MB) fits, the one of step 4 does not. Rank 0's
    optimizer state hits the full disk while rank 1's part is written (the ranks' collectives used to disagree there:
    a silent hang for distributed.timeout_minutes). The launcher's message is the same for one process or
    asynchronous saves (tests/test_async_save.py holds their sentence)."""
    need_mounts("a full disk")
    tmp = tmp_path_factory.mktemp("full_disk")
    with tmpfs(tmp / "small", "size=30m") as small:
        run = small / "run"
        result = run_cli(train_args(run, "--steps=4", "--save_freq=2", "--log_freq=1", f"--accelerate-config={DDP}"),
                         env={"HF_HOME": str(tmp / "hf_home")}, timeout=300)
        ckpts = run / CHECKPOINTS
        yield {"result": result, "disk": small, "run": run, "names": sorted(p.name for p in ckpts.iterdir()),
               "last": read_last(ckpts), "sound": verify_manifest(ckpts / "000002"),
               "rank_errors": {log.name: error_lines(log.read_text()) for log in run.glob("logs/*/rank*.log")}}


def test_a_full_disk_during_a_save_stops_every_rank_with_one_sentence_naming_the_disk_and_keeps_last(full_disk):
    result, run = full_disk["result"], full_disk["run"]
    assert result.returncode == 1, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = lines[0]
    assert line.count("Error:") == 1 and ".." not in line, line
    for needle in ("step 4", "the disk is full", str(full_disk["disk"]), "MB free", "needs about",
                   "000002 is intact and stays `last`", f"`opentau resume {run}`", "Full log:"):
        assert needle in line, (needle, line)
    # Every rank stopped on the same sentence, not on a peer's lost connection or a timeout.
    said = full_disk["rank_errors"]
    assert sorted(said) == ["rank0.log", "rank1.log"] and all(len(errors) == 1 for errors in said.values()), said
    assert len({errors[0] for errors in said.values()}) == 1, said
    # Nothing lost: the previous checkpoint is whole and `last`; no half-written save is left.
    assert full_disk["names"] == ["000002", "last"] and full_disk["last"] == "000002"
    assert full_disk["sound"] == []


# 2. A read-only output directory is refused before anything starts.

def test_a_read_only_output_directory_is_refused_by_validate_and_by_train_in_one_sentence(tmp_path):
    need_mounts("a read-only filesystem")
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        validated = run_cli_in_process(["config", "validate", str(TINY), f"--output_dir={ro / 'run'}"])
        refused(validated, f"{ro / 'run'}", "read-only", "--output_dir")
        trained = run_cli(train_args(ro / "run", "--steps=2"), env=SINGLE_PROCESS_ENV)
        refused(trained, f"{ro / 'run'}", "read-only", "--output_dir")
        assert not list(ro.iterdir())


# 3. An interrupted in-place consolidation never leaves the checkpoint worse; the next run repairs it.

def run_in_terminal(args: list[str], env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    """Run the installed CLI with a pseudo-terminal as its stdin, stdout and stderr (what a person sees)."""
    master, slave = pty.openpty()
    full_env = {**os.environ, "COLUMNS": "120", **(env or {})}
    full_env.pop("OPENTAU_DEBUG", None)
    proc = subprocess.Popen([opentau_bin(), *args], stdin=slave, stdout=slave, stderr=slave, env=full_env, close_fds=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal closed: every process on it is gone
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def consolidate_killed(ckpt: Path, point: str, tmp: Path):
    return run_cli(["checkpoint", "consolidate", str(ckpt)], env={"PYTHONPATH": str(HOOKS),
                                                                   "TEST_KILL_POINT": point, "HF_HOME": str(tmp / "hf")})


@pytest.fixture(scope="module")
def consolidations(zero3_reference, tmp_path_factory):
    """Copies of the shared ZeRO-3 run whose newest checkpoint is consolidated in place and killed: SIGKILL while
    the weights are written, SIGTERM then, and SIGKILL once the manifest vouches for them but before they have their
    final name."""
    tmp = tmp_path_factory.mktemp("consolidate_killed")
    out = {}
    for case, point in (("kill_writing", "tensor_written"), ("term_writing", "tensor_written:SIGTERM"),
                        ("kill_vouched", "vouched")):
        run = tmp / case
        shutil.copytree(zero3_reference, run, symlinks=True)
        ckpt = run / CHECKPOINTS / "000006"
        out[case] = {"run": run, "ckpt": ckpt, "killed": consolidate_killed(ckpt, point, tmp), "left": hidden(ckpt)}
    return tmp, out


def test_a_consolidation_killed_while_writing_leaves_a_sound_checkpoint_and_the_next_run_repairs_it(consolidations):
    tmp, cases = consolidations
    case = cases["kill_writing"]
    ckpt = case["ckpt"]
    assert case["killed"].returncode == -signal.SIGKILL
    assert [n for n in case["left"] if n.startswith(f".{MODEL_WEIGHTS}.tmp-")], case["left"]
    assert not (ckpt / MODEL_WEIGHTS).exists()
    verified = run_cli_in_process(["checkpoint", "verify", str(case["run"])])
    assert verified.returncode == 0, verified.stdout  # never worse than before: a leftover is not content
    # The same command again, on a terminal: removes the leftover, writes, vouches, and shows its progress in MB.
    code, shown = run_in_terminal(["checkpoint", "consolidate", str(ckpt)], env={"HF_HOME": str(tmp / "hf")})
    assert code == 0, shown
    assert "left by an interrupted consolidation" in shown and " MB" in shown and " of " in shown, shown
    assert hidden(ckpt) == [] and MODEL_WEIGHTS in read_manifest(ckpt)["files"]
    assert verify_manifest(ckpt) == []
    with safe_open(str(ckpt / MODEL_WEIGHTS), framework="pt") as f:
        assert f.metadata()["producer"] == "opentau checkpoint consolidate" and len(list(f.keys())) > 100


def test_a_consolidation_stopped_by_sigterm_says_so_and_leaves_nothing_behind(consolidations):
    _, cases = consolidations
    case = cases["term_writing"]
    result = case["killed"]
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines() == [
        "Stopped by SIGTERM before it finished; run the same command again to complete it."], result.stderr
    assert case["left"] == [] and not (case["ckpt"] / MODEL_WEIGHTS).exists()
    assert verify_manifest(case["ckpt"]) == []


def test_a_consolidation_killed_after_the_manifest_vouched_is_restored_by_resume_itself(consolidations):
    tmp, cases = consolidations
    case = cases["kill_vouched"]
    ckpt, run = case["ckpt"], case["run"]
    assert case["killed"].returncode == -signal.SIGKILL
    assert MODEL_WEIGHTS in read_manifest(ckpt)["files"] and not (ckpt / MODEL_WEIGHTS).exists()
    # `opentau resume` is the first command to look: it finds the run resumable (a --steps it has reached: the plan
    # runs in full and nothing is launched), having put the vouched file in its place.
    resumed = run_cli_in_process(["resume", str(run), "--steps=6"], env={"OPENTAU_CACHE_DIR": own_cache(tmp / "cache")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Nothing to do" in resumed.stderr
    assert (ckpt / MODEL_WEIGHTS).is_file() and hidden(ckpt) == [] and verify_manifest(ckpt) == []
    again = run_cli_in_process(["checkpoint", "consolidate", str(ckpt)])
    assert again.returncode == 0 and "already consolidated" in again.stdout, again.stdout + again.stderr


# 7. A killed export leaves no hidden directory behind for good.

def test_a_killed_export_leaves_a_leftover_that_the_next_run_of_the_command_removes(ddp_reference, tmp_path):
    out = tmp_path / "exported" / "pi05"
    killed = run_cli(["checkpoint", "export", str(ddp_reference), "--output", str(out)],
                     env={"PYTHONPATH": str(HOOKS), "TEST_KILL_POINT": "tensor_written"})
    assert killed.returncode == -signal.SIGKILL
    left = hidden(out.parent)
    assert len(left) == 1 and left[0].startswith(".pi05.tmp-") and not out.exists(), left
    again = run_cli_in_process(["checkpoint", "export", str(ddp_reference), "--output", str(out)])
    assert again.returncode == 0, again.stderr
    assert hidden(out.parent) == [] and (out / MODEL_WEIGHTS).is_file()


# 4 and 5. Restarts: a preemption notice during one is honoured; when they run out, the rank that died is named.

def test_a_preemption_notice_during_an_automatic_restart_stops_the_run_with_exit_0_and_records_the_restart(tmp_path):
    run, times = tmp_path / "run", tmp_path / "fault_times.jsonl"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": str(HOOKS), "TEST_FAULT": "kill@3:0",
           "TEST_FAULT_RANK": "1", "TEST_FAULT_TIMES": str(times)}
    env.pop("OPENTAU_DEBUG", None)
    proc = subprocess.Popen([opentau_bin(), *train_args(run, f"--accelerate-config={DDP}", "--steps=400", "--save_freq=2",
                                                         "--log_freq=1", "--max-restarts=3")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (times.is_file() and '"kill"' in times.read_text()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(2.5)  # the agent is restarting the group: the new ranks are starting up
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Training failed" not in stderr and "Traceback" not in stderr
    # Honoured: saved (the new group had begun) or stopped (nothing trained since `last`), never trained on.
    said = [line for line in (stdout + stderr).splitlines()
            if line.startswith(("Stopped by SIGTERM during restart 1, before training resumed", "Preempted: saved step"))]
    assert len(said) == 1, stdout[-3000:] + stderr[-3000:]
    records = [json.loads(line) for line in (run / "logs" / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["rank"], r["failed_at_step"]) for r in records] == [(1, 1, 3)], records
    steps = [json.loads(line)["step"] for line in (run / METRICS).read_text().splitlines()]
    assert max(steps) < 20, steps
    verified = run_cli_in_process(["checkpoint", "verify", str(run)])
    assert verified.returncode == 0, verified.stdout


def test_when_restarts_run_out_the_error_names_the_rank_that_died_and_every_end_is_recorded(tmp_path):
    run = tmp_path / "run"
    result = run_cli(train_args(run, f"--accelerate-config={DDP}", "--steps=4", "--save_freq=1", "--log_freq=1",
                                "--max-restarts=1"),
                     env={"HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": str(HOOKS),
                          "TEST_FAULT": "kill@2:0,kill@3:1", "TEST_FAULT_RANK": "1"})
    assert result.returncode == 1, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = lines[0]
    assert line.startswith("Error: Training failed after 1 restart: rank 1 on machine 0 was killed"), line
    assert line.endswith("/rank1.log") and "Connection" not in line and "gloo" not in line, line
    records = [json.loads(x) for x in (run / "logs" / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r.get("final", False), r["rank"], r["failed_at_step"]) for r in records] == [
        (1, False, 1, 2), (None, True, 1, 3)]
    assert all(r["cause"].startswith("rank 1 on machine 0 was killed") for r in records), records
    inspected = run_cli_in_process(["checkpoint", "inspect", str(run)])
    assert inspected.returncode == 0
    shown = [line for line in inspected.stdout.splitlines() if line.startswith(("restart 1:", "ended:"))]
    assert len(shown) == 2 and "no restart left" in shown[1], inspected.stdout


# 6. SIGTERM before the first step: said so, exit 0, at any moment of the start.

def catching_sigterm(pid: int, timeout: float = 120) -> None:
    """Wait until process `pid` has a SIGTERM handler (the SigCgt mask of /proc/PID/status): on a loaded machine the
    interpreter's own start-up, before the command's first line, can take longer than any fixed sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} set no SIGTERM handler within {timeout:g} s")


@pytest.mark.parametrize("moment", ["importing", "planning", "ranks_starting"])
def test_a_preemption_notice_before_the_first_step_stops_with_exit_0_and_says_training_had_not_begun(tmp_path, moment):
    run = tmp_path / "run"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), **SINGLE_PROCESS_ENV}
    env.pop("OPENTAU_DEBUG", None)
    proc = subprocess.Popen([opentau_bin(), *train_args(run, "--steps=50", "--log_freq=1")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    if moment in ("importing", "planning"):  # before the launch: the command imports, then builds and checks the plan
        catching_sigterm(proc.pid)  # from its first line of code on (the interpreter's start-up before it is not ours)
        time.sleep(0 if moment == "importing" else 1.5)
    else:  # the launch has begun: its ranks import and build the policy
        while "Logs:" not in seen and proc.poll() is None:
            seen += proc.stderr.readline()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    stderr = seen + stderr
    assert proc.returncode == 0, stderr[-3000:]
    assert "Training failed" not in stderr and "Traceback" not in stderr and "Error:" not in stderr, stderr[-3000:]
    said = [line for line in (stdout + stderr).splitlines() if line.startswith("Stopped by SIGTERM before training began")]
    assert len(said) == 1, stdout + stderr
    assert not (run / CHECKPOINTS).exists() or not any((run / CHECKPOINTS).iterdir())


# 8. Advice is never the command just run; a refusal with a way out names it.

def test_a_resume_refused_for_a_broken_newest_checkpoint_names_the_way_out_and_the_way_works(ddp_reference, tmp_path):
    no_manifest, corrupt = tmp_path / "no_manifest", tmp_path / "corrupt"
    for run in (no_manifest, corrupt):
        shutil.copytree(ddp_reference, run, symlinks=True)
    (no_manifest / CHECKPOINTS / "000006" / "manifest.json").unlink()
    weights = corrupt / CHECKPOINTS / "000006" / MODEL_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    env = {"OPENTAU_CACHE_DIR": own_cache(tmp_path / "cache")}

    before = tree(no_manifest)
    result = run_cli_in_process(["resume", str(no_manifest)], env=env)
    refused(result, "--rollback=true", "000006", "fail their manifests")
    assert f"`opentau resume {no_manifest}`" not in result.stderr  # the command just run
    assert tree(no_manifest) == before

    result = run_cli_in_process(["resume", str(corrupt)], env=env)
    advised = f"opentau resume {corrupt / CHECKPOINTS / '000003'} --rollback=true"
    refused(result, "000006", "content hash differs", advised)
    # The advice is accepted (a --steps the checkpoint has reached: planned in full, nothing launched or moved).
    followed = run_cli_in_process([*advised.split()[1:], "--steps=3"], env=env)
    assert followed.returncode == 0 and "Nothing to do" in followed.stderr, followed.stderr


# 9. On a terminal: progress lines only, typos that suggest the command's own options, progress with totals, a plot of
# the curves; and a local dataset rewritten under its root is not resumed without a word.

@pytest.fixture(scope="module")
def on_terminal(tmp_path_factory):
    """A run on a local dataset, trained on a terminal (4 steps, a record, a validation and a save every 2)."""
    tmp = tmp_path_factory.mktemp("terminal")
    data, run = tmp / "reach", tmp / "run"
    made = run_cli_in_process(["dataset", "synth", str(data), "--episodes", "6", "--steps-per-episode", "20"])
    assert made.returncode == 0, made.stderr
    env = {"HF_HOME": str(tmp / "hf_home"), **SINGLE_PROCESS_ENV}
    code, shown = run_in_terminal(train_args(run, f"--dataset.root={data}", "--steps=4", "--save_freq=2", "--log_freq=1",
                                             "--validation.val_freq=2", "--validation.val_split=0.34"), env=env)
    assert code == 0, shown[-3000:]
    return {"tmp": tmp, "data": data, "run": run, "shown": shown, "env": env}


def test_a_terminal_shows_progress_lines_never_the_json_records_which_stay_in_metrics(on_terminal):
    shown, run = on_terminal["shown"], on_terminal["run"]
    assert '"kind"' not in shown and '{"' not in shown, shown[-3000:]
    assert "4/4" in shown and "Saved checkpoint" in shown
    records = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["kind"] == "val"] == [2, 4]


def test_inspect_plot_draws_the_loss_and_learning_rate_curves_to_a_png(on_terminal, tmp_path):
    import matplotlib.image

    png = tmp_path / "curves.png"
    result = run_cli_in_process(["checkpoint", "inspect", str(on_terminal["run"]), "--plot", str(png)])
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[:2] == (600, 800)
    inside = run_cli_in_process(["checkpoint", "inspect", str(on_terminal["run"]), "--plot", str(on_terminal["run"] / "c.png")])
    refused(inside, "lies inside the run")


def test_mistyped_options_suggest_the_commands_own_options(on_terminal):
    run = str(on_terminal["run"])
    for args, meant in ((["eval", run, "--stide", "2"], "--stride"), (["serve", run, "--prot", "8001"], "--port"),
                        (["eval", run, "--episode", "1"], "--episodes")):
        refused(run_cli_in_process(args), f"did you mean {meant}?")


def test_eval_and_export_show_progress_with_totals_and_options_take_underscores(on_terminal, tmp_path):
    env = on_terminal["env"]
    code, shown = run_in_terminal(["eval", str(on_terminal["run"]), "--plot_episodes", "1", "--output",
                                   str(tmp_path / "eval")], env=env)
    assert code == 0, shown[-3000:]
    assert "evaluating" in shown and " chunks" in shown and " of " in shown, shown[-3000:]
    assert (tmp_path / "eval" / "eval.png").is_file()
    code, shown = run_in_terminal(["checkpoint", "export", str(on_terminal["run"]), "--output", str(tmp_path / "model")], env=env)
    assert code == 0, shown[-3000:]
    assert "exporting" in shown and " MB" in shown and " of " in shown, shown[-3000:]


def test_a_local_dataset_rewritten_under_its_root_is_refused_on_resume_unless_the_user_says_so(on_terminal):
    run, data, env = on_terminal["run"], on_terminal["data"], {"HF_HOME": str(on_terminal["tmp"] / "hf_home")}
    same = run_cli_in_process(["resume", str(run), "--steps=4"], env=env)
    assert same.returncode == 0 and "Nothing to do" in same.stderr, same.stderr
    rewritten = run_cli_in_process(["dataset", "synth", str(data), "--episodes", "6", "--steps-per-episode", "20",
                                    "--seed", "1", "--force"])
    assert rewritten.returncode == 0, rewritten.stderr
    before = tree(run)
    result = run_cli_in_process(["resume", str(run), "--steps=6"], env=env)
    refused(result, str(data), "changed since checkpoint 000004", "--dataset-changed=true")
    assert tree(run) == before
    accepted = run_cli_in_process(["resume", str(run), "--steps=4", "--dataset-changed=true"], env=env)
    assert accepted.returncode == 0 and "resuming on it as it is now" in accepted.stderr, accepted.stderr
