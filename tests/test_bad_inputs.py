"""Every malformed input a user can type is refused the same way: exit code 2, one line on stderr (never a
traceback), and nothing on disk changed, neither the output directory nor anything else in the working directory.

The table `CASES` holds one line per input: a name, the `opentau` arguments (run in a scratch directory, which is
also the working directory, so a relative `--output_dir=run` or a folder named `true` would land in it), the words the
one line must hold, and what the scratch directory must hold first (`setup`) and the environment (`env`). Adding a
case is adding a line; `setup` helpers below build the usual ingredients (a file, an Accelerate YAML, a dataset).
A case that refuses before launch runs in this process (`run_cli_in_process`); one that needs a live run is a test
of its own below the table.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from conftest import EXAMPLES, run_cli, run_cli_in_process, refused, tree

pytestmark = pytest.mark.full

TINY = str(EXAMPLES / "pi05_tiny_config.json")
CPU_DDP = EXAMPLES / "accelerate_cpu_ddp_config.yaml"


# --- what a case's scratch directory holds before the command (each returns a setup function) ---

def file(name: str, content: str | bytes) -> Callable[[Path], None]:
    """A file `name` holding `content`."""
    def setup(work: Path) -> None:
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def folder(name: str) -> Callable[[Path], None]:
    return lambda work: (work / name).mkdir(parents=True)


def accelerate(name: str, **changes) -> Callable[[Path], None]:
    """The CPU DDP example Accelerate YAML with `changes`, as `name`."""
    def setup(work: Path) -> None:
        raw = yaml.safe_load(CPU_DDP.read_text())
        raw.update(changes)
        (work / name).write_text(yaml.safe_dump(raw))
    return setup


def truncated_parquet(name: str = "data", episode: int = 1) -> Callable[[Path], None]:
    """A small LeRobot v2.1 dataset `name` whose `episode`'s parquet file lost its second half (a copy cut short)."""
    def setup(work: Path) -> None:
        from opentau_cli.data import write_synth

        root = write_synth(work / name, episodes=3, steps_per_episode=8, seed=1)
        data = root / "data" / "chunk-000" / f"episode_{episode:06d}.parquet"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return setup


FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints" / "v2"


def fixture_run(name: str = "run", kind: str = "single", archived: bool = False) -> Callable[[Path], None]:
    """A copy of a committed fixture run (checkpoints/000002, `last`, metrics.jsonl) as `name`; `archived` adds a
    rollback's archive of its checkpoint (rolled_back/T/checkpoints/000002) and a loose copy of it (loose/000002)."""
    def setup(work: Path) -> None:
        import shutil

        shutil.copytree(FIXTURES / kind / "run", work / name, symlinks=True)
        if archived:
            shutil.copytree(work / name / "checkpoints" / "000002", work / name / "rolled_back" / "T" / "checkpoints" / "000002")
            shutil.copytree(work / name / "checkpoints" / "000002", work / "loose" / "000002")
    return setup


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]  # `opentau ARGS`; {tiny} is the tiny example config
    says: str  # what the one line on stderr holds
    setup: Callable[[Path], None] | None = None
    env: dict = field(default_factory=dict)


TRAIN = ("train", f"--config_path={TINY}", "--output_dir=run")  # a fresh run into ./run, which must not appear
CASES = [
    # A flag without a value is not `true` (only a bool field may be given bare).
    Case("steps-without-value", (*TRAIN, "--steps"), "--steps needs a value: --steps=VALUE or --steps VALUE."),
    Case("steps-without-value-before-another-flag", (*TRAIN, "--steps", "--log_freq=1"), "--steps needs a value"),
    Case("output-dir-without-value", ("train", f"--config_path={TINY}", "--steps=1", "--output_dir"), "--output_dir needs a value"),
    Case("chunk-size-without-value", (*TRAIN, "--policy.chunk_size", "--steps=1"), "--policy.chunk_size needs a value"),
    Case("output-dir-empty", ("train", f"--config_path={TINY}", "--output_dir="), "--output_dir is empty"),
    Case("section-without-value", (*TRAIN, "--policy"), "--policy needs a value"),
    # The Accelerate YAML's launch shape.
    Case("num-processes-0", (*TRAIN, "--accelerate-config=zero.yaml"), "'num_processes' must be 1 or more, got 0",
         accelerate("zero.yaml", num_processes=0)),
    Case("num-processes-negative", (*TRAIN, "--accelerate-config=neg.yaml"), "'num_processes' must be 1 or more, got -1",
         accelerate("neg.yaml", num_processes=-1)),
    Case("num-machines-0", (*TRAIN, "--accelerate-config=m0.yaml"), "'num_machines' must be 1 or more, got 0",
         accelerate("m0.yaml", num_machines=0)),
    Case("num-machines-0-flag", (*TRAIN, f"--accelerate-config={CPU_DDP}", "--num_machines=0"), "--num_machines must be 1 or more"),
    Case("negative-restarts", (*TRAIN, "--max-restarts=-1"), "distributed.max_restarts: Input should be greater than or equal to 0"),
    Case("zero-hang-timeout", (*TRAIN, "--distributed.timeout_minutes=0"), "distributed.timeout_minutes: Input should be greater than 0"),
    Case("machines-min-above-max", (*TRAIN, "--distributed.machines=3:2", "--max-restarts=1"),
         "distributed.machines: must be MIN:MAX, two whole numbers with 1 <= MIN <= MAX"),
    Case("machines-not-a-range", (*TRAIN, "--distributed.machines=two", "--max-restarts=1"),
         "distributed.machines: must be MIN:MAX, two whole numbers with 1 <= MIN <= MAX"),
    Case("machines-max-above-num-machines", (*TRAIN, "--accelerate-config=two.yaml", "--distributed.machines=1:3",
                                             "--max-restarts=1"),
         "distributed.machines 1:3 needs --num_machines 3 (the most machines; the YAML's num_processes is for them all), got 2",
         accelerate("two.yaml", num_processes=2, num_machines=2, main_process_ip="10.0.0.1")),
    Case("machines-without-rendezvous-endpoint", (*TRAIN, "--accelerate-config=two.yaml", "--distributed.machines=1:2",
                                                  "--max-restarts=1"),
         "num_machines > 1 needs the address of machine 0: main_process_ip",
         accelerate("two.yaml", num_processes=2, num_machines=2)),
    Case("machines-without-restarts", (*TRAIN, "--accelerate-config=two.yaml", "--distributed.machines=1:2"),
         "distributed.machines 1:2 needs distributed.max_restarts of 1 or more",
         accelerate("two.yaml", num_processes=2, num_machines=2, main_process_ip="10.0.0.1")),
    Case("machines-leaving-fsdp2-one-process", (*TRAIN, "--accelerate-config=fsdp.yaml", "--distributed.machines=1:2",
                                                "--max-restarts=1"),
         "distributed.machines 1:2 lets the run go on with 1 process, which FSDP2 cannot shard over",
         accelerate("fsdp.yaml", num_processes=2, num_machines=2, main_process_ip="10.0.0.1", distributed_type="FSDP",
                    fsdp_config={"fsdp_version": 2})),
    Case("machines-global-batch-does-not-divide", (*TRAIN, "--accelerate-config=three.yaml", "--batch_size=1",
                                                   "--distributed.machines=2:3", "--max-restarts=1"),
         "distributed.machines 2:3 lets the run go on with 2 machines (2 processes), over which the global batch of 3 "
         "does not divide", accelerate("three.yaml", num_processes=3, num_machines=3, main_process_ip="10.0.0.1")),
    Case("fewer-processes-than-machines", (*TRAIN, "--accelerate-config=few.yaml"), "must be a multiple of num_machines (2)",
         accelerate("few.yaml", num_processes=1, num_machines=2, main_process_ip="10.0.0.1")),
    Case("processes-not-divisible-by-machines", (*TRAIN, "--accelerate-config=odd.yaml"), "num_processes (3) is the total",
         accelerate("odd.yaml", num_processes=3, num_machines=2, main_process_ip="10.0.0.1")),
    Case("accelerate-config-not-utf8", (*TRAIN, "--accelerate-config=lat.yaml"), "is not UTF-8 text (byte 0xe9",
         file("lat.yaml", "distributed_type: MULTI_CPU\nnum_processes: 2\n# caf\xe9\n".encode("latin-1"))),
    Case("accelerate-config-is-a-directory", (*TRAIN, "--accelerate-config=accel"), "is a directory; pass a YAML file",
         folder("accel")),
    # output_dir that cannot be a directory.
    Case("output-dir-inside-a-file", ("train", f"--config_path={TINY}", "--output_dir=notes.txt/run"),
         "output_dir '{work}/notes.txt/run' cannot be created: '{work}/notes.txt' is a file", file("notes.txt", "x")),
    Case("output-dir-is-a-file", ("train", f"--config_path={TINY}", "--output_dir=notes.txt"),
         "output_dir '{work}/notes.txt' is a file: pick another --output_dir.", file("notes.txt", "x")),
    Case("output-dir-is-a-file-with-overwrite", ("train", f"--config_path={TINY}", "--output_dir=notes.txt", "--overwrite"),
         "output_dir '{work}/notes.txt' is a file", file("notes.txt", "x")),
    # Config files that cannot be read.
    Case("config-not-utf8", ("train", "--config_path=latin1.json", "--output_dir=run"), "is not UTF-8 text (byte 0xe9",
         file("latin1.json", '{"steps": 4, "logging": {"run_name": "caf\xe9"}}'.encode("latin-1"))),
    Case("config-is-a-directory", ("train", "--config_path=conf", "--output_dir=run"), "is a directory; pass a JSON file",
         folder("conf")),
    Case("config-validate-not-utf8", ("config", "validate", "latin1.json"), "is not UTF-8 text",
         file("latin1.json", b'{"steps": 4, "output_dir": "\xff"}')),
    Case("config-show-a-directory", ("config", "show", "conf"), "is a directory", folder("conf")),
    # A bad value names where it came from.
    Case("bad-value-from-the-command-line", (*TRAIN, "--steps=lots"), "Invalid config from --steps: steps: Input should be a valid integer"),
    Case("bad-value-from-the-environment", TRAIN, "Invalid config from OPENTAU_STEPS: steps:", env={"OPENTAU_STEPS": "lots"}),
    Case("bad-value-from-the-file", ("train", "--config_path=c.json", "--output_dir=run"), "Invalid config in c.json: steps:",
         file("c.json", '{"steps": "lots"}')),
    Case("env-list-not-json", TRAIN, "OPENTAU_POLICY__IMAGE_RESOLUTION='[3' is not valid JSON",
         env={"OPENTAU_POLICY__IMAGE_RESOLUTION": "[3"}),
    Case("env-section-not-json", TRAIN, "OPENTAU_POLICY='chunk_size=4' is not valid JSON", env={"OPENTAU_POLICY": "chunk_size=4"}),
    # A tracker without the setting it needs: refused before launch, not by MLflow after it.
    Case("mlflow-without-tracking-uri", (*TRAIN, "--logging.trackers=mlflow"), "MLFLOW_TRACKING_URI is not set",
         env={"MLFLOW_TRACKING_URI": ""}),
    # Damaged data the selected episodes read: refused before launch, naming the file.
    Case("truncated-parquet", (*TRAIN, "--dataset.root=data"),
         "{work}/data/data/chunk-000/episode_000001.parquet is truncated or damaged", truncated_parquet()),
    # best_metric: a key validation reports for this config (with the EMA, ema_val_*).
    Case("best-metric-typo", (*TRAIN, "--checkpoint.keep_best=2", "--checkpoint.best_metric=val_los"),
         "checkpoint.best_metric 'val_los' is not a validation key of this run: did you mean 'val_loss'?"),
    Case("best-metric-typo-without-keep-best", (*TRAIN, "--checkpoint.best_metric=val_los"), "did you mean 'val_loss'?"),
    Case("best-metric-ema-without-ema", (*TRAIN, "--checkpoint.keep_best=2", "--checkpoint.best_metric=ema_val_loss"),
         "checkpoint.best_metric 'ema_val_loss' is reported only with the EMA of the weights (ema.decay > 0)"),
    # Empty paths are not the working directory.
    Case("tokenizer-path-empty", (*TRAIN, "--policy.tokenizer_path="), "--policy.tokenizer_path is empty"),
    Case("pretrained-path-empty", (*TRAIN, "--policy.pretrained_path="), "--policy.pretrained_path is empty"),
    Case("tokenizer-path-empty-in-env", TRAIN, "policy.tokenizer_path: is empty", env={"OPENTAU_POLICY__TOKENIZER_PATH": ""}),
    Case("tokenizer-path-empty-in-config-file", ("train", "--config_path=c.json", "--output_dir=run"),
         "policy.tokenizer_path: is empty", file("c.json", '{"policy": {"preset": "pi05_tiny", "tokenizer_path": ""}}')),
    # An output never overlaps a run, --force or not (each run file and the last link hashed unchanged).
    *[Case(f"{command[1] if command[0] == 'checkpoint' else command[0]}-into-{label}{'-force' if force else ''}",
           (*command, "--output", target, *(["--force"] if force else [])), says, fixture_run())
      for command in (("checkpoint", "export", "run"), ("eval", "run", "--device", "cpu"))
      for target, label, says in (("run", "its-run", "is the run"), ("run/checkpoints/000002", "a-checkpoint", "is the checkpoint"),
                                  ("run/checkpoints/last", "last", "is the checkpoint"),
                                  ("run/checkpoints", "checkpoints", "is the checkpoints folder"),
                                  ("run/exports/model", "inside-the-run", "lies inside the run"),
                                  (".", "the-runs-parent", "contains the run"))
      for force in (False, True)],
    Case("consolidate-into-its-run", ("checkpoint", "consolidate", "z/checkpoints/000002", "--output", "z", "--force"),
         "is the run", fixture_run("z", "zero2")),
    Case("synth-into-checkpoints", ("dataset", "synth", "run/checkpoints", "--force"), "is the checkpoints folder", fixture_run()),
    Case("synth-over-a-folder-it-did-not-write", ("dataset", "synth", "mine", "--force"),
         "already exists and was not written by `opentau dataset synth`", file("mine/notes.txt", "x")),
    # Archives stay archives: never resumed, never written.
    Case("resume-an-archived-checkpoint", ("resume", "run/rolled_back/T/checkpoints/000002"), "was moved aside by a rollback",
         fixture_run(archived=True)),
    Case("resume-true-an-archived-checkpoint", ("train", "--config_path=run/rolled_back/T/checkpoints/000002/train_config.json",
                                                "--resume=true"), "was moved aside by a rollback", fixture_run(archived=True)),
    Case("resume-a-loose-checkpoint", ("resume", "loose/000002"), "is not in a run's checkpoints/ folder", fixture_run(archived=True)),
    Case("train-into-an-archive", ("train", f"--config_path={TINY}", "--output_dir=run/rolled_back/T", "--overwrite=true"),
         "lies in the rollback archive of", fixture_run(archived=True)),
    Case("train-into-a-checkpoint", ("train", f"--config_path={TINY}", "--output_dir=run/checkpoints/000002/sub"),
         "lies inside the checkpoint", fixture_run()),
]




def assert_refused(result, says: str) -> None:
    """Exit 2, and stderr is exactly one line, `Error: ...` holding `says`."""
    refused(result, says)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_malformed_input_is_one_line_exit_2_and_changes_nothing_on_disk(case, tmp_path, isolated_env):
    work = tmp_path / "work"
    work.mkdir()
    if case.setup is not None:
        case.setup(work)
    before = tree(work)
    result = run_cli_in_process(list(case.args), env=case.env, cwd=work)
    assert_refused(result, case.says.format(work=work))
    assert tree(work) == before


@pytest.mark.parametrize("args, says", [
    (["train", f"--config_path={TINY}", "--num_machines=abc"], "Invalid value for '--num_machines'"),
    (["config", "validate"], "Missing argument 'config'"),
    (["resume", "run", "--reshard"], "--reshard"),
], ids=["not-an-integer", "missing-argument", "option-without-value"])
def test_a_usage_error_the_parser_finds_is_one_line_through_the_console_script(args, says, tmp_path):
    """The mistakes Typer's parser finds before any opentau code runs (the console script, a real process)."""
    result = run_cli(args, cwd=tmp_path)
    assert_refused(result, says)
    assert list(tmp_path.iterdir()) == []


def test_the_table_names_each_case_once():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


# --- a second resume while a run lives in the directory ---

@pytest.fixture
def live_run(ddp_reference, tmp_path, isolated_env):
    """A copy of the shared reference run (checkpoints 000003 and 000006) whose lock a live process holds."""
    import shutil

    run = tmp_path / "work" / "run"
    shutil.copytree(ddp_reference, run, symlinks=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from opentau_cli.process import runlock; runlock.acquire(sys.argv[1]); print('held', flush=True); "
        "time.sleep(600)"), str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield run, holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


@pytest.mark.parametrize("target, args", [
    ("checkpoints/000003", []),  # older than the newest: the history check would advise --rollback=true
    ("", []),  # the run itself: refused before the plan is printed, in one line
    ("", ["--overwrite=true"]),  # train --resume=false --overwrite into it: nothing removed
], ids=["older-checkpoint", "the-run", "train-overwrite"])
def test_a_second_launch_into_a_live_run_is_one_line_naming_the_lock(live_run, target, args):
    """While a run saves, its newest checkpoint may not be `last` yet: a second resume must say the run is live
    (as the launch would), not recommend --rollback=true, which would move the live run's checkpoints."""
    run, pid = live_run
    before = tree(run.parent)
    if args:
        command = ["train", f"--config_path={run / 'checkpoints' / '000006' / 'train_config.json'}", f"--output_dir={run}", *args]
    else:
        command = ["resume", str(run / target)]
    result = run_cli_in_process(command, cwd=run.parent)
    assert_refused(result, f"Run directory '{run}' is in use by a live run (pid {pid} on ")
    assert "rollback" not in result.stderr
    assert tree(run.parent) == before


def test_each_bad_value_names_its_own_origin(tmp_path):
    """Values from the file, the environment and the command line in one config: each problem says where it came from."""
    from opentau_cli.config.load import load_config
    from opentau_cli.errors import UserError

    config = tmp_path / "c.json"
    config.write_text('{"steps": "lots", "policy": {"chunk_size": 4}}')
    with pytest.raises(UserError) as err:
        load_config(config, ["--save_freq=0"], environ={"OPENTAU_LOG_FREQ": "0", "OPENTAU_POLICY__CHUNK_SIZE": "0"})
    assert str(err.value).splitlines() == [
        "Invalid config:",
        f"  steps: Input should be a valid integer, unable to parse string as an integer (got 'lots') [in {config}]",
        "  log_freq: Input should be greater than or equal to 1 (got '0') [from OPENTAU_LOG_FREQ]",
        "  save_freq: Input should be greater than or equal to 1 (got 0) [from --save_freq]",
        "  policy.chunk_size: Input should be greater than or equal to 1 (got '0') [from OPENTAU_POLICY__CHUNK_SIZE]",
    ]
