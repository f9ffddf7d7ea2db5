"""`config validate` refuses exactly what `train` refuses before spawning: same exit code, same words.

Both commands run in-process on the real CLI app. The machine they check for is pinned (`Machine.this`), so a case
means the same on a laptop and on a GPU box; `launch.run` is replaced by a tripwire, because every case here must be
refused before a launch (a case that got through would otherwise start a real run).
"""

from __future__ import annotations

import json
import sys
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import EXAMPLES
from opentau_cli.cli.main import app
from opentau_cli.config import Machine
from opentau_cli.data.synth import write_synth
from opentau_cli.process import launch

TINY = str(EXAMPLES / "pi05_tiny_config.json")
FULL = str(EXAMPLES / "pi05_config.json")
CPU_ZERO3 = str(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml")
DDP8 = str(EXAMPLES / "accelerate_ddp_config.yaml")
NO_GPU = Machine(cuda=False, gpus=0)
TWO_GPUS = Machine(cuda=True, gpus=2)
# pi05_config.json starts from lerobot/pi05_base and PaliGemma's tokenizer: offline, from a cache laid out for it.
pytestmark = [pytest.mark.full, pytest.mark.usefixtures("published_pi05_hub")]

YAMLS = {
    "fsdp.yaml": "distributed_type: FSDP\nnum_processes: 2\n",
    # Every fsdp_config setting FSDP2 cannot honour at once, on one process.
    "fsdp_all_wrong.yaml": ("distributed_type: FSDP\nnum_processes: 1\nfsdp_config:\n  fsdp_version: 1\n"
                            "  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n"
                            "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
                            "  fsdp_offload_params: true\n  fsdp_activation_checkpointing: true\n"),
    "fsdp2_fp16.yaml": "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: fp16\nfsdp_config:\n  fsdp_version: 2\n",
    "fp16.yaml": "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: fp16\n",
    "fp8.yaml": "distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp8\n",
    "two_machines.yaml": "distributed_type: MULTI_GPU\nnum_processes: 4\nnum_machines: 2\n",
    "three_on_two.yaml": "distributed_type: MULTI_GPU\nnum_processes: 3\nnum_machines: 2\nmain_process_ip: 127.0.0.1\n",
    "bad.yaml": "distributed_type: [unclosed\n",
}


class Case(NamedTuple):
    """A refusal: the config file and arguments of both commands, the machine they check for, modules that are absent
    (an optional dependency not installed). "{tmp}" is the test's scratch directory; a case gets a fresh
    --output_dir unless it names one."""

    id: str
    config: str
    args: list[str]
    machine: Machine = NO_GPU
    absent: tuple[str, ...] = ()

    def command_args(self, tmp) -> tuple[str, list[str]]:
        args = [a.replace("{tmp}", str(tmp)) for a in self.args]
        if not any(a.startswith("--output_dir=") for a in args):
            args.append(f"--output_dir={tmp / 'run'}")
        return self.config.replace("{tmp}", str(tmp)), args


# Every refusal `train` can make before it spawns a process.
CASES = [
    Case("missing config file", "{tmp}/missing.json", []),
    Case("malformed json", "{tmp}/bad.json", []),
    Case("unknown override key", TINY, ["--policy.chunk_sise=3"]),
    Case("stray argument", TINY, ["stray"]),
    Case("value out of range", TINY, ["--steps=0"]),
    Case("missing accelerate config", TINY, ["--accelerate-config={tmp}/none.yaml"]),
    Case("malformed accelerate config", TINY, ["--accelerate-config={tmp}/bad.yaml"]),
    Case("batch arithmetic", TINY, ["--per_device_batch_size=3"]),
    Case("n_action_steps over chunk_size", TINY, ["--policy.n_action_steps=20"]),
    Case("zero3 with gradient checkpointing", TINY, [f"--accelerate-config={CPU_ZERO3}", "--policy.gradient_checkpointing=true"]),
    Case("missing pretrained weights", TINY, ["--policy.pretrained_path={tmp}/nope.safetensors"]),
    Case("missing tokenizer", TINY, ["--policy.tokenizer_path={tmp}/no_tokenizer"]),
    Case("unknown loss term", TINY, ['--policy.loss_weighting={"l1": 1.0}']),
    Case("image size the vision tower cannot patch", TINY, ["--policy.image_resolution=[36,36]"]),
    Case("more action bins than the vocabulary", TINY, ["--policy.discrete_action_loss=true", "--policy.discrete_action_bins=2000"]),
    Case("dataset root is not a directory", TINY, ["--dataset.root={tmp}/no_data"]),
    Case("dataset without meta/info.json", TINY, ["--dataset.root={tmp}/empty"]),
    Case("state key not in the dataset", TINY, ["--dataset.state_key=observation.stat"]),
    Case("state wider than max_state_dim", TINY, ["--policy.max_state_dim=2"]),
    Case("more cameras than camera slots", TINY, ["--dataset.root={tmp}/two_cameras"]),
    Case("video without PyAV", TINY, ["--dataset.root={tmp}/video"], absent=("av",)),
    Case("camera mapped to a missing slot", TINY, ['--dataset.camera_keys={"observation.images.camera0": "camera3"}']),
    Case("episodes not in the dataset", TINY, ["--dataset.episodes=[0,999]"]),
    Case("validation without held-out episodes", TINY, ["--validation.val_split=0"]),
    Case("full pi05 preset without cuda", FULL, []),
    Case("fsdp without cuda", TINY, ["--accelerate-config={tmp}/fsdp.yaml"]),
    Case("fsdp settings fsdp2 cannot honour", TINY, ["--accelerate-config={tmp}/fsdp_all_wrong.yaml"]),
    Case("fsdp2 with fp16 on gpus", TINY, ["--accelerate-config={tmp}/fsdp2_fp16.yaml"], machine=TWO_GPUS),
    Case("fp16 without cuda", TINY, ["--accelerate-config={tmp}/fp16.yaml"]),
    Case("fp8", TINY, ["--accelerate-config={tmp}/fp8.yaml"], TWO_GPUS),
    Case("more processes than gpus", TINY, [f"--accelerate-config={DDP8}"], TWO_GPUS),
    Case("gpu yaml without cuda", TINY, [f"--accelerate-config={DDP8}"]),
    Case("two machines without main_process_ip", TINY, ["--accelerate-config={tmp}/two_machines.yaml"], TWO_GPUS),
    Case("machine rank past the last machine", TINY,
         ["--accelerate-config={tmp}/two_machines.yaml", "--main_process_ip=127.0.0.1", "--machine_rank=2"], TWO_GPUS),
    Case("processes that machines cannot share", TINY, ["--accelerate-config={tmp}/three_on_two.yaml"], TWO_GPUS),
    Case("lora with train_expert_only", TINY, ["--policy.lora.rank=4", "--policy.train_expert_only=true"]),
    Case("data file missing", TINY, ["--dataset.root={tmp}/data/no_data_file"]),
    Case("video file missing", TINY, ["--dataset.root={tmp}/data/no_video_file"]),
    Case("video file empty", TINY, ["--dataset.root={tmp}/data/empty_video"]),
    Case("videos in another folder", TINY, ["--dataset.root={tmp}/data/videos_elsewhere"]),
    Case("video encoded at another fps", TINY, ["--dataset.root={tmp}/data/video_fps"]),
    Case("episode rows disagree with its length", TINY, ["--dataset.root={tmp}/data/bad_rows"]),
    Case("episode video shorter than the episode", TINY, ["--dataset.root={tmp}/data/short_span"]),
    Case("state mapped to an image feature", TINY, ["--dataset.state_key=observation.images.top"]),
    Case("validation holds out every selected episode", TINY, ["--dataset.episodes=[0]"]),
    Case("mixture next to dataset.root", TINY, ['--dataset.mixture=[{"root": "{tmp}/data/v21"}]', "--dataset.root={tmp}/data/v21"]),
    Case("mixture members with one name", TINY, ['--dataset.mixture=[{"root": "{tmp}/data/v21"}, {"root": "{tmp}/data/v21"}]']),
    Case("mixture member root is not a directory", TINY, ['--dataset.mixture=[{"root": "{tmp}/data/v21"}, {"root": "{tmp}/no_data"}]']),
    Case("mixture member names no dataset", TINY, ['--dataset.mixture=[{"root": "{tmp}/data/v21"}, {"name": "nothing"}]']),
    Case("mixture member with root and repo_id", TINY, ['--dataset.mixture=[{"root": "{tmp}/data/v21", "repo_id": "org/name"}]']),
    Case("keep_best without validation", TINY, ["--checkpoint.keep_best=2", "--validation.val_freq=0"]),
    Case("keep_best by a key validation does not report", TINY, ["--checkpoint.keep_best=2", "--checkpoint.best_metric=loss"]),
    Case("keep_best by an EMA key without the EMA", TINY, ["--checkpoint.keep_best=2", "--checkpoint.best_metric=ema_val_loss"]),
    Case("mixture member key not in its dataset", TINY,
         ['--dataset.mixture=[{"root": "{tmp}/data/v21"}, {"root": "{tmp}/data/v30", "action_key": "actions"}]']),
    Case("mixture members at different fps", TINY, ['--dataset.mixture=[{"root": "{tmp}/data/v21"}, {"root": "{tmp}/data/fps20"}]']),
    Case("checkpoint.remote that is not a URL", TINY, ["--checkpoint.remote=bucket/run"]),
    Case("credentials in checkpoint.remote_options", TINY,
         ["--checkpoint.remote=s3://bucket/run", '--checkpoint.remote_options={"secret": "s3cr3t"}']),
    Case("checkpoint.remote inside the run's own directory", TINY,
         ["--checkpoint.remote=file://{tmp}/run/copy", "--output_dir={tmp}/run"]),
    Case("dataset.remote_options without a root in object storage", TINY, ['--dataset.remote_options={"region_name": "eu"}']),
    Case("store wait longer than the hang timeout", TINY,
         ["--dataset.root=s3://bucket/data", "--dataset.remote_wait_seconds=7200", "--distributed.timeout_minutes=60"]),
    Case("best by success rate without eval.env", TINY, ["--checkpoint.best_metric=eval/success_rate",
                                                        "--checkpoint.best_mode=max"]),
    Case("best by success rate, smaller is better", TINY, ["--checkpoint.best_metric=eval/success_rate",
                                                           "--checkpoint.best_mode=min", "--eval.env=metaworld:reach-v3"]),
    Case("output dir in use", TINY, ["--output_dir={tmp}/used"]),
    Case("resume without a checkpoint", TINY, ["--resume=true", "--output_dir={tmp}/empty_run"]),
    Case("several problems at once", FULL, ["--policy.n_action_steps=99", "--accelerate-config={tmp}/fsdp.yaml", "--dataset.root={tmp}/empty"]),
]


def _edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _edit_episodes(root, column: str, value) -> None:
    """Set `column` of episode 0 in a v3.0 dataset's meta/episodes."""
    path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    rows = pq.read_table(path).to_pylist()
    rows[0][column] = value
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Datasets with one problem each that only the meta files and a stat of the data files show (read-only)."""
    root = tmp_path_factory.mktemp("datasets")

    def synth(name, **kw):
        return write_synth(root / name, episodes=2, steps_per_episode=4, **kw)

    synth("v21")
    synth("v30", fmt="v3.0")
    (synth("no_data_file") / "data" / "chunk-000" / "episode_000001.parquet").unlink()
    (synth("no_video_file", video=True) / "videos" / "chunk-000" / "observation.images.top" / "episode_000001.mp4").unlink()
    (synth("empty_video", video=True) / "videos" / "chunk-000" / "observation.images.top" / "episode_000000.mp4").write_bytes(b"")
    moved = synth("videos_elsewhere", fmt="v3.0", video=True)
    (moved / "videos").rename(moved / "media")
    _edit_json(synth("video_fps", video=True) / "meta" / "info.json",
               lambda info: info["features"]["observation.images.top"]["info"].update({"video.fps": 30}))
    _edit_episodes(synth("bad_rows", fmt="v3.0"), "dataset_to_index", 3)
    _edit_episodes(synth("short_span", fmt="v3.0", video=True), "videos/observation.images.top/to_timestamp", 0.1)
    _edit_json(synth("fps20") / "meta" / "info.json", lambda info: info.update({"fps": 20}))
    return root


@pytest.fixture
def inputs(isolated_env, datasets):
    tmp = isolated_env
    (tmp / "data").symlink_to(datasets)
    (tmp / "bad.json").write_text('{"steps": 10,,}')
    for name, text in YAMLS.items():
        (tmp / name).write_text(text)
    (tmp / "empty").mkdir()
    (tmp / "used" / "checkpoints" / "000010").mkdir(parents=True)  # a run with a checkpoint
    write_synth(tmp / "two_cameras", episodes=2, steps_per_episode=4, cameras=2)
    write_synth(tmp / "video", episodes=2, steps_per_episode=4, video=True)
    return tmp


def pin(mp: pytest.MonkeyPatch, machine: Machine, absent: tuple[str, ...] = ()) -> None:
    """Pin the machine both commands check for and hide the modules a case says are not installed."""
    mp.setattr(Machine, "this", classmethod(lambda cls: machine))
    for name in absent:
        mp.setitem(sys.modules, name, None)  # `import name` now raises ImportError, as when not installed


@pytest.fixture(autouse=True)
def tripwire(monkeypatch):
    def launched(*_args, **_kwargs):
        raise AssertionError("train got past its checks and would have launched")

    monkeypatch.setattr(launch, "run", launched)


def train_and_validate(config: str, args: list[str]):
    runner = CliRunner()
    train = runner.invoke(app, ["train", f"--config_path={config}", *args])
    validate = runner.invoke(app, ["config", "validate", config, *args])
    return train, validate


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_config_validate_refuses_what_train_refuses_with_the_same_exit_code_and_message(inputs, monkeypatch, case):
    pin(monkeypatch, case.machine, case.absent)
    train, validate = train_and_validate(*case.command_args(inputs))
    assert train.exception is None or isinstance(train.exception, SystemExit), train.exception
    assert train.exit_code == 2, train.output
    assert "Error: " in train.stderr and "Traceback" not in train.output
    assert (validate.exit_code, validate.stderr) == (train.exit_code, train.stderr)
    assert validate.stdout == ""  # no "Config OK"
    assert not (inputs / "run").exists()  # nothing written


def rule_messages(module) -> list[str]:
    """The longest literal piece of each message a module appends to its `errors` list."""
    import ast
    from pathlib import Path

    pieces = []
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "append" and getattr(node.func.value, "id", None) == "errors":
            arg = node.args[0]
            parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
            literal = [p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
            if literal:
                pieces.append(max(literal, key=len).strip())
    return pieces


def test_the_cases_reach_every_refusal_of_the_rules_and_the_dataset_check(inputs):
    """A rule added to rules.py or data/check.py without a case above fails here."""
    import opentau_cli.config.rules as rules
    import opentau_cli.data.check as check

    said = []
    for case in CASES:
        with pytest.MonkeyPatch.context() as mp:
            pin(mp, case.machine, case.absent)
            config, args = case.command_args(inputs)
            said.append(CliRunner().invoke(app, ["config", "validate", config, *args]).stderr)
    text = "\n".join(said)
    messages = rule_messages(rules) + rule_messages(check)
    assert len(messages) >= 15  # the walk still finds the messages
    assert [m for m in messages if m not in text] == []


def test_validate_for_a_target_machine_makes_the_refusal_train_makes_there(inputs, monkeypatch):
    """`--gpus N` checks for a machine with N GPUs: on a 2-GPU box `train` refuses the 8-process YAML, and so does
    `config validate --gpus 2` anywhere, saying it checked for the target machine."""
    pin(monkeypatch, TWO_GPUS)
    out = f"--output_dir={inputs / 'run'}"
    train, _ = train_and_validate(TINY, [f"--accelerate-config={DDP8}", out])
    pin(monkeypatch, NO_GPU)
    target = CliRunner().invoke(app, ["config", "validate", TINY, f"--accelerate-config={DDP8}", "--gpus", "2", out])
    assert train.exit_code == target.exit_code == 2
    assert train.stderr.replace("this machine", "the target machine") == target.stderr
    ok = CliRunner().invoke(app, ["config", "validate", FULL, f"--accelerate-config={DDP8}", "--gpus", "8", out])
    assert ok.exit_code == 0, ok.output
    assert "checked for        a machine with 8 CUDA GPUs (--gpus 8)" in ok.stdout
