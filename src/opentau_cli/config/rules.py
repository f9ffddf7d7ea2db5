"""Every rule that decides, before any process starts, whether a launch may run (docs/ARCHITECTURE.md, "Rules").

`validate` checks the config against itself, the Accelerate setup and a `Machine`, and runs the data and policy
checks it is handed (`opentau_cli.plan.run_plan` composes them: this package imports neither `data` nor `policies`).
`config validate`, `train`, `resume` and `profile` all reach it through `opentau_cli.plan.check_launch`.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from opentau_cli.config.accelerate import FSDP_LAYER_CLASSES, AccelerateSetup, reshard_after_forward
from opentau_cli.config.model import DEMO_DATASET, EVAL_SUCCESS, LOSS_TERMS, TrainConfig
from opentau_cli.config.paths import looks_like_url
from opentau_cli.errors import UserError

# A check of another package (the dataset's meta files, the policy's build): the problems it finds, [] when none.
Check = Callable[[TrainConfig], list[str]]


@dataclass(frozen=True)
class Machine:
    """The machine a launch is checked for: this one (`Machine.this()`), or a target described by its GPU count."""

    cuda: bool
    gpus: int  # visible CUDA devices
    target: bool = False  # described with `config validate --gpus N` rather than looked up

    @classmethod
    def this(cls) -> "Machine":
        if not cuda_is_available():
            return cls(cuda=False, gpus=0)
        import torch

        return cls(cuda=True, gpus=torch.cuda.device_count())

    @classmethod
    def with_gpus(cls, gpus: int) -> "Machine":
        if gpus < 0:
            raise UserError(f"--gpus must be 0 or more (the number of visible CUDA GPUs of the target machine), got {gpus}.")
        return cls(cuda=gpus > 0, gpus=gpus, target=True)

    @property
    def where(self) -> str:
        return "the target machine" if self.target else "this machine"

    def describe(self) -> str:
        gpus = f"{self.gpus} CUDA GPU{'s' if self.gpus > 1 else ''}" if self.gpus else "no CUDA GPU"
        return f"a machine with {gpus} (--gpus {self.gpus})" if self.target else f"this machine ({gpus})"


@dataclass
class Validated:
    """A config that passed every rule, possibly adjusted (e.g. compile downgraded), and what was said about it."""

    config: TrainConfig
    accelerate: AccelerateSetup
    machine: Machine
    warnings: list[str] = field(default_factory=list)

    @property
    def global_batch_size(self) -> int:
        return self.config.batch_size * self.accelerate.world_size


# The device files a GPU torch can use shows up as: NVIDIA's, WSL's GPU, AMD's (ROCm builds answer torch.cuda too).
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")


def cuda_is_available() -> bool:
    """torch.cuda.is_available(), without importing torch on a machine with no GPU device file: the `opentau` command
    that plans a launch there never needs torch (a second of CPU; docs/ARCHITECTURE.md, "Start-up")."""
    import glob

    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES):
        return False
    import torch

    return torch.cuda.is_available()


def asks_for_gpus(accel: AccelerateSetup) -> str:
    """What in an Accelerate YAML says it is for GPUs ("" when nothing does): `distributed_type: MULTI_GPU` or
    `gpu_ids`, unless `use_cpu: true`. The CPU recipes say MULTI_CPU / use_cpu, or name no GPUs (DeepSpeed)."""
    if accel.use_cpu:
        return ""
    if accel.distributed_type == "MULTI_GPU":
        return "distributed_type: MULTI_GPU"
    gpu_ids = (accel.raw or {}).get("gpu_ids")
    return f"gpu_ids: {gpu_ids}" if gpu_ids not in (None, "") else ""


def validate(cfg: TrainConfig, accel: AccelerateSetup, machine: Machine, checks: Sequence[Check] = ()) -> Validated:
    """Check cfg against itself, the launch and the machine, then run `checks`; returns a possibly adjusted copy.

    All problems are reported at once, in one UserError."""
    cfg = cfg.model_copy(deep=True)
    cuda = machine.cuda
    errors: list[str] = []
    warnings: list[str] = []
    zero3 = accel.backend == "deepspeed" and accel.zero_stage == 3

    # Batch arithmetic.
    micro, accum = cfg.per_device_batch_size, cfg.gradient_accumulation_steps
    if micro is None or micro * accum != cfg.batch_size:
        errors.append(
            f"batch_size ({cfg.batch_size}) must equal per_device_batch_size ({micro if micro is not None else 'unset'}) "
            f"x gradient_accumulation_steps ({accum})."
        )

    # Policy.
    if cfg.policy.n_action_steps > cfg.policy.chunk_size:
        errors.append(f"policy.n_action_steps ({cfg.policy.n_action_steps}) must be <= policy.chunk_size ({cfg.policy.chunk_size}).")
    if zero3 and cfg.policy.gradient_checkpointing:
        errors.append(
            "policy.gradient_checkpointing=true is not supported under DeepSpeed ZeRO-3; "
            "use DDP or ZeRO-1/2, or set --policy.gradient_checkpointing=false."
        )
    if zero3 and cfg.policy.use_torch_compile:
        warnings.append("policy.use_torch_compile=true is not supported under DeepSpeed ZeRO-3: running eager instead.")
        cfg.policy.use_torch_compile = False
    if cfg.policy.lora.enabled and cfg.policy.train_expert_only:
        errors.append(
            "policy.train_expert_only=true conflicts with policy.lora.rank > 0, which trains only the adapters and "
            "policy.lora.full_modules: to adapt the action expert alone set policy.lora.target_modules to "
            "'expert\\.layers\\..*_proj' and train_expert_only=false."
        )
    for term in cfg.policy.loss_weighting:
        if term not in LOSS_TERMS:
            errors.append(f"policy.loss_weighting has unknown term '{term}' (known: {', '.join(LOSS_TERMS)}).")

    # Data and validation.
    if cfg.dataset.root != DEMO_DATASET and not looks_like_url(cfg.dataset.root) and not Path(cfg.dataset.root).is_dir():
        errors.append(f"dataset.root '{cfg.dataset.root}' is not a directory (use '{DEMO_DATASET}' for the bundled demo data).")
    if cfg.validation.val_freq > 0 and cfg.validation.val_split == 0:
        errors.append("validation.val_freq > 0 needs held-out episodes: set validation.val_split (e.g. 0.1).")
    keep_best = cfg.checkpoint
    if keep_best.keep_best and keep_best.best_metric is None:
        # Recorded resolved in train_config.json, so a resumed run keeps ranking as it started (an older run's
        # recorded val_loss included).
        keep_best.best_metric = cfg.default_best_metric
    by_success = keep_best.best_metric == EVAL_SUCCESS
    if by_success and not cfg.eval.enabled:
        errors.append(f"checkpoint.best_metric {EVAL_SUCCESS} ranks checkpoints by their evaluation in a simulator: "
                      "set eval.env (e.g. metaworld:push-v3).")
    elif by_success and keep_best.best_mode != "max":
        errors.append(f"checkpoint.best_metric {EVAL_SUCCESS} is better when larger: set checkpoint.best_mode max.")
    elif by_success:
        pass
    elif keep_best.keep_best and not cfg.validation.val_freq:
        errors.append(f"checkpoint.keep_best ranks checkpoints by their validation {keep_best.best_metric}: set "
                      "validation.val_freq (and validation.val_split).")
    elif keep_best.keep_best and cfg.save_freq % cfg.validation.val_freq:
        warnings.append(f"save_freq ({cfg.save_freq}) is not a multiple of validation.val_freq "
                        f"({cfg.validation.val_freq}): only checkpoints saved at a validation step can be kept as best.")
    # best_metric must be a key each validation of this config reports (TrainConfig.validation_keys).
    metric, reported = keep_best.best_metric, cfg.validation_keys()
    if metric is not None and metric not in reported and not by_success:
        if metric.startswith("ema_") and metric.removeprefix("ema_") in reported:
            errors.append(f"checkpoint.best_metric '{metric}' is reported only with the EMA of the weights "
                          f"(ema.decay > 0): set ema.decay, or rank by {metric.removeprefix('ema_')}.")
        else:
            close = difflib.get_close_matches(metric, reported, n=1, cutoff=0.5)
            errors.append(f"checkpoint.best_metric '{metric}' is not a validation key of this run: "
                          f"{f'did you mean {close[0]!r}? ' if close else ''}(validation reports {', '.join(reported)}).")
    elif keep_best.keep_best and cfg.ema.enabled and not metric.startswith("ema_") and not by_success:
        # Kept as chosen (or as an older run recorded it): said, since RUN:best then holds the best live weights.
        warnings.append(f"checkpoint.best_metric={metric} ranks checkpoints by the trained (live) weights, while export, "
                        "eval and serve use the EMA weights by default: pass them --weights live for RUN:best, or rank "
                        f"by ema_{metric}.")

    errors.extend(remote_rules(cfg))
    errors.extend(remote_dataset_rules(cfg))

    # Schedule.
    if cfg.scheduler.type == "cosine_with_warmup" and cfg.scheduler.warmup_steps >= cfg.steps:
        warnings.append(f"scheduler.warmup_steps ({cfg.scheduler.warmup_steps}) >= steps ({cfg.steps}): the run never leaves warm-up.")

    # Launch and machine.
    if cfg.policy.preset == "pi05" and not cuda:
        errors.append(
            f"The pi05 preset (~3.3B parameters) needs CUDA GPUs: none is visible on {machine.where}, and on CPU it would "
            f"need about 55 GB of memory and minutes per step. On {machine.where} use configs/examples/pi05_tiny_config.json "
            "(or --policy.preset=pi05_small)."
        )
    if accel.backend == "fsdp":
        fsdp_errors, fsdp_warnings = fsdp_rules(cfg, accel, machine)
        errors.extend(fsdp_errors)
        warnings.extend(fsdp_warnings)
    per_machine = accel.num_processes // max(1, accel.num_machines)
    if not cuda and accel.world_size > 1 and asks_for_gpus(accel):
        # Accelerate would start every process on the CPU (8 CPU processes of pi05 in bf16): never what was meant.
        errors.append(
            f"{accel.path or 'the accelerate config'} is for GPUs ({asks_for_gpus(accel)}), and none is visible on "
            f"{machine.where}: on CPU use configs/examples/accelerate_cpu_ddp_config.yaml, "
            "accelerate_cpu_deepspeed_config.yaml or accelerate_cpu_deepspeed_zero3_config.yaml (2 CPU processes)."
        )
    if cuda and accel.backend != "single" and machine.gpus < per_machine:
        # Accelerate would start them all and every rank past the last GPU would fail on an invalid device.
        errors.append(
            f"{accel.path or 'the accelerate config'} starts {per_machine} processes per machine but {machine.where} has "
            f"{machine.gpus} visible GPU(s); set num_processes to {machine.gpus * max(1, accel.num_machines)} in a copy of that file."
        )
    if accel.mixed_precision == "fp16" and not cuda:
        errors.append("mixed_precision 'fp16' needs CUDA; use 'bf16' or 'no' on CPU.")
    if accel.mixed_precision == "fp8":
        errors.append("mixed_precision 'fp8' is not supported by opentau; use 'bf16'.")
    if accel.num_machines > 1 and not accel.main_process_ip:
        errors.append("num_machines > 1 needs the address of machine 0: main_process_ip in the accelerate config, "
                      "--main_process_ip or MASTER_ADDR.")
    if not 0 <= accel.machine_rank < accel.num_machines:
        errors.append(f"machine_rank ({accel.machine_rank}) must be from 0 to num_machines - 1 ({accel.num_machines - 1}).")
    if accel.num_machines > 1 and accel.num_processes % accel.num_machines:
        errors.append(f"num_processes ({accel.num_processes}) is the total over all machines and must be a multiple of "
                      f"num_machines ({accel.num_machines}).")
    if accel.backend == "deepspeed":
        if accel.ds_gradient_accumulation_steps is not None and accel.ds_gradient_accumulation_steps != accum:
            warnings.append(
                f"DeepSpeed gradient_accumulation_steps={accel.ds_gradient_accumulation_steps} in {accel.path} "
                f"differs from the config's gradient_accumulation_steps={accum}: using {accum}."
            )
        clip = cfg.optimizer.grad_clip_norm
        if accel.ds_gradient_clipping is not None and accel.ds_gradient_clipping != clip:
            warnings.append(
                f"DeepSpeed gradient_clipping={accel.ds_gradient_clipping} in {accel.path} "
                f"differs from the config's optimizer.grad_clip_norm={clip}: using {clip}."
            )

    for check in checks:
        errors.extend(check(cfg))

    if errors:
        if len(errors) == 1:
            raise UserError(errors[0])
        raise UserError("The config has problems:\n  " + "\n  ".join(errors))
    return Validated(config=cfg, accelerate=accel, machine=machine, warnings=warnings)


def fsdp_rules(cfg: TrainConfig, accel: AccelerateSetup, machine: Machine) -> tuple[list[str], list[str]]:
    """(errors, warnings) for an FSDP launch (cfg may be adjusted: compile downgraded): opentau trains it with FSDP2 (train/fsdp.py); every fsdp_config setting
    it cannot honour is refused by name, never run as something else (docs/ARCHITECTURE.md, "FSDP2")."""
    where = accel.path or "the accelerate config"
    errors: list[str] = []
    warnings: list[str] = []
    if accel.world_size < 2:
        errors.append(f"{where} asks for FSDP with {accel.world_size} process: FSDP2 shards over 2 or more processes; "
                      "for one process pass no accelerate config.")
    if accel.fsdp_version != 2:
        errors.append(f"{where} asks for FSDP1 (fsdp_config.fsdp_version: {accel.fsdp_version}, Accelerate's default "
                      "when absent), which opentau does not run: set fsdp_version: 2 (FSDP2, torch's fully_shard).")
    if reshard_after_forward(accel) is None:
        given = accel.fsdp_reshard_after_forward or accel.fsdp_sharding_strategy
        errors.append(f"{where} asks for sharding strategy {given}, which FSDP2 has no equivalent for in opentau: use "
                      "fsdp_reshard_after_forward: true (FULL_SHARD) or false (SHARD_GRAD_OP); for NO_SHARD use DDP "
                      "(configs/examples/accelerate_ddp_config.yaml).")
    wrap = (accel.fsdp_auto_wrap_policy or "TRANSFORMER_BASED_WRAP").upper()
    if wrap not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP"):
        errors.append(f"{where} asks for fsdp_auto_wrap_policy {accel.fsdp_auto_wrap_policy}: opentau wraps FSDP2 units "
                      "per transformer layer (TRANSFORMER_BASED_WRAP) or the whole policy as one (NO_WRAP).")
    unknown = [c for c in accel.fsdp_layer_classes or () if c not in FSDP_LAYER_CLASSES]
    if unknown:
        errors.append(f"{where} names fsdp_transformer_layer_cls_to_wrap {', '.join(unknown)}, which the policy does "
                      f"not have: its transformer layers are {', '.join(FSDP_LAYER_CLASSES)}.")
    state_dict = (accel.fsdp_state_dict_type or "SHARDED_STATE_DICT").upper()
    if state_dict != "SHARDED_STATE_DICT":
        errors.append(f"{where} asks for fsdp_state_dict_type {accel.fsdp_state_dict_type}: opentau saves FSDP2 "
                      "checkpoints sharded (torch.distributed.checkpoint); set SHARDED_STATE_DICT and use "
                      "`opentau checkpoint consolidate` for one model.safetensors.")
    if accel.fsdp_offload_params and not machine.cuda:
        errors.append(f"{where} asks for fsdp_offload_params: true, which moves parameters between GPU and host "
                      f"memory, and {machine.where} has no CUDA GPU: set it to false.")
    if accel.mixed_precision == "fp16" and machine.cuda:
        errors.append("mixed_precision 'fp16' is not supported under FSDP2 (it needs a sharded gradient scaler); use 'bf16'.")
    checkpointing = accel.fsdp_activation_checkpointing
    if checkpointing is not None and checkpointing != cfg.policy.gradient_checkpointing:
        errors.append(f"{where} sets fsdp_activation_checkpointing: {str(checkpointing).lower()} and the config "
                      f"policy.gradient_checkpointing={str(cfg.policy.gradient_checkpointing).lower()}: opentau's switch is "
                      "policy.gradient_checkpointing; make them agree (or remove the YAML key).")
    if cfg.policy.use_torch_compile:
        warnings.append("policy.use_torch_compile=true is not supported under FSDP2 yet: running eager instead.")
        cfg.policy.use_torch_compile = False
    return errors, warnings


# Option names of storage clients that carry a secret (s3fs's key / secret / token, boto3's aws_*): never in a config,
# which train_config.json records.
_SECRET_WORDS = ("secret", "token", "password", "passwd", "credential", "session", "private")
_SECRET_NAMES = ("key", "access_key", "access_key_id", "aws_access_key_id", "account_key", "sas_token")


def secret_options(options: dict, within: str = "") -> list[str]:
    """The option names of a storage client's options that carry, or may carry, a secret (nested ones dotted)."""
    found = []
    for k, v in options.items():
        if any(w in k.lower() for w in _SECRET_WORDS) or k.lower() in _SECRET_NAMES:
            found.append(within + k)
        elif isinstance(v, dict):
            found += secret_options(v, f"{within}{k}.")
    return sorted(found)


def remote_dataset_rules(cfg) -> list[str]:
    """Datasets in object storage, read without the network: no secret among their options, options only beside a
    URL, and a wait for the store shorter than the wait for a peer (else a rank waiting for its peers' data would be
    stopped as hung first). What the store says is the data check's (data/remote.py)."""
    d = cfg.dataset
    members = d.mixture if d.mixture is not None else [d]
    prefixes = [f"dataset.mixture[{i}]" for i in range(len(members))] if d.mixture is not None else ["dataset"]
    errors, remote = [], False
    for prefix, member in zip(prefixes, members):
        url = bool(member.root) and looks_like_url(member.root) and not member.repo_id
        remote = remote or url
        secret = secret_options(member.remote_options)
        if secret:
            errors.append(f"{prefix}.remote_options must not hold credentials ({', '.join(secret)}): they would be "
                          "written into train_config.json; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile "
                          "(AWS_PROFILE) or a role instead.")
        elif member.remote_options and not url:
            errors.append(f"{prefix}.remote_options is set but {prefix}.root is not in object storage (s3://...).")
    timeout = cfg.distributed.timeout_minutes * 60
    if remote and d.remote_wait_seconds >= timeout:
        errors.append(f"dataset.remote_wait_seconds ({d.remote_wait_seconds:g}) must be shorter than "
                      f"distributed.timeout_minutes ({cfg.distributed.timeout_minutes:g} min): ranks waiting for a "
                      "peer's data would be stopped as hung before the store is given up on.")
    return errors


def remote_rules(cfg) -> list[str]:
    """checkpoint.remote, read without the network: a URL with a scheme, no secret in its options, and not the run's
    own directory (what the store says is checked before launch, plan/run_plan.py check_remote)."""
    ckpt = cfg.checkpoint
    if ckpt.remote is None:
        return ["checkpoint.remote_options is set but checkpoint.remote is not."] if ckpt.remote_options else []
    errors = []
    url = ckpt.remote.strip()
    scheme, sep, rest = url.partition("://")
    if not sep or not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme) or not rest.strip("/"):
        hint = f" (file://{Path(url).absolute()} for a directory)" if not sep else ""
        errors.append(f"checkpoint.remote '{url}' is not a URL such as s3://bucket/prefix/run{hint}.")
    secret = secret_options(ckpt.remote_options)
    if secret:
        errors.append(f"checkpoint.remote_options must not hold credentials ({', '.join(sorted(secret))}): they would be "
                      "written into train_config.json; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile "
                      "(AWS_PROFILE) or a role instead.")
    if scheme == "file" and sep:
        where = Path(os.path.abspath(rest if rest.startswith("/") else "/" + rest))
        out = Path(os.path.abspath(cfg.output_dir))
        if where == out or out in where.parents or where in out.parents:
            errors.append(f"checkpoint.remote '{url}' is the run's own output_dir {out} (or overlaps it): a second "
                          "copy must live elsewhere, e.g. on a mounted share.")
    return errors
