"""The launcher: CPU recipes in the Accelerate YAML it writes, environment, failure reports, refusals before launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import json

import pytest
import yaml

from conftest import EXAMPLES, REPO, SUITE_CACHE, opentau_bin, run_cli
from opentau_cli.config import load_config, read_accelerate_config
from opentau_cli.errors import UserError
from opentau_cli.process.launch import accelerate_yaml, build_command, failed_log, worker_env

pytestmark = pytest.mark.quick

TINY = EXAMPLES / "pi05_tiny_config.json"


def test_cpu_ddp_yaml_becomes_the_multi_process_launcher_without_use_cpu():
    setup = read_accelerate_config(EXAMPLES / "accelerate_cpu_ddp_config.yaml")
    out = accelerate_yaml(setup, load_config(TINY), cuda=False)
    # use_cpu / MULTI_CPU would make Accelerate fall back to one process; the worker asks for cpu=True itself.
    assert out["distributed_type"] == "MULTI_GPU" and out["use_cpu"] is False and out["num_processes"] == 2
    assert 1024 <= out["main_process_port"] <= 65535


def test_two_launches_get_different_ports():
    setup = read_accelerate_config(EXAMPLES / "accelerate_cpu_ddp_config.yaml")
    ports = {accelerate_yaml(setup, load_config(TINY), cuda=False)["main_process_port"] for _ in range(5)}
    assert len(ports) > 1


def test_deepspeed_yaml_takes_accumulation_and_clipping_from_the_config():
    setup = read_accelerate_config(EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml")
    cfg = load_config(TINY, {"gradient_accumulation_steps": "2", "batch_size": "8", "optimizer.grad_clip_norm": "0.5"})
    ds = accelerate_yaml(setup, cfg, cuda=False)["deepspeed_config"]
    assert ds["zero_stage"] == 3 and ds["zero3_init_flag"] is True
    assert ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 0.5


def test_multi_node_settings_come_from_the_yaml(tmp_path):
    y = tmp_path / "multi.yaml"
    y.write_text("distributed_type: MULTI_GPU\nnum_processes: 16\nnum_machines: 2\nmachine_rank: 1\n"
                 "main_process_ip: 10.0.0.1\nmain_process_port: 29555\n")
    out = accelerate_yaml(read_accelerate_config(y), load_config(TINY), cuda=True)
    assert (out["num_machines"], out["machine_rank"], out["main_process_ip"], out["main_process_port"]) == (2, 1, "10.0.0.1", 29555)


def reaching_accelerate_launch(launched: dict, tmp_path):
    """The arguments `accelerate launch` runs with for a launched YAML: its own parser and config reading."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = tmp_path / "launched.yaml"
    path.write_text(yaml.safe_dump(launched, sort_keys=False))
    args, _defaults, _mp = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    return args


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("accelerate_*.yaml")))
def test_each_example_yaml_reaches_accelerate_launch_with_its_own_keys(name, tmp_path):
    user = yaml.safe_load((EXAMPLES / name).read_text())
    cuda = "_cpu_" not in name
    launched = accelerate_yaml(read_accelerate_config(EXAMPLES / name), load_config(TINY), cuda=cuda)
    changed = {k for k in user if k != "deepspeed_config" and launched.get(k) != user[k]}
    # Only what opentau must change: the CPU recipe (MULTI_CPU / use_cpu), FSDP launched as plain multi-process (opentau
    # applies fully_shard itself: docs/ARCHITECTURE.md "FSDP2"), and nothing else of the user's keys (the DeepSpeed
    # section gains only the config's accumulation and clipping).
    allowed = {"distributed_type", "use_cpu"} if not cuda else {"distributed_type"} if "fsdp" in name else set()
    assert changed <= allowed, changed
    for key, value in (user.get("deepspeed_config") or {}).items():
        assert launched["deepspeed_config"][key] == value, key
    args = reaching_accelerate_launch(launched, tmp_path)
    assert args.num_processes == user["num_processes"] and args.mixed_precision == user["mixed_precision"]
    assert args.cpu is False
    if "deepspeed" in name:
        assert args.use_deepspeed and args.zero_stage == user["deepspeed_config"]["zero_stage"]
        assert args.offload_optimizer_device == "none" and args.gradient_accumulation_steps == 1
    else:
        assert args.multi_gpu and not args.use_deepspeed
    if cuda and "gpu_ids" in user:
        assert args.gpu_ids == user["gpu_ids"]


def test_user_keys_reach_accelerate_launch_as_written(tmp_path):
    y = tmp_path / "user.yaml"
    y.write_text("distributed_type: DEEPSPEED\nnum_processes: 8\ngpu_ids: 0,1,2,3,4,5,6,7\nmixed_precision: bf16\n"
                 "dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n"
                 "deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n  offload_param_device: cpu\n"
                 "  zero3_init_flag: false\n  zero3_save_16bit_model: true\n  gradient_accumulation_steps: 4\n")
    cfg = load_config(TINY, {"gradient_accumulation_steps": "2", "batch_size": "8"})
    args = reaching_accelerate_launch(accelerate_yaml(read_accelerate_config(y), cfg, cuda=True), tmp_path)
    assert (args.gpu_ids, args.dynamo_backend, args.dynamo_mode) == ("0,1,2,3,4,5,6,7", "INDUCTOR", "max-autotune")
    assert (args.offload_optimizer_device, args.offload_param_device) == ("cpu", "cpu")
    assert (args.zero3_init_flag, args.zero3_save_16bit_model) == (False, True)
    assert args.gradient_accumulation_steps == 2  # the config wins (the rules warn about the YAML's 4)


def test_deepspeed_config_file_is_read_for_the_stage_and_passed_to_accelerate_launch(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": True}, "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}))
    y = tmp_path / "file.yaml"
    y.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\n"
                 "deepspeed_config:\n  deepspeed_config_file: ds.json\n  zero3_init_flag: true\n")
    setup = read_accelerate_config(y)
    assert (setup.zero_stage, setup.mixed_precision, setup.ds_offload_optimizer_device) == (3, "bf16", "cpu")
    launched = accelerate_yaml(setup, load_config(TINY), cuda=True)
    assert launched["deepspeed_config"] == {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero3_init_flag": True}
    args = reaching_accelerate_launch(launched, tmp_path)
    assert args.deepspeed_config_file == str(tmp_path / "ds.json") and args.use_deepspeed
    # Accelerate refuses DeepSpeed settings both in the JSON and in the YAML: none is added.
    assert args.zero_stage is None and args.gradient_accumulation_steps is None and args.mixed_precision == "no"


def test_unquoted_no_as_accelerate_config_writes_it_is_single_process(tmp_path):
    y = tmp_path / "no.yaml"
    y.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nnum_processes: 1\nmixed_precision: NO\n"
                 "dynamo_config:\n  dynamo_backend: NO\nuse_cpu: false\n")
    setup = read_accelerate_config(y)
    assert (setup.backend, setup.world_size, setup.mixed_precision) == ("single", 1, "no")
    args = reaching_accelerate_launch(accelerate_yaml(setup, load_config(TINY), cuda=False), tmp_path)
    assert args.dynamo_backend == "NO" and not args.multi_gpu and not args.use_deepspeed


def test_worker_env_sets_the_allocator_hint_and_deepspeed_cpu_accelerator(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    setup = read_accelerate_config(EXAMPLES / "accelerate_cpu_deepspeed_config.yaml")
    env = worker_env(setup, cuda=False)
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True" and env["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    assert worker_env(setup, cuda=False)["PYTORCH_ALLOC_CONF"] == "backend:native"


def test_command_runs_the_worker_module_through_accelerate_launch(tmp_path):
    cmd = build_command(tmp_path / "a.yaml", tmp_path / "c.json", tmp_path / "l.json")
    assert cmd[1:3] == ["-m", "opentau_cli.process.accelerate_launcher"]
    assert cmd[cmd.index("-m", 3) + 1] == "opentau_cli.train.worker" and "--config" in cmd
    # That module is Accelerate's own launcher: the same parser and entry point as `python -m accelerate.commands.launch`.
    ours, theirs = (subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
                    for module in ("opentau_cli.process.accelerate_launcher", "accelerate.commands.launch"))
    assert ours.returncode == theirs.returncode == 0 and ours.stdout == theirs.stdout and "--config_file" in ours.stdout


def test_import_paused_collects_nothing_while_it_imports_freezes_what_was_made_and_restores_the_collector(tmp_path):
    """docs/ARCHITECTURE.md "Start-up" (in a fresh interpreter: freezing is for the life of a process)."""
    (tmp_path / "made_garbage.py").write_text("import gc\n"
                                             "cycles = [[] for _ in range(3)]\n"
                                             "for c in cycles:\n    c.append(c)\n"
                                             "del cycles\n"
                                             "COLLECTIONS = sum(s['collections'] for s in gc.get_stats())\n")
    (tmp_path / "broken.py").write_text("raise ImportError('broken on purpose')\n")
    script = """
import gc, json, sys
from opentau_cli.process.runtime import import_paused
before = sum(s["collections"] for s in gc.get_stats())
import_paused("made_garbage", "json")
import made_garbage
out = {"collected_while_importing": made_garbage.COLLECTIONS - before, "enabled": gc.isenabled(),
       "frozen": gc.get_freeze_count()}
try:
    import_paused("broken")
except ImportError as e:
    out["error"] = str(e)
out["enabled_after_error"] = gc.isenabled()
gc.disable()
import_paused("json")
out["still_disabled"] = not gc.isenabled()
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["collected_while_importing"] == 0 and out["enabled"] and out["frozen"] > 0
    assert out["error"] == "broken on purpose" and out["enabled_after_error"] and out["still_disabled"]


def test_a_ranks_imports_leave_deepspeed_mlflow_boto3_and_scipy_to_what_uses_them(tmp_path):
    """What a rank imports for a feature it never uses is kept out (docs/ARCHITECTURE.md "Start-up"): DeepSpeed, which
    Accelerate's unwrap_model and transformers import whenever it is installed, outside a DeepSpeed launch; MLflow
    (DeepSpeed's autotuner), boto3 (Accelerate's SageMaker settings, in the launcher too) and scipy.optimize
    (transformers' object-detection losses) everywhere. Each still imports and works afterwards, and a DDP rank unwraps
    its prepared model as Accelerate does. Each rank is run_rank in a process of its own, as a launch starts it, with
    the resolved config and launch.json the launcher writes: one of a DDP launch, one of a ZeRO-2 launch."""
    script = """
import json, sys
from pathlib import Path
from opentau_cli.process.runtime import import_paused, run_rank

def loaded(*packages):
    return sorted(m for m, module in sys.modules.items() if m.split(".")[0] in packages and module is not None)

def work(cfg, setup, launch, console):
    out = {"after_rank_imports": loaded("mlflow", "boto3", "botocore", "scipy"), "deepspeed": len(loaded("deepspeed"))}
    import_paused("accelerate.commands.launch")
    out["after_launcher_imports"] = loaded("boto3", "botocore")
    import torch
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    out["unwrapped"] = accelerator.unwrap_model(accelerator.prepare(model)) is model
    out["deepspeed_after_unwrap"] = len(loaded("deepspeed"))
    import boto3, mlflow
    from scipy.optimize import linear_sum_assignment
    rows, cols = linear_sum_assignment([[4, 1], [2, 3]])
    out.update(mlflow_imports=hasattr(mlflow, "log_metric"), boto3_imports=hasattr(boto3, "client"),
               assignment=[rows.tolist(), cols.tolist()])
    if setup.backend == "deepspeed":
        import deepspeed.autotuning.autotuner as autotuner
        out["autotuner_has_mlflow"] = autotuner.has_mlflow
    Path(sys.argv[-1]).write_text(json.dumps(out))
    return 0

run_rank(work, sys.argv[1:5])
"""
    config = tmp_path / "train_config.json"
    config.write_text(json.dumps(load_config(EXAMPLES / "pi05_tiny_config.json", [], environ={}).model_dump(mode="json")))
    seen = {}
    for yaml_name in ("accelerate_cpu_ddp_config.yaml", "accelerate_cpu_deepspeed_config.yaml"):
        launch = tmp_path / f"{yaml_name}.launch.json"
        launch.write_text(json.dumps({"accelerate": read_accelerate_config(EXAMPLES / yaml_name).to_dict(),
                                      "log_dir": str(tmp_path / yaml_name)}))
        (tmp_path / yaml_name).mkdir()
        out = tmp_path / f"{yaml_name}.json"
        proc = subprocess.run([sys.executable, "-c", script, "--config", str(config), "--launch", str(launch), str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (tmp_path / yaml_name / "rank0.log").read_text()[-3000:]
        seen[yaml_name] = json.loads(out.read_text())
    either = {"after_rank_imports": [], "after_launcher_imports": [], "unwrapped": True, "mlflow_imports": True,
              "boto3_imports": True, "assignment": [[0, 1], [1, 0]]}
    ddp, zero2 = seen["accelerate_cpu_ddp_config.yaml"], seen["accelerate_cpu_deepspeed_config.yaml"]
    assert ddp == {**either, "deepspeed": 0, "deepspeed_after_unwrap": 0}, seen
    assert {k: zero2[k] for k in either} == either and zero2["deepspeed"] > 100 and zero2["autotuner_has_mlflow"] is False, seen


def test_a_process_that_imported_transformers_before_the_policy_imports_scipy_with_it_as_before():
    """scipy is kept out only while transformers first imports (its answer is asked once): a program of the user's or a
    benchmark that imported transformers itself, scipy found, imports the policy as it did (the ranks' side is the test
    above; docs/ARCHITECTURE.md "Start-up")."""
    script = """
import json, sys
import transformers
import opentau_cli.policies
print(json.dumps({"after_policy_imports": sorted(m for m in sys.modules if m.split(".")[0] == "scipy")}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "scipy.optimize" in json.loads(proc.stdout.strip().splitlines()[-1])["after_policy_imports"]


def test_failed_log_names_the_rank_that_failed_first_not_the_one_that_lost_its_peer(tmp_path):
    (tmp_path / "rank0.log").write_text("Traceback (most recent call last):\nRuntimeError: [gloo] Connection closed by peer\n")
    (tmp_path / "rank1.log").write_text("Traceback (most recent call last):\nValueError: bad shape\n")
    log, last = failed_log(tmp_path)
    assert log.name == "rank1.log" and last == "ValueError: bad shape"


def test_failed_log_names_the_rank_whose_error_ended_the_launch_not_one_whose_data_worker_the_launcher_stopped(tmp_path):
    # Seen in CI: rank 1 stopped with its sentence; the launcher's SIGTERM to rank 0's group ended its data worker.
    (tmp_path / "rank0.log").write_text("Traceback (most recent call last):\n"
                                        "RuntimeError: DataLoader worker (pid 30982) is killed by signal: Terminated. \n")
    (tmp_path / "rank1.log").write_text("Error: The store of s3://b/ds did not answer for 17 s: step 8 is saved.\n")
    log, last = failed_log(tmp_path)
    assert log.name == "rank1.log" and last == "Error: The store of s3://b/ds did not answer for 17 s: step 8 is saved."


def test_full_pi05_preset_on_a_machine_without_gpu_exits_2_and_suggests_the_tiny_config(tmp_path, published_pi05_hub):
    """The seed line `opentau-train --config_path=configs/examples/pi05_config.json` on CPU: refused, nothing written."""
    r = run_cli(["--config_path=configs/examples/pi05_config.json", f"--output_dir={tmp_path / 'out'}"],
                cwd=REPO, env={"HF_HOME": str(tmp_path / "hf"), **published_pi05_hub}, script="opentau-train")
    assert r.returncode == 2, r.stderr
    assert "pi05_tiny_config.json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_ctrl_c_stops_the_run_with_exit_130(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "OPENTAU_CACHE_DIR": str(SUITE_CACHE)}
    env.pop("OPENTAU_DEBUG", None)
    proc = subprocess.Popen(
        [opentau_bin(), "train", f"--config_path={TINY}", f"--output_dir={out}", "--steps", "500", "--log_freq", "1",
         f"--accelerate-config={EXAMPLES / 'accelerate_cpu_ddp_config.yaml'}", "--batch_size", "4"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "metrics.jsonl").is_file():
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, log[-3000:]
    assert not (out / "checkpoints").exists() or not [p for p in (out / "checkpoints").iterdir() if p.name.isdigit()]


def test_machine_settings_come_from_the_command_line_over_the_cluster_environment_over_the_yaml(tmp_path):
    from opentau_cli.config import with_machine

    y = tmp_path / "two.yaml"
    y.write_text("distributed_type: MULTI_GPU\nnum_processes: 16\nnum_machines: 2\nmachine_rank: 0\n"
                 "main_process_ip: 10.0.0.1\nmain_process_port: 29555\n")
    setup = read_accelerate_config(y)
    slurm = {"SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "MASTER_ADDR": "node-a", "MASTER_PORT": "29600"}
    from_env = with_machine(setup, {}, slurm)
    assert (from_env.machine_rank, from_env.num_machines, from_env.main_process_ip, from_env.main_process_port) == (1, 2, "node-a", 29600)
    torchrun = with_machine(setup, {}, {**slurm, "NODE_RANK": "0"})
    assert torchrun.machine_rank == 0
    flags = with_machine(setup, {"machine_rank": 1, "main_process_ip": "127.0.0.1"}, {"NODE_RANK": "0"})
    assert (flags.machine_rank, flags.main_process_ip, flags.main_process_port) == (1, "127.0.0.1", 29555)
    out = accelerate_yaml(from_env, load_config(TINY), cuda=True)
    assert (out["machine_rank"], out["main_process_ip"], out["main_process_port"]) == (1, "node-a", 29600)
    with pytest.raises(UserError, match="SLURM_NODEID must be a whole number"):
        with_machine(setup, {}, {"SLURM_NODEID": "node1"})
