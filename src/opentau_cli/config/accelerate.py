"""Read an Accelerate config YAML into a typed description of the launch (and keep the YAML as written, so the
launcher passes on every key it does not need to change)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, Mapping

import yaml

from opentau_cli.errors import UserError

Backend = Literal["single", "ddp", "deepspeed", "fsdp"]

# Accelerate's distributed_type values and what they mean for us.
_DISTRIBUTED_TYPES: dict[str, Backend] = {
    "NO": "single",
    "MULTI_GPU": "ddp",
    "MULTI_CPU": "ddp",
    "MULTI_NPU": "ddp",
    "MULTI_XPU": "ddp",
    "MULTI_MLU": "ddp",
    "MULTI_SDAA": "ddp",
    "MULTI_MUSA": "ddp",
    "MULTI_HPU": "ddp",
    "DEEPSPEED": "deepspeed",
    "FSDP": "fsdp",
}


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2 booleans (true / false only): `distributed_type: NO` and `dynamo_backend: NO`, as Accelerate's own
    configs spell them unquoted, stay the string 'NO' instead of becoming false."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))

_ACCELERATE_KEYS = {"distributed_type", "compute_environment", "num_processes", "mixed_precision", "use_cpu", "num_machines"}


def default_accelerate_config_path() -> Path:
    """Accelerate's default config file location (honours HF_HOME / ACCELERATE_CONFIG_DIR like Accelerate does)."""
    if os.environ.get("ACCELERATE_CONFIG_DIR"):
        return Path(os.environ["ACCELERATE_CONFIG_DIR"]) / "default_config.yaml"
    hf_home = Path(os.environ.get("HF_HOME", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"))
    return hf_home / "accelerate" / "default_config.yaml"


@dataclass(frozen=True)
class AccelerateSetup:
    """What an Accelerate YAML asks for. `path` is None for the built-in single-process default."""

    backend: Backend = "single"
    distributed_type: str = "NO"
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    mixed_precision: Literal["no", "bf16", "fp16", "fp8"] = "no"
    use_cpu: bool = False
    zero_stage: int | None = None
    ds_gradient_accumulation_steps: int | None = None
    ds_gradient_clipping: float | None = None
    ds_offload_optimizer_device: str | None = None
    ds_offload_param_device: str | None = None
    ds_zero3_init_flag: bool | None = None
    ds_config_file: str | None = None
    # fsdp_config, as written (None: not given); config/rules.py decides what opentau honours (FsdpSettings).
    fsdp_version: int | None = None
    fsdp_reshard_after_forward: str | None = None
    fsdp_sharding_strategy: str | None = None
    fsdp_auto_wrap_policy: str | None = None
    fsdp_layer_classes: tuple[str, ...] | None = None
    fsdp_state_dict_type: str | None = None
    fsdp_offload_params: bool | None = None
    fsdp_activation_checkpointing: bool | None = None
    path: Path | None = None
    raw: dict | None = None  # the YAML as the user wrote it (None: the built-in default), passed on by the launcher
    scheduler: str | None = None  # what the scheduler's environment said (with_machine), printed in the plan

    @property
    def machine_label(self) -> str:
        return f"machine {self.machine_rank} of {self.num_machines}"

    @property
    def world_size(self) -> int:
        """Total processes over all machines (Accelerate's num_processes is already the total)."""
        return self.num_processes

    @property
    def label(self) -> str:
        if self.backend == "deepspeed":
            return f"DeepSpeed ZeRO-{self.zero_stage}"
        return {"single": "single process", "ddp": "DDP", "fsdp": "FSDP2"}[self.backend]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d


def setup_from_dict(d: dict) -> AccelerateSetup:
    """The inverse of `AccelerateSetup.to_dict` (launch.json, a checkpoint's training_state.json)."""
    classes = d.get("fsdp_layer_classes")
    d = {k: v for k, v in d.items() if k != "scheduler"}  # what a scheduler said then: with_machine says it again
    return AccelerateSetup(**{**d, "path": Path(d["path"]) if d.get("path") else None,
                              "fsdp_layer_classes": tuple(classes) if classes is not None else None})


# The policy's transformer layer classes, each wrapped as one FSDP2 unit (Accelerate's fsdp_transformer_layer_cls_to_wrap
# names them the same way): SigLIP's encoder layers; the Gemma decoder layers of the VLM and of the action expert.
FSDP_LAYER_CLASSES = ("SiglipEncoderLayer", "GemmaDecoderLayer")
# Accelerate's FSDP1 sharding strategies that FSDP2 expresses as reshard_after_forward (the others it cannot).
FSDP_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


@dataclass(frozen=True)
class FsdpSettings:
    """How an FSDP2 launch shards the policy (train/fsdp.py), from a YAML that passed config/rules.py."""

    reshard_after_forward: bool = True
    offload_params: bool = False
    wrap: str = "TRANSFORMER_BASED_WRAP"  # or NO_WRAP: the root alone
    layer_classes: tuple[str, ...] = FSDP_LAYER_CLASSES
    mixed_precision: str = "no"  # "bf16": bf16 compute, fp32 reduction and fp32 master parameters


def reshard_after_forward(setup: AccelerateSetup) -> bool | None:
    """fsdp_reshard_after_forward (true / false, or FSDP1's FULL_SHARD / SHARD_GRAD_OP, as Accelerate reads it),
    else fsdp_sharding_strategy; True when neither is given; None for a value FSDP2 has no equivalent of."""
    for value in (setup.fsdp_reshard_after_forward, setup.fsdp_sharding_strategy):
        if value is None:
            continue
        text = str(value).strip().upper()
        if text in ("TRUE", "FALSE"):
            return text == "TRUE"
        text = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD", "5": "_HYBRID_SHARD_ZERO2"}.get(text, text)
        return FSDP_STRATEGIES.get(text)
    return True


def fsdp_settings(setup: AccelerateSetup) -> FsdpSettings:
    return FsdpSettings(
        reshard_after_forward=bool(reshard_after_forward(setup)),
        offload_params=bool(setup.fsdp_offload_params),
        wrap=(setup.fsdp_auto_wrap_policy or "TRANSFORMER_BASED_WRAP").upper(),
        layer_classes=setup.fsdp_layer_classes or FSDP_LAYER_CLASSES,
        mixed_precision=setup.mixed_precision,
    )


def fsdp_lines(setup: AccelerateSetup) -> list[str]:
    """What `config validate` says about an FSDP2 launch: the backend, the wrapping and the precision."""
    s = fsdp_settings(setup)
    units = (f"each transformer layer ({', '.join(s.layer_classes)}) and the root"
             if s.wrap == "TRANSFORMER_BASED_WRAP" else "the root only (NO_WRAP)")
    precision = ("bf16 compute, fp32 gradient reduction, fp32 master parameters (MixedPrecisionPolicy)"
                 if s.mixed_precision == "bf16" else "fp32")
    return [
        f"Backend: FSDP2 (torch fully_shard) over {setup.world_size} processes; checkpoints sharded with "
        "torch.distributed.checkpoint.",
        f"Wrapping: {units}; parameters {'' if s.reshard_after_forward else 'not '}resharded after forward"
        f"{', offloaded to host memory' if s.offload_params else ''}.",
        f"Precision: {precision}.",
    ]


def _int(raw: dict, key: str, default: int | None, path: Path) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise UserError(f"Accelerate config '{path}': '{key}' must be an integer, got {value!r}.")
    return int(value)


def read_accelerate_config(path: str | Path) -> AccelerateSetup:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"Accelerate config '{path}' is a directory; pass a YAML file (e.g. {path / 'default_config.yaml'}).")
    if not path.is_file():
        raise UserError(f"Accelerate config '{path}' not found.")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Yaml12Loader)
    except OSError as e:
        raise UserError(f"Cannot read Accelerate config '{path}': {e.strerror or e}.") from None
    except UnicodeDecodeError as e:
        raise UserError(f"Accelerate config '{path}' is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                        f"{e.start}); save it as UTF-8 YAML.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"Accelerate config '{path}' is not valid YAML{where}.") from None
    if not isinstance(raw, dict) or not (_ACCELERATE_KEYS & raw.keys()):
        raise UserError(
            f"'{path}' is not an Accelerate config: expected keys such as distributed_type and num_processes "
            "(create one with `accelerate config`, or copy configs/examples/accelerate_*_config.yaml)."
        )
    dtype = str(raw.get("distributed_type", "NO")).upper()
    if dtype not in _DISTRIBUTED_TYPES:
        raise UserError(
            f"Accelerate config '{path}': unknown distributed_type '{raw.get('distributed_type')}' "
            f"(supported: {', '.join(sorted(_DISTRIBUTED_TYPES))})."
        )
    backend = _DISTRIBUTED_TYPES[dtype]
    mixed = str(raw.get("mixed_precision") or "no").lower()
    if mixed not in ("no", "bf16", "fp16", "fp8"):
        raise UserError(f"Accelerate config '{path}': unknown mixed_precision '{mixed}' (no, bf16, fp16, fp8).")
    num_processes = _int(raw, "num_processes", 1, path)
    num_machines = _int(raw, "num_machines", 1, path)
    for key, value in (("num_processes", num_processes), ("num_machines", num_machines)):
        if value is not None and value < 1:  # Accelerate would quietly start one process, or fail after launch
            raise UserError(f"Accelerate config '{path}': '{key}' must be 1 or more, got {value}.")
    fields: dict = dict(
        backend=backend,
        distributed_type=dtype,
        num_processes=(num_processes or 1) if backend != "single" else 1,
        num_machines=num_machines or 1,
        machine_rank=_int(raw, "machine_rank", 0, path) or 0,
        main_process_ip=raw.get("main_process_ip"),
        main_process_port=_int(raw, "main_process_port", None, path),
        mixed_precision=mixed,
        use_cpu=bool(raw.get("use_cpu", False)),
        path=path,
        raw=raw,
    )
    if backend == "deepspeed":
        ds = raw.get("deepspeed_config") or {}
        if not isinstance(ds, dict):
            raise UserError(f"Accelerate config '{path}': deepspeed_config must be a mapping.")
        ds_file = ds.get("deepspeed_config_file")
        if ds_file:
            json_path = Path(ds_file) if Path(ds_file).is_absolute() or Path(ds_file).is_file() else path.parent / ds_file
            settings, mixed = _read_deepspeed_json(path, json_path, mixed if raw.get("mixed_precision") else None)
            ds = {**settings, "zero3_init_flag": ds.get("zero3_init_flag")}
            fields.update(ds_config_file=str(json_path.resolve()), mixed_precision=mixed)
        stage = _int(ds, "zero_stage", None, path)
        if stage not in (0, 1, 2, 3):
            raise UserError(f"Accelerate config '{path}': deepspeed_config.zero_stage must be 0-3, got {ds.get('zero_stage')!r}.")
        clip = ds.get("gradient_clipping")
        fields.update(
            zero_stage=stage,
            ds_gradient_accumulation_steps=_int(ds, "gradient_accumulation_steps", None, path),
            ds_gradient_clipping=float(clip) if clip is not None else None,
            ds_offload_optimizer_device=ds.get("offload_optimizer_device"),
            ds_offload_param_device=ds.get("offload_param_device"),
            ds_zero3_init_flag=ds.get("zero3_init_flag"),
        )
    if backend == "fsdp":
        fields.update(_read_fsdp_config(raw, path))
    return AccelerateSetup(**fields)


def _read_fsdp_config(raw: dict, path: Path) -> dict:
    """fsdp_config's keys as Accelerate spells them (with or without the fsdp_ prefix), as written."""
    fsdp = raw.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise UserError(f"Accelerate config '{path}': fsdp_config must be a mapping.")
    fsdp = {(k if str(k).startswith("fsdp_") else f"fsdp_{k}"): v for k, v in fsdp.items()}

    def text(key):
        value = fsdp.get(key)
        return None if value is None else str(value)

    def flag(key):
        value = fsdp.get(key)
        if value is None or isinstance(value, bool):
            return value
        if str(value).strip().lower() in ("true", "false"):
            return str(value).strip().lower() == "true"
        raise UserError(f"Accelerate config '{path}': fsdp_config.{key} must be true or false, got {value!r}.")

    classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [c.strip() for c in classes.split(",") if c.strip()]
    return dict(
        fsdp_version=_int(fsdp, "fsdp_version", 1, path),  # Accelerate's default is FSDP1
        fsdp_reshard_after_forward=text("fsdp_reshard_after_forward"),
        fsdp_sharding_strategy=text("fsdp_sharding_strategy"),
        fsdp_auto_wrap_policy=text("fsdp_auto_wrap_policy"),
        fsdp_layer_classes=tuple(str(c) for c in classes) if classes else None,
        fsdp_state_dict_type=text("fsdp_state_dict_type"),
        fsdp_offload_params=flag("fsdp_offload_params"),
        fsdp_activation_checkpointing=flag("fsdp_activation_checkpointing"),
    )


def _read_deepspeed_json(yaml_path: Path, json_path: Path, yaml_mixed: str | None) -> tuple[dict, str]:
    """(A relative deepspeed_config_file is taken from the working directory, else next to the YAML.) The settings the rules read from a `deepspeed_config_file` JSON, in deepspeed_config's terms, and the mixed
    precision it enables ("auto" and absent values leave them to the YAML and the config, as Accelerate does)."""
    try:
        data = json.loads(json_path.read_text())
    except OSError:
        raise UserError(f"Accelerate config '{yaml_path}': deepspeed_config_file '{json_path}' cannot be read.") from None
    except ValueError as e:
        raise UserError(f"Accelerate config '{yaml_path}': deepspeed_config_file '{json_path}' is not valid JSON ({e}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("zero_optimization"), dict):
        raise UserError(f"DeepSpeed config '{json_path}' has no zero_optimization section (Accelerate needs its stage).")

    def given(value):
        return None if value == "auto" else value

    zero = data["zero_optimization"]
    offload = {k: (zero.get(f"offload_{k}") or {}).get("device") for k in ("optimizer", "param")}
    enabled = [m for m in ("bf16", "fp16") if str((data.get(m) or {}).get("enabled")).lower() == "true"]
    json_mixed = enabled[0] if enabled else None
    if yaml_mixed is not None and json_mixed is not None and yaml_mixed != json_mixed:
        raise UserError(f"Accelerate config '{yaml_path}' asks for mixed_precision '{yaml_mixed}' and its DeepSpeed config "
                        f"'{json_path}' enables {json_mixed}: set one of them.")
    settings = {
        "zero_stage": given(zero.get("stage", 0)),
        "gradient_accumulation_steps": given(data.get("gradient_accumulation_steps")),
        "gradient_clipping": given(data.get("gradient_clipping")),
        "offload_optimizer_device": given(offload["optimizer"]),
        "offload_param_device": given(offload["param"]),
    }
    return settings, yaml_mixed or json_mixed or "no"


# The zero_optimization sizes ZeRO's buffers follow (docs/ARCHITECTURE.md, "Memory plan"), at DeepSpeed 0.19.8's
# defaults (runtime/zero/config.py), in elements. An Accelerate YAML cannot set them (Accelerate writes none of these
# keys), so a run gets these unless a deepspeed_config_file sets them.
DEEPSPEED_ZERO_DEFAULTS = {
    "reduce_bucket_size": 5 * 10**8,  # gradients are reduced in buckets of this size (ZeRO-2 and ZeRO-3)
    "stage3_prefetch_bucket_size": 5 * 10**7,  # ZeRO-3 gathers at most this much ahead of use
    "stage3_param_persistence_threshold": 10**5,  # ZeRO-3 keeps parameters this small whole on every rank
    "stage3_max_live_parameters": 10**9,  # ZeRO-3 stops prefetching with this much gathered
    "stage3_max_reuse_distance": 10**9,  # ZeRO-3 keeps a gathered parameter used again within this many elements
    "sub_group_size": 10**9,  # ZeRO-3 steps the optimizer over its partition in pieces of at most this size
}
# The sizes Accelerate fills in for "auto" from the model's width h (accelerator.prepare): h*h, 0.9*h*h and 10*h.
_AUTO_FROM_WIDTH = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                    "stage3_param_persistence_threshold": lambda h: 10 * h}


def zero_settings(zero: Mapping, hidden_size: int) -> dict[str, int]:
    """The DEEPSPEED_ZERO_DEFAULTS sizes a run gets from a zero_optimization section (a deepspeed_config_file's, or {}
    for a YAML): the number written (DeepSpeed also reads each stage3_ key without its prefix), Accelerate's value for
    "auto" from the model's `hidden_size`, else DeepSpeed's default."""
    settings = {}
    for key, default in DEEPSPEED_ZERO_DEFAULTS.items():
        value = zero.get(key, zero.get(key.removeprefix("stage3_"), default))
        if value == "auto":
            value = _AUTO_FROM_WIDTH[key](hidden_size) if key in _AUTO_FROM_WIDTH else default
        try:
            settings[key] = int(float(value))
        except (TypeError, ValueError):
            raise UserError(f"DeepSpeed config: zero_optimization.{key} must be a number or \"auto\", got {value!r}.") from None
    return settings


def deepspeed_zero_section(setup: AccelerateSetup) -> dict:
    """The zero_optimization section of the setup's deepspeed_config_file, as written ({} without one)."""
    if not setup.ds_config_file:
        return {}
    try:
        return dict(json.loads(Path(setup.ds_config_file).read_text()).get("zero_optimization") or {})
    except (OSError, ValueError, AttributeError):
        return {}


# Launch-time machine settings, in the order they win: the command line, then the cluster's environment (torchrun
# style, then SLURM's, as `srun` sets it for the command of every node), then the YAML.
MACHINE_SETTINGS = ("machine_rank", "num_machines", "main_process_ip", "main_process_port")
_MACHINE_ENV = {
    "machine_rank": ("NODE_RANK", "SLURM_NODEID"),
    "num_machines": ("NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "main_process_ip": ("MASTER_ADDR",),
    "main_process_port": ("MASTER_PORT",),
}


def with_machine(setup: AccelerateSetup, flags: Mapping[str, object] | None = None,
                 environ: Mapping[str, str] | None = None) -> AccelerateSetup:
    """`setup` with the machine settings of `flags` (None: not given), else of the environment, else the YAML's;
    so one YAML serves every node. In a SLURM job (config/scheduler.py) machine 0's address is the job's first node
    when nothing else names it, the processes are the GPUs SLURM gave each node when the YAML does not say, and a
    YAML whose num_machines differs from the job's nodes is refused."""
    from opentau_cli.config.scheduler import first_node_address, slurm_job

    environ = os.environ if environ is None else environ
    changes: dict = {}
    sources: dict = {}
    for key in MACHINE_SETTINGS:
        value, source = (flags or {}).get(key), f"--{key}"
        for var in _MACHINE_ENV[key]:
            if value is None and environ.get(var):
                value, source = environ[var], var
        if value is None:
            continue
        if key != "main_process_ip":
            if not str(value).strip().isdigit():
                raise UserError(f"{source} must be a whole number, got {value!r}.")
            value = int(value)
            if key == "num_machines" and value < 1:
                raise UserError(f"{source} must be 1 or more, got {value}.")
        changes[key] = value
        sources[key] = source
    job = slurm_job(environ)
    if job is not None:
        written = (setup.raw or {}).get("num_machines") if setup.path is not None else None
        from_slurm = sources.get("num_machines", "").startswith("SLURM_")
        if from_slurm and written is not None and int(written) != changes["num_machines"]:
            raise UserError(f"Accelerate config '{setup.path}' says num_machines {written} and this SLURM job has "
                            f"{changes['num_machines']} node{'s' * (changes['num_machines'] != 1)} "
                            f"({sources['num_machines']}): submit it with --nodes={written}, or use a config whose "
                            f"num_machines is {changes['num_machines']}.")
        machines = changes.get("num_machines", setup.num_machines)
        if machines > 1 and "main_process_ip" not in changes and not setup.main_process_ip and job.nodelist:
            changes["main_process_ip"] = first_node_address(job.nodelist)[1]
        if (setup.raw is not None and "num_processes" not in setup.raw and setup.backend != "single"
                and job.gpus_per_node):
            changes["num_processes"] = job.gpus_per_node * machines
        changes["scheduler"] = job.describe(changes.get("main_process_ip") or setup.main_process_ip)
    return replace(setup, **changes) if changes else setup


def resolve_accelerate_config(path: str | Path | None) -> AccelerateSetup:
    """The YAML the user named; else Accelerate's default config file if it exists; else one process."""
    if path is not None:
        return read_accelerate_config(path)
    default = default_accelerate_config_path()
    if default.is_file():
        return read_accelerate_config(default)
    return AccelerateSetup()
