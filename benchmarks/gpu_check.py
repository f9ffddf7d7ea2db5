"""GPU self-check: each backend trains, checkpoints and resumes exactly, the full pi05 takes a step, profile gives MFU.

On a CUDA machine, through the installed CLI (`opentau train`, `opentau resume`, `opentau profile`):
single-GPU bf16 training of pi05_small, two steps of the full pi05 preset through `opentau profile` (the training
step's code, no checkpoint written; skipped when the memory plan says the card is too small) with the memory plan's
estimate next to torch.cuda.max_memory_allocated, DDP (when more than one GPU is visible), DeepSpeed ZeRO-2,
ZeRO-3 and FSDP2 (configs/examples/accelerate_fsdp2_config.yaml) on every visible GPU; under each backend a run of N steps saving at N/2, a resume of that checkpoint whose
first resumed loss must equal the uninterrupted run's bit for bit and later ones within RESUME_TOLERANCE, and the
restored state itself (the checkpoint restored on the same ranks and saved again before any step: every tensor equal
to the bit, gpu_check_restore.py); every process runs PyTorch's deterministic settings (Checker.env); the same train + resume with gradient checkpointing, with LoRA, and with async saves; an
elastic resume (ZeRO-2 on every GPU -> DDP on half, and -> FSDP2 on every GPU, --reshard=true); `opentau eval` (bf16 on CUDA) on a checkpoint;
the full pi05's inference latency through `opentau serve`'s code, eager and torch.compiled, next to the upstream
tool's published 152.9 ms; the attention kernel pi05 runs in; then `opentau profile` with MFU.
Prints one table and writes it as gpu_check.json and gpu_check.md (a section to paste into BENCHMARKS.md).

    scripts/gpu_check.sh                        # on a CUDA machine (a few minutes)
    scripts/gpu_check.sh --only single,profile  # a subset of the CHECKS below
    scripts/gpu_check.sh --cpu-dry-run          # the same sequence on pi05_tiny with 1-2 CPU processes (tests the script)

Exit 0 when nothing failed, 1 when a check failed, 2 on a usage mistake.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXAMPLES, REPO, SMALL_CONFIG, TINY_CONFIG, command_line, env, machine, opentau_bin, p99  # noqa: E402
from opentau_cli.store.layout import CHECKPOINTS, METRICS, step_dir_name  # noqa: E402

CHECKS = ("single", "pi05", "ddp", "zero2", "zero3", "fsdp2", "gc", "lora", "async", "elastic", "eval", "inference",
          "attention", "profile")
# Later resumed steps may differ by this much (relative): DDP rebuilds its gradient buckets after the first step, and
# some CUDA kernels reduce in a varying order; the first resumed step, from the restored state, must be exact.
RESUME_TOLERANCE = 1e-3
# The upstream tool's published pi05 inference latency: one action chunk, RTX 5090, batch 1, 3 cameras, chunk 50,
# 10 denoising steps. The inference check samples the same sizes through `opentau serve`'s code.
UPSTREAM_CHUNK_MS = 152.9
INFERENCE_CAMERAS = 3
# A compiled chunk may differ from the eager one by this much of the eager chunk's largest action: fused kernels
# round bf16 differently, and ten Euler steps carry that on; a wrong graph is far off.
COMPILE_TOLERANCE = 0.05
# The sitecustomize every process of a check imports (Checker.env): PyTorch's deterministic settings.
DETERMINISTIC = """import torch
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
"""
# The camera images of the CPU dry run's inference and attention checks: the tiny config's 32x32 rather than the
# presets' 224x224, which costs pi05_tiny five times the CPU per chunk (the dry run checks the script).
DRY_RUN_RESOLUTION = (32, 32)
BACKENDS = ("single", "ddp", "zero2", "zero3", "fsdp2")
FULL_CONFIG = EXAMPLES / "pi05_config.json"


@dataclass
class Row:
    check: str
    backend: str
    result: str  # PASS, FAIL or SKIP
    key: str
    seconds: float | None = None
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """What this machine runs: the GPU sizes, or the CPU dry run's (pi05_tiny, a few steps, 2 processes)."""

    cpu: bool
    procs: int  # processes of DDP / ZeRO launches
    precision: str
    config: Path
    steps: int
    batch: int
    profile_steps: int
    profile_warmup: int
    profile_batch: int
    timeout: float

    @staticmethod
    def for_machine(cpu_dry_run: bool, gpus: int) -> "Plan":
        if cpu_dry_run:
            return Plan(cpu=True, procs=2, precision="no", config=TINY_CONFIG, steps=4, batch=4, profile_steps=2,
                        profile_warmup=1, profile_batch=4, timeout=600)
        return Plan(cpu=False, procs=gpus, precision="bf16", config=SMALL_CONFIG, steps=20, batch=8, profile_steps=20,
                    profile_warmup=5, profile_batch=32, timeout=600)


def accelerate_yaml(backend: str, plan: Plan, procs: int | None = None) -> dict:
    """An Accelerate config as `accelerate config` writes it (the keys of configs/examples/accelerate_*); `procs`:
    another process count than every GPU."""
    procs = 1 if backend == "single" else (procs or plan.procs)
    if backend == "fsdp2":  # the example FSDP2 YAML (GPUs) or its CPU variant, on this machine's processes
        example = "accelerate_cpu_fsdp2_config.yaml" if plan.cpu else "accelerate_fsdp2_config.yaml"
        out = yaml.safe_load((EXAMPLES / example).read_text())
        out.update(num_processes=procs, mixed_precision=plan.precision)
        return out
    out = {"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "machine_rank": 0, "num_processes": procs,
           "mixed_precision": plan.precision, "main_training_function": "main", "rdzv_backend": "static",
           "same_network": True, "use_cpu": plan.cpu}
    if backend == "single":
        out["distributed_type"] = "NO"
    elif backend == "ddp":
        out["distributed_type"] = "MULTI_CPU" if plan.cpu else "MULTI_GPU"
        if not plan.cpu:
            out["gpu_ids"] = "all"
    else:
        stage = 2 if backend == "zero2" else 3
        ds = {"zero_stage": stage, "offload_optimizer_device": "none", "offload_param_device": "none",
              "zero3_init_flag": stage == 3}
        if stage == 3:
            ds["zero3_save_16bit_model"] = False
        out.update(distributed_type="DEEPSPEED", use_cpu=False, deepspeed_config=ds)
        if not plan.cpu:
            out["gpu_ids"] = "all"
    return out


def training_config(source: Path, dest: Path) -> Path:
    """The example config made self-contained: no Hub weights or tokenizer (random init, byte-level prompts), no
    TensorBoard, plain progress lines, in-process data loading."""
    cfg = json.loads(source.read_text())
    for key in ("pretrained_path", "tokenizer_path"):
        cfg["policy"].pop(key, None)
    cfg.setdefault("logging", {}).update(tensorboard=False, progress_bar="plain")
    cfg["dataset"]["num_workers"] = 0
    dest.write_text(json.dumps(cfg, indent=2))
    return dest


class Checker:
    def __init__(self, plan: Plan, out: Path, keep_runs: bool, peak_tflops: float | None):
        self.plan, self.out, self.keep_runs, self.peak_tflops = plan, out, keep_runs, peak_tflops
        self.runs, self.logs, self.setup = out / "runs", out / "logs", out / "setup"
        for d in (self.runs, self.logs, self.setup):
            d.mkdir(parents=True, exist_ok=True)
        self.config = training_config(plan.config, self.setup / plan.config.name)

    def yaml_for(self, backend: str, procs: int | None = None) -> Path:
        path = self.setup / f"accelerate_{backend}{'' if procs is None else f'_{procs}'}.yaml"
        path.write_text(yaml.safe_dump(accelerate_yaml(backend, self.plan, procs), sort_keys=False))
        return path

    def opentau(self, name: str, args: list[str]) -> tuple[bool, str, float, Path]:
        """One CLI command; its whole output goes to logs/<name>.log. Returns (ok, last line, seconds, log)."""
        log = self.logs / f"{name}.log"
        start = time.perf_counter()
        with log.open("w") as f:
            f.write("$ opentau " + " ".join(args) + "\n")
            f.flush()
            try:
                rc = subprocess.run([opentau_bin(), *args], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                    env=self.env(), timeout=self.plan.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
        seconds = time.perf_counter() - start
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        if rc is None:
            last = f"timed out after {self.plan.timeout:.0f} s"
        else:
            last = lines[-1].strip() if lines else f"exit {rc}"
        return rc == 0, last, seconds, log

    def env(self) -> dict:
        """Every process of a check runs PyTorch's deterministic settings where it offers them: cuBLAS's
        deterministic workspace, `torch.use_deterministic_algorithms` (warn only: an op without a deterministic
        kernel warns instead of failing the check) and cuDNN without autotuning, through a sitecustomize that
        every Python process of the launch imports."""
        hook = self.setup / "deterministic"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(DETERMINISTIC)
        path = [str(hook), *filter(None, [env().get("PYTHONPATH")])]
        return {**env(), "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONPATH": ":".join(path)}

    def restored_state(self, backend: str, label: str, ckpt: Path, home: Path) -> Row:
        """Restore `ckpt` on the backend's ranks as `opentau resume` does and save again before any step
        (benchmarks/gpu_check_restore.py): every tensor (weights, optimizer state, schedule, random states, EMA) must
        equal the saved one to the bit."""
        from opentau_cli.config import load_config, resolve_accelerate_config
        from opentau_cli.process.launch import accelerate_yaml as launch_yaml, worker_env

        out, name = home / "restored", re.sub(r"[^A-Za-z0-9.-]+", "_", label)
        logs = self.logs / f"{name}-restore"
        logs.mkdir(parents=True, exist_ok=True)
        cfg = load_config(ckpt / "train_config.json", [f"--output_dir={out}"], environ={})
        setup = resolve_accelerate_config(self.yaml_for(backend))
        (logs / "config.json").write_text(json.dumps(cfg.to_json_dict()))
        (logs / "accelerate.yaml").write_text(yaml.safe_dump(launch_yaml(setup, cfg, not self.plan.cpu)))
        (logs / "launch.json").write_text(json.dumps({"accelerate": setup.to_dict(), "log_dir": str(logs),
                                                      "run_id": "restore-check", "restore_from": str(ckpt)}))
        start = time.perf_counter()
        try:
            rc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                 str(logs / "accelerate.yaml"), str(REPO / "benchmarks" / "gpu_check_restore.py"),
                                 "--config", str(logs / "config.json"), "--launch", str(logs / "launch.json")],
                                cwd=REPO, env={**worker_env(setup, not self.plan.cpu), **self.env()},
                                capture_output=True, text=True, timeout=self.plan.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
        seconds = time.perf_counter() - start
        saved = out / CHECKPOINTS / ckpt.name
        if rc != 0 or not saved.is_dir():
            return Row("restored state", label, "FAIL", f"restore + save exited {rc} (logs: {logs})", seconds)
        from gpu_check_restore import differences

        found, tensors = differences(ckpt, saved)
        if found:
            return Row("restored state", label, "FAIL", f"{len(found)} differences, first: {found[0]}", seconds,
                       {"differences": found[:20]})
        return Row("restored state", label, "PASS", f"{tensors} tensors equal to the bit after the resume", seconds)

    def failed(self, check: str, backend: str, last: str, seconds: float, log: Path) -> Row:
        return Row(check, backend, "FAIL", f"{last} (log: {log})", seconds)

    def backend(self, backend: str, label: str | None = None, extra: tuple[str, ...] = (),
                resume_to: tuple[str, int] | None = None) -> list[Row]:
        """Train N steps saving at N/2, then resume a copy of the N/2 checkpoint in a run directory of its own: the
        resumed run's metrics.jsonl then holds only what the resume logged, compared step by step with the original.
        `label` names a variant trained with `extra` settings; `resume_to`: (backend, processes) of an elastic
        resume of the checkpoint under another backend or process count (--reshard=true)."""
        steps, mid = self.plan.steps, self.plan.steps // 2
        label = label or backend
        name = re.sub(r"[^A-Za-z0-9.-]+", "_", label.replace("->", "to"))
        home = self.runs / name
        shutil.rmtree(home, ignore_errors=True)
        full, resumed = home / "full", home / "resumed"
        accel = self.yaml_for(backend)
        ok, last, seconds, log = self.opentau(f"{name}-train", [
            "train", f"--config_path={self.config}", f"--accelerate-config={accel}", f"--output_dir={full}",
            "--steps", str(steps), "--save_freq", str(mid), "--log_freq", "1", "--batch_size", str(self.plan.batch),
            *extra])
        records = train_records(full) if ok else []
        losses = {r["step"]: r["loss"] for r in records}
        ckpt = full / CHECKPOINTS / step_dir_name(mid, steps)
        if not ok:
            train = self.failed("train + checkpoint", label, last, seconds, log)
        elif sorted(losses) != list(range(1, steps + 1)) or not all(math.isfinite(v) for v in losses.values()):
            train = Row("train + checkpoint", label, "FAIL", f"metrics.jsonl holds steps {sorted(losses)}, losses "
                        f"{[losses[s] for s in sorted(losses)]} (log: {log})", seconds)
        elif not ckpt.is_dir():
            train = Row("train + checkpoint", label, "FAIL", f"no checkpoint {ckpt} (log: {log})", seconds)
        else:
            rate = statistics.median(r["samples_per_s"] for r in records[1:] or records)
            train = Row("train + checkpoint", label, "PASS",
                        f"loss {losses[1]:.4f} -> {losses[steps]:.4f}, {rate:.1f} samples/s", seconds,
                        {"losses": losses, "samples_per_s": rate, "checkpoint": str(ckpt)})
        if train.result != "PASS":
            return [train, Row("exact resume", label, "SKIP", "training failed", None)]
        copy = resumed / CHECKPOINTS / ckpt.name
        shutil.copytree(ckpt, copy, symlinks=True)
        elastic = [] if resume_to is None else [f"--accelerate-config={self.yaml_for(*resume_to)}", "--reshard=true"]
        ok, last, seconds, log = self.opentau(f"{name}-resume", ["resume", str(copy), *elastic])
        if not ok:
            return [train, self.failed("elastic resume" if resume_to else "exact resume", label, last, seconds, log)]
        rows = [train, resume_row(label, losses, {r["step"]: r["loss"] for r in train_records(resumed)},
                                  range(mid + 1, steps + 1), seconds, log, elastic=resume_to is not None)]
        if resume_to is None:  # an elastic resume reshards: its files are another topology's
            rows.append(self.restored_state(backend, label, ckpt, home))
        if not self.keep_runs and all(r.result == "PASS" for r in rows):
            shutil.rmtree(home)  # pi05_small checkpoints are about 1 GB each; a failed backend's runs stay for a look
        return rows

    def full_pi05_step(self) -> list[Row]:
        """Two steps of the full pi05 (random weights) through `opentau profile`, which runs the training step's code
        and writes no checkpoint; the second step's peak next to the memory plan's estimate for the same run."""
        backend = "pi05 (3.3B), single"
        if self.plan.cpu:
            return [Row("one step", backend, "SKIP", "needs CUDA (the full preset is refused on CPU)"),
                    Row("memory plan vs peak", backend, "SKIP", "needs CUDA")]
        import torch

        from opentau_cli.config import TrainConfig, read_accelerate_config
        from opentau_cli.plan.memory import gib, plan_memory

        config = training_config(FULL_CONFIG, self.setup / "pi05_full.json")
        accel = self.yaml_for("single")
        cfg = TrainConfig.model_validate({**json.loads(config.read_text()), "batch_size": 2, "per_device_batch_size": 2,
                                          "gradient_accumulation_steps": 1})
        planned = plan_memory(cfg, read_accelerate_config(accel))
        card = torch.cuda.get_device_properties(0).total_memory
        if not planned.fits(card):
            return skipped(backend, ("one step", "memory plan vs peak"),
                           f"the memory plan needs {gib(planned.total)}, the card has {gib(card)}")
        report_path = self.out / "pi05_profile.json"
        ok, last, seconds, log = self.opentau("pi05-step", [
            "profile", f"--config_path={config}", f"--accelerate-config={accel}", "--steps", "1", "--warmup", "1",
            "--json", str(report_path), "--batch_size", "2"])
        if not ok:
            return [self.failed("one step", backend, last, seconds, log),
                    Row("memory plan vs peak", backend, "SKIP", "the step failed")]
        report = json.loads(report_path.read_text())
        step = Row("one step", backend, "PASS", f"{report['step_time_s']:.2f} s per step at batch 2", seconds,
                   {"step_time_s": report["step_time_s"]})
        return [step, memory_row(backend, planned.allocated, max(m["bytes"] for m in report["peak_memory"]))]

    def evaluation(self) -> Row:
        """`opentau eval` (bf16 on CUDA) on a checkpoint of a short single-process run."""
        run, out = self.runs / "eval" / "run", self.runs / "eval" / "report"
        shutil.rmtree(run.parent, ignore_errors=True)
        ok, last, seconds, log = self.opentau("eval-train", [
            "train", f"--config_path={self.config}", f"--accelerate-config={self.yaml_for('single')}",
            f"--output_dir={run}", "--steps", "2", "--save_freq", "2", "--log_freq", "1", "--batch_size", str(self.plan.batch)])
        if not ok:
            return self.failed("eval", "single", last, seconds, log)
        ok, last, more, log = self.opentau("eval", ["eval", str(run), "--output", str(out), "--plot-episodes", "0"])
        seconds += more
        if not ok:
            return self.failed("eval", "single", last, seconds, log)
        report = json.loads((out / "eval.json").read_text())
        if not self.keep_runs:
            shutil.rmtree(run.parent)
        return Row("eval", "single", "PASS", f"{report['samples']} chunks, MSE {report['policy']['mse']:.4f} "
                   f"({report['mse_ratio']:.2f}x the mean action's)", seconds, {"mse_ratio": report["mse_ratio"]})

    def inference(self) -> list[Row]:
        """One action chunk per request through `opentau serve`'s code (ServedPolicy.infer: images resized, state
        normalized and binned, the chunk sampled and un-normalized) at the upstream anchor's sizes: batch 1, 3
        cameras, chunk 50, 10 denoising steps; the full pi05 in bf16 on CUDA (pi05_tiny in fp32 at 32x32 on the CPU
        dry run). Eager, then with sampling's loop torch.compiled (`opentau serve --compile`); p50 / p99 over the
        requests after a warm-up, next to the upstream tool's 152.9 ms."""
        import numpy as np
        import torch

        from opentau_cli.config.model import PolicyConfig
        from opentau_cli.policies import build_policy
        from opentau_cli.tools.inference import for_inference
        from opentau_cli.tools.serve import ServedPolicy

        preset = "pi05_tiny" if self.plan.cpu else "pi05"
        device = torch.device("cpu" if self.plan.cpu else "cuda")
        label = f"{preset}, {'fp32 CPU' if self.plan.cpu else 'bf16'}, {INFERENCE_CAMERAS} cameras"
        start = time.perf_counter()
        torch.manual_seed(0)
        sizes = {"image_resolution": DRY_RUN_RESOLUTION} if self.plan.cpu else {}
        cfg = PolicyConfig(preset=preset, chunk_size=50, n_action_steps=50, num_inference_steps=10, **sizes)
        with device:  # random weights, drawn where they run (speed does not depend on their values)
            policy = build_policy(cfg)
        width = 8
        policy.set_stats({key: {"mean": [0.0] * width, "std": [1.0] * width, "q01": [-1.0] * width,
                                "q99": [1.0] * width} for key in ("state", "action")})
        cameras = [f"observation.images.camera{i}" for i in range(INFERENCE_CAMERAS)]
        served = ServedPolicy(for_inference(policy, device), cameras, "observation.state", preset, seed=0, device=device)
        rng = np.random.default_rng(0)
        obs = {**{c: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for c in cameras},
               "observation.state": rng.uniform(-1, 1, width).astype(np.float32), "prompt": "pick up the cube"}
        requests = 3 if self.plan.cpu else 20

        def measure() -> tuple[list[float], np.ndarray]:
            chunk = served.infer(obs)["actions"]  # warm-up (and, compiled, the compilation)
            times = []
            for _ in range(requests):
                began = time.perf_counter()
                served.infer(obs)
                times.append((time.perf_counter() - began) * 1000)
            return sorted(times), chunk

        def key(times: list[float]) -> str:
            p50 = statistics.median(times)
            return (f"p50 {p50:.1f} ms, p99 {p99(times):.1f} ms per chunk ({len(times)} requests); "
                    f"{p50 / UPSTREAM_CHUNK_MS:.2f}x the upstream {UPSTREAM_CHUNK_MS} ms (RTX 5090)")

        eager, eager_chunk = measure()
        rows = [Row("inference, eager", label, "PASS" if np.isfinite(eager_chunk).all() else "FAIL", key(eager),
                    time.perf_counter() - start, {"ms": eager, "anchor_ms": UPSTREAM_CHUNK_MS})]
        start = time.perf_counter()
        try:
            policy.compile_sampling()
            compiled, compiled_chunk = measure()
        except Exception as exc:  # a compiler failure is this row's result, not the self-check's end
            return rows + [Row("inference, torch.compile", label, "FAIL", f"{type(exc).__name__}: {exc}"[:300],
                               time.perf_counter() - start)]
        off = float(np.abs(compiled_chunk - eager_chunk).max() / max(np.abs(eager_chunk).max(), 1e-12))
        result = "PASS" if np.isfinite(compiled_chunk).all() and off <= COMPILE_TOLERANCE else "FAIL"
        rows.append(Row("inference, torch.compile", label, result,
                        f"{key(compiled)}; eager p50 / compiled p50 = {statistics.median(eager) / statistics.median(compiled):.2f}x, "
                        f"chunk within {off:.1e} of eager's", time.perf_counter() - start,
                        {"ms": compiled, "anchor_ms": UPSTREAM_CHUNK_MS, "relative_difference": off}))
        return rows

    def attention(self) -> Row:
        """The kernel pi05_small's attention runs in, one bf16 forward and backward on this machine's device."""
        import torch

        from opentau_cli.config.model import PolicyConfig
        from opentau_cli.plan.measure import fake_inputs, policy_module
        from opentau_cli.policies.pi05.modeling import attention_kernels

        device = "cpu" if self.plan.cpu else "cuda"
        start = time.perf_counter()
        cfg = (PolicyConfig(preset="pi05_tiny", image_resolution=DRY_RUN_RESOLUTION) if self.plan.cpu
               else PolicyConfig(preset="pi05_small"))
        policy = policy_module(cfg, "bfloat16").to(device)
        inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in fake_inputs(cfg, 2, 1).items()}
        used = attention_kernels(lambda: policy.loss(inputs)["loss"].backward())
        names = ", ".join(f"{name} x{count}" for name, count in sorted(used.items()))
        result = "FAIL" if "math" in used or not used else "PASS"
        return Row("attention kernel", f"{cfg.preset}, {device}", result, names or "no attention call seen",
                   time.perf_counter() - start, used)

    def profile(self) -> Row:
        report_path = self.out / "profile.json"
        args = ["profile", f"--config_path={self.config}", f"--accelerate-config={self.yaml_for('single')}",
                "--steps", str(self.plan.profile_steps), "--warmup", str(self.plan.profile_warmup),
                "--json", str(report_path), "--batch_size", str(self.plan.profile_batch)]
        if self.peak_tflops:
            args += ["--peak-tflops", str(self.peak_tflops)]
        ok, last, seconds, log = self.opentau("single-profile", args)
        if not ok:
            return self.failed("profile", "single", last, seconds, log)
        report = json.loads(report_path.read_text())
        if report["mfu"] is None:
            mfu = "MFU n/a" + ("" if self.plan.cpu else f" ({report['device']} unknown: pass --peak-tflops)")
        else:
            mfu = f"MFU {report['mfu'] * 100:.1f}% of {report['peak_flops_per_device'] / 1e12:.0f} TFLOP/s"
        return Row("profile", "single", "PASS", f"{report['samples_per_s']:.1f} samples/s, {mfu} ({report['device']})",
                   seconds, {key: report[key] for key in ("samples_per_s", "step_time_s", "mfu", "flops_per_sample",
                                                          "peak_flops_per_device", "device", "global_batch_size")})


def skipped(backend: str, checks: tuple[str, ...], reason: str) -> list[Row]:
    """One SKIP row per check, all for the same reason."""
    return [Row(check, backend, "SKIP", reason) for check in checks]


def train_records(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS
    if not path.is_file():
        return []
    return [rec for rec in map(json.loads, path.read_text().splitlines()) if rec.get("kind") == "train"]


def resume_row(backend: str, full: dict[int, float], resumed: dict[int, float], steps: range, seconds: float,
               log: Path, elastic: bool = False) -> Row:
    """The first resumed step replays the saved state exactly: its loss must equal the uninterrupted run's bit for
    bit. Later steps may drift by RESUME_TOLERANCE (relative), what GPU kernels' varying reduction order allows. An
    elastic resume draws its noise on the new ranks' own random streams, so its losses are not the uninterrupted
    run's: it must log every step with a finite loss, and the difference is reported."""
    detail = {"steps": list(steps), "uninterrupted": [full[s] for s in steps], "resumed": [resumed.get(s) for s in steps],
              "tolerance": None if elastic else RESUME_TOLERANCE}
    check = "elastic resume" if elastic else "exact resume"
    if sorted(resumed) != list(steps) or not all(math.isfinite(v) for v in resumed.values()):
        return Row(check, backend, "FAIL", f"the resume logged steps {sorted(resumed)} (losses "
                   f"{[resumed[s] for s in sorted(resumed)]}), expected {steps.start}..{steps.stop - 1} (log: {log})",
                   seconds, detail)
    worst = max(abs(resumed[s] - full[s]) / max(abs(full[s]), 1e-12) for s in steps)
    first = steps.start
    if elastic:
        return Row(check, backend, "PASS", f"steps {first}-{steps.stop - 1} logged, losses within {worst:.1e} of the "
                   "uninterrupted run's (other random streams)", seconds, detail)
    if resumed[first] != full[first]:
        return Row(check, backend, "FAIL", f"step {first}: the first resumed loss {resumed[first]!r} differs "
                   f"from the uninterrupted {full[first]!r}", seconds, detail)
    if worst == 0:
        return Row(check, backend, "PASS", f"steps {first}-{steps.stop - 1}: losses equal", seconds, detail)
    if worst <= RESUME_TOLERANCE:
        return Row(check, backend, "PASS", f"step {first} equal, steps {first + 1}-{steps.stop - 1} within "
                   f"{worst:.1e} (tolerance {RESUME_TOLERANCE:.0e})", seconds, detail)
    return Row(check, backend, "FAIL", f"step {first} equal, losses differ by up to {worst:.2e} relative (tolerance "
               f"{RESUME_TOLERANCE:.0e})", seconds, detail)


def memory_row(backend: str, planned: int, measured: int) -> Row:
    """What the memory plan says tensors hold at the peak (`MemoryPlan.allocated`: without the CUDA context, NCCL's
    buffers and the allocator's fragmentation, which max_memory_allocated does not count either) next to
    torch.cuda.max_memory_allocated. What a first GPU run must show: within 10% either way (a plan 10% high refuses
    runs that fit; 10% low launches runs that do not)."""
    from opentau_cli.plan.memory import gib

    ratio = measured / max(planned, 1)
    result = "PASS" if abs(ratio - 1) <= 0.10 else "FAIL"
    return Row("memory plan vs peak", backend, result, f"planned {gib(planned)}, measured {gib(measured)} "
               f"(max_memory_allocated / plan = {ratio:.2f}; must be within 0.90-1.10)", None,
               {"planned": planned, "measured": measured})


def table(rows: list[Row]) -> list[list[str]]:
    return [["check", "backend", "result", "key number", "seconds"]] + [
        [r.check, r.backend, r.result, r.key, "" if r.seconds is None else f"{r.seconds:.0f}"] for r in rows]


def print_table(rows: list[Row]) -> None:
    cells = table(rows)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    for n, line in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def markdown(rows: list[Row], header: dict) -> str:
    cells = table(rows)
    lines = [f"## GPU self-check{' (CPU dry run)' if header['cpu_dry_run'] else ''} ({header['when']})", "",
             f"- machine: {header['machine']}", f"- command: `{header['command']}`", "",
             "| " + " | ".join(cells[0]) + " |", "| " + " | ".join("---" for _ in cells[0]) + " |",
             *["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in cells[1:]], "",
             f"- {header['sizes']}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="Run the sequence on pi05_tiny with 1-2 CPU processes (no GPU needed): checks the script.")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"Comma-separated checks to run, of {', '.join(CHECKS)}.")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "gpu_check",
                        help="Where gpu_check.json, gpu_check.md, the command logs and the runs go.")
    parser.add_argument("--keep-runs", action="store_true", help="Keep every run directory (by default a backend's "
                        "runs are deleted once its checks pass; failed ones are kept).")
    parser.add_argument("--peak-tflops", type=float, help="Peak bf16 TFLOP/s of one GPU opentau does not know, for MFU.")
    args = parser.parse_args(argv)
    asked = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in asked if c not in CHECKS]
    if unknown or not asked:
        parser.exit(2, f"--only takes checks of {', '.join(CHECKS)}; got '{','.join(unknown) or args.only}'.\n")
    args.only = asked
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not args.cpu_dry_run:
        print("No CUDA GPU is visible; run on a GPU machine, or pass --cpu-dry-run to check the script on CPU.",
              file=sys.stderr)
        return 2
    plan = Plan.for_machine(args.cpu_dry_run, gpus)
    checker = Checker(plan, args.out, args.keep_runs, args.peak_tflops)
    rows: list[Row] = []
    for check in CHECKS:
        if check not in args.only:
            continue
        if check == "pi05":
            done = checker.full_pi05_step()
        elif check == "inference":
            done = checker.inference()
        elif check == "attention":
            done = [checker.attention()]
        elif check == "gc":
            done = checker.backend("single", "single, gradient checkpointing", ("--policy.gradient_checkpointing=true",))
        elif check == "lora":
            done = checker.backend("single", "single, LoRA r=8", ("--policy.lora.rank=8",))
        elif check == "async":
            parallel = "ddp" if plan.procs >= 2 else "single"
            done = checker.backend(parallel, f"{parallel}, async save", ("--checkpoint.async_save=true",))
        elif check == "elastic":  # a ZeRO-2 checkpoint resumed under DDP on half the GPUs, and under FSDP2 on all
            if plan.procs < 2:
                done = skipped("zero2 -> ddp on half, zero2 -> fsdp2", ("train + checkpoint", "elastic resume"),
                               "1 GPU visible")
            else:
                done = checker.backend("zero2", f"zero2 on {plan.procs} -> ddp on {plan.procs // 2}",
                                       resume_to=("ddp", plan.procs // 2))
                done += checker.backend("zero2", f"zero2 on {plan.procs} -> fsdp2 on {plan.procs}",
                                        resume_to=("fsdp2", plan.procs))
        elif check == "fsdp2" and plan.procs < 2:  # FSDP2 shards over 2 or more processes
            done = skipped("fsdp2", ("train + checkpoint", "exact resume"), "1 GPU visible")
        elif check == "eval":
            done = [checker.evaluation()]
        elif check == "profile":
            done = [checker.profile()]
        elif check == "ddp" and plan.procs < 2:
            done = skipped("ddp", ("train + checkpoint", "exact resume"), "1 GPU visible")
        else:
            done = checker.backend(check)
        print(f"[gpu_check] {check}: " + ", ".join(f"{r.check} {r.result}" for r in done), flush=True)
        rows += done
    header = {
        "when": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": command_line(),
        "cpu_dry_run": plan.cpu,
        "gpus": gpus,
        "sizes": (f"{plan.config.stem}: {plan.steps} steps saving at {plan.steps // 2}, batch {plan.batch} per process, "
                  f"mixed_precision {plan.precision}, DDP/ZeRO on {plan.procs} {'CPU processes' if plan.cpu else 'GPUs'}; "
                  f"profile {plan.profile_warmup} warm-up + {plan.profile_steps} measured steps at batch "
                  f"{plan.profile_batch}"),
    }
    (args.out / "gpu_check.json").write_text(json.dumps({**header, "rows": [asdict(r) for r in rows]}, indent=2))
    (args.out / "gpu_check.md").write_text(markdown(rows, header))
    print()
    print_table(rows)
    print(f"\nwritten: {args.out / 'gpu_check.json'}, {args.out / 'gpu_check.md'} (command logs in {args.out / 'logs'})")
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
