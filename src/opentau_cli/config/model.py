"""The one shared config model used by every command.

Precedence (lowest to highest): field defaults, the JSON file, `OPENTAU_*` environment variables
(nested with `__`, e.g. `OPENTAU_POLICY__CHUNK_SIZE=10`), dotted command-line overrides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

DEMO_DATASET = "@demo"
# A storage client's options as JSON holds them, nested ones too (S3's `config_kwargs`, fsspec's `client_kwargs`):
# which names the client takes is the client's to say (store/remote.py open_remote), in one sentence.
StoreOptions = dict[str, JsonValue]
# The policy's loss terms: the flow-matching MSE and the cross-entropy on discrete action tokens.
LOSS_TERMS = ("mse", "ce")


class Section(BaseModel):
    """A nested section: unknown keys are errors, values are re-checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# pi05's LoRA targets: the attention and MLP projections of the language model and of the action expert.
LORA_TARGETS = r"(vlm\.language_model|expert)\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
# Trained in full next to the adapters: the action / time projections (small, and new to every robot).
LORA_FULL_MODULES = ("embed_suffix", "action_out_proj")


class LoraConfig(Section):
    """Low-rank adaptation (peft): only the adapters and `full_modules` train; every other weight stays frozen."""

    rank: int = Field(0, ge=0, description="LoRA rank r; 0 = off (full fine-tuning).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the update is (alpha / rank) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: str | list[str] = Field(
        LORA_TARGETS,
        description="Modules that get adapters: a regex matched against the whole module name, or a list of names "
                    "(a module matches when its name ends with one); default: attention and MLP projections of the "
                    "language model and the action expert.",
    )
    full_modules: list[str] = Field(
        list(LORA_FULL_MODULES),
        description="Modules trained in full (a parameter trains when its name starts with '<module>.'); default: the "
                    "action / time projections.",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class PolicyConfig(Section):
    type: Literal["pi05", "pi0"] = Field("pi05", description="Policy family.")
    preset: Literal["pi05", "pi05_small", "pi05_tiny"] = Field(
        "pi05", description="Architecture size: pi05 (~3.3B), pi05_small (~100M, CPU benchmarks), pi05_tiny (a few M)."
    )
    chunk_size: int = Field(50, ge=1, description="Number of future actions predicted per sample.")
    n_action_steps: int = Field(50, ge=1, description="Actions returned by sample_actions; <= chunk_size.")
    max_state_dim: int = Field(32, ge=1, description="State is zero-padded to this width.")
    max_action_dim: int = Field(32, ge=1, description="Actions are zero-padded to this width.")
    image_resolution: tuple[int, int] = Field((224, 224), description="(height, width) every camera is resized to.")
    tokenizer_max_length: int = Field(200, ge=8, description="Prompt tokens (task text + discretized state).")
    tokenizer_path: Path | None = Field(
        None, description="Hugging Face tokenizer: a local dir or a repo id (e.g. google/paligemma-3b-pt-224); byte-level when unset."
    )
    pretrained_path: Path | None = Field(
        None, description="Weights to start from: a model.safetensors, a dir, or a Hugging Face repo id org/name[@revision] "
                          "(openpi, LeRobot, OpenTau or opentau layout, pi05 or pi0)."
    )
    pretrained_strict: bool = Field(True, description="Fail on missing/unexpected/mis-shaped tensors in pretrained_path; false loads what matches.")
    freeze_vision_encoder: bool = Field(True, description="Do not train the SigLIP vision tower.")
    train_expert_only: bool = Field(False, description="Train only the action expert (and its projections).")
    gradient_checkpointing: bool = Field(False, description="Activation checkpointing on transformer layers.")
    use_torch_compile: bool = Field(False, description="torch.compile the policy (eager under ZeRO-3).")
    knowledge_insulation: bool = Field(False, description="Detach prefix keys/values seen by the action expert.")
    discrete_action_loss: bool = Field(False, description="Add cross-entropy on uniformly binned action tokens.")
    discrete_action_bins: int = Field(256, ge=2, description="Bins for the discrete action tokens.")
    loss_weighting: dict[str, float] = Field(
        default_factory=lambda: dict.fromkeys(LOSS_TERMS, 1.0),
        description=f"Weight of each loss term ({', '.join(LOSS_TERMS)}) in the total; a term left out weighs 1.0.",
    )
    num_inference_steps: int = Field(10, ge=1, description="Euler steps in sample_actions.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA fine-tuning (rank 0 = off).")

    @field_validator("tokenizer_path", "pretrained_path", mode="before")
    @classmethod
    def _not_empty(cls, value):
        # An empty value (`--policy.tokenizer_path=`, often an unset shell variable) would become Path('.'): refused
        # rather than read as the working directory or as "not set".
        if isinstance(value, str) and not value.strip():
            raise PydanticCustomError("empty_path", "is empty: give a local path or a Hugging Face repo id (org/name), "
                                                    "or leave it out (null)")
        return value

    @field_validator("loss_weighting")
    @classmethod
    def _weigh_every_term(cls, weights: dict[str, float]) -> dict[str, float]:
        # The one place a term's default weight is stated; unknown terms are reported by rules.py.
        return {**dict.fromkeys(LOSS_TERMS, 1.0), **weights}


class DatasetSource(Section):
    """One LeRobot dataset and how its features map to the policy's inputs."""

    root: str = Field(
        DEMO_DATASET, description=f"Local LeRobot dataset dir, '{DEMO_DATASET}' for the bundled synthetic demo, or a "
                                  "dataset in object storage, s3://bucket/prefix/dataset (endpoint and credentials from "
                                  "the standard AWS variables and files): its meta/ first, then only the files the run "
                                  "reads, fetched into this machine's cache (dataset.cache_max_gb).",
    )
    repo_id: str | None = Field(
        None, description="A LeRobot dataset on the Hugging Face Hub, org/name[@revision], instead of root: what the run "
                          "reads (meta/, the selected episodes' data and cameras' videos) is downloaded into the Hugging "
                          "Face cache; with HF_HUB_OFFLINE=1 the cache alone is read.",
    )
    revision: str | None = Field(
        None, description="Branch, tag (e.g. v3.0) or commit of repo_id (default main); the run records the commit it "
                          "resolved to, and a resume stays on that commit unless given another revision.",
    )
    camera_keys: dict[str, str] = Field(
        default_factory=dict,
        description="Dataset feature -> camera slot, e.g. {'observation.images.top': 'camera0'}; empty = every image/video feature in order.",
    )
    state_key: str = Field("observation.state", description="Dataset feature used as robot state.")
    action_key: str = Field("action", description="Dataset feature used as action.")
    episodes: list[int] | None = Field(None, description="Restrict to these episode indices (None = all).")
    prompt: str | None = Field(None, description="Task prompt for frames whose dataset has no task text.")
    remote_options: StoreOptions = Field(
        default_factory=dict,
        description="Non-secret options of the object store holding root (as checkpoint.remote_options), e.g. "
                    "{\"endpoint_url\": \"http://minio:9000\"}. Credentials are never accepted here: use "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile or a role.",
    )


class MixtureMember(DatasetSource):
    """A dataset of a mixture: its own root, key mapping and episodes, and its sampling weight."""

    root: str | None = Field(None, description=f"Local LeRobot dataset dir, '{DEMO_DATASET}', or s3://bucket/prefix/dataset "
                                               "(or repo_id instead).")
    name: str | None = Field(None, description="Its name in logs, training_state.json and `dataset info`; default: the folder name.")
    weight: float = Field(1.0, gt=0, description="Sampling weight: the member's share of draws is weight / sum of weights.")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.repo_id:  # org/name[@revision] -> name
            return self.repo_id.partition("@")[0].rpartition("/")[2]
        root = self.root or ""
        return DEMO_DATASET.lstrip("@") if root == DEMO_DATASET else Path(root).name or root


class DatasetConfig(DatasetSource):
    num_cameras: int = Field(1, ge=1, description="Camera slots the policy sees; missing cameras are padded and flagged.")
    num_workers: int = Field(2, ge=0, description="DataLoader worker processes per rank.")
    video_backend: Literal["pyav"] = Field("pyav", description="Video decoder (install the 'video' extra).")
    video_cache_mb: int = Field(256, ge=1, description="Decoded, resized video frames kept per data worker (MiB).")
    cache_max_gb: float = Field(
        50.0, gt=0,
        description="Datasets in object storage: the most this machine's cache of their files ($OPENTAU_CACHE_DIR/"
                    "datasets, shared by every run on it) holds on disk; the least recently used files make room.",
    )
    remote_wait_seconds: float = Field(
        600.0, gt=0,
        description="Datasets in object storage: how long a read keeps retrying while the store does not answer "
                    "(training waits meanwhile); then the run saves a checkpoint and stops with one sentence.",
    )
    augment: Literal["none", "openpi"] = Field(
        "none", description="Training image augmentation: 'openpi' = openpi's crop, rotation and colour jitter (wrist "
                            "cameras: colour only), per sample on the device; 'none' = off.")
    mixture: list[MixtureMember] | None = Field(
        None, min_length=1,
        description="Train on several datasets sampled by weight, each with its own root, key mapping and statistics "
                    "(instead of root / camera_keys / state_key / action_key / episodes / prompt here).",
    )

    def members(self) -> list[MixtureMember]:
        """The datasets this config reads: the mixture, or the single dataset described by the fields above."""
        if self.mixture is not None:
            return list(self.mixture)
        fields = {name: getattr(self, name) for name in DatasetSource.model_fields}
        if self.repo_id is not None and self.root == DEMO_DATASET:  # root's default stands for "not given"
            fields["root"] = None
        return [MixtureMember(**fields)]


class OptimizerConfig(Section):
    type: Literal["adamw"] = "adamw"
    lr: float = Field(2.5e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip_norm: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")


class SchedulerConfig(Section):
    type: Literal["cosine_with_warmup", "constant"] = "cosine_with_warmup"
    warmup_steps: int = Field(1000, ge=0)
    decay_steps: int | None = Field(None, ge=1, description="Cosine decay length; None = the run's steps.")
    decay_lr: float = Field(2.5e-6, ge=0, description="Final learning rate of the cosine.")


class CheckpointConfig(Section):
    keep_last: int | None = Field(None, ge=1, description="Keep only the newest N complete checkpoints (None = all).")
    keep_best: int = Field(0, ge=0, description="Also keep the N best checkpoints by best_metric (0 = off); "
                                               "checkpoints/best points to the best. Needs validation.val_freq.")
    best_metric: str | None = Field(
        None,
        description="Validation key that ranks checkpoints: val_loss, val_mse_loss, ... (the trained weights) or, with "
                    "ema.decay > 0, ema_val_loss, ... (the EMA weights), or eval/success_rate (with eval.env and "
                    "best_mode max: the success rate in the simulator). Default (null): the loss of the weights "
                    "export, eval and serve use by default (ema_val_loss with the EMA, else val_loss), resolved when "
                    "the run starts and recorded in train_config.json.",
    )
    best_mode: Literal["min", "max"] = Field("min", description="Whether a smaller (min) or larger (max) best_metric is better.")
    save_on_preemption: bool = Field(True, description="On SIGTERM/SIGUSR1 finish the step, save, exit 0.")
    async_save: bool = Field(
        False,
        description="Write checkpoints in the background: a save blocks training only while the state is copied to "
                    "host memory, which holds one such copy per process for the rest of the run.",
    )
    remote: str | None = Field(
        None,
        description="Also store every published checkpoint here, with what a resume needs (the run's history as of "
                    "that checkpoint): s3://bucket/prefix/run (endpoint and credentials from the standard AWS "
                    "variables and files), file:///mounted/share/run, or another fsspec URL. Uploads run in the "
                    "background; `opentau resume URL` continues the run on a machine with an empty disk.",
    )
    remote_options: StoreOptions = Field(
        default_factory=dict,
        description="Non-secret options of the remote's client, e.g. {\"endpoint_url\": \"http://minio:9000\", "
                    "\"region\": \"eu-west-1\", \"config_kwargs\": {\"connect_timeout\": 5}} (S3: botocore's Config). Credentials are never accepted here (they would be written "
                    "into train_config.json): use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile or a role.",
    )
    remote_drain_seconds: float = Field(
        60.0, ge=0,
        description="When a launch ends (finished, preempted or failed), how long it waits for its pending uploads "
                    "before it exits and names the checkpoints that are local only.",
    )
    save_grace_seconds: float | None = Field(
        None, gt=0,
        description="The seconds a stop signal leaves before the job is killed (Kubernetes' "
                    "terminationGracePeriodSeconds, a scheduler's grace): the plan warns when a save (and, with "
                    "remote, its upload) may take longer. Default: in a SLURM job, its --signal time (SBATCH_SIGNAL "
                    "or the batch script's #SBATCH --signal); elsewhere no check.",
    )
    remote_lease_seconds: float = Field(
        120.0, ge=2,
        description="The launch writing to checkpoint.remote holds the store's lease (one writer per prefix), renewed "
                    "4 times per period; a lease with no heartbeat for this long has expired and another launch may "
                    "take it (before then it is refused, unless --break-lock).",
    )


class LoggingConfig(Section):
    tensorboard: bool = Field(True, description="Write TensorBoard events under <output_dir>/tensorboard/ (false: "
                                                "as if 'tensorboard' were left out of logging.trackers).")
    trackers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers, through Accelerate's tracker API: tensorboard, wandb, mlflow (install the "
                    "extra of the same name), or another tracker Accelerate supports. Only the main process logs; a "
                    "resume continues the same tracked run.",
    )
    project: str = Field("opentau", description="The trackers' project (W&B project, MLflow experiment).")
    run_name: str | None = Field(None, description="The tracked run's display name; default: the run directory's name.")
    tags: list[str] = Field(default_factory=list, description="Tags of the tracked run (W&B tags, MLflow tags).")

    @field_validator("trackers", "tags", mode="before")
    @classmethod
    def _comma_list(cls, value):
        # --logging.trackers=wandb,mlflow and [wandb,mlflow] as well as JSON lists
        if isinstance(value, str):
            return [item.strip().strip("'\"") for item in value.strip().strip("[]").split(",") if item.strip()]
        return value

    @property
    def uses_tensorboard(self) -> bool:
        return self.tensorboard and "tensorboard" in self.trackers
    progress_bar: Literal["auto", "rich", "plain"] = Field("auto", description="'auto': rich on a TTY, plain lines otherwise.")


EVAL_SUCCESS = "eval/success_rate"  # checkpoint.best_metric that ranks by the evaluation in a simulator


class EvalConfig(Section):
    """Closed-loop evaluation of the run's published checkpoints in a simulator, by a process of the launcher's
    (docs/ARCHITECTURE.md, "Evaluation during training")."""

    env: str | None = Field(None, description="Evaluate published checkpoints in this simulator, as `opentau eval --env` "
                                              "takes it (metaworld:TASK, pusht, aloha:transfer_cube, ...); null = off.")
    every: int = Field(1, ge=1, description="Evaluate every Nth published checkpoint (by step / save_freq; the final "
                                            "checkpoint always).")
    rollouts: int = Field(10, ge=1, description="Episodes per evaluation, from seeds seed, seed+1, ...")
    seed: int = Field(0, ge=0, description="Seed of the first episode (the same seeds at every checkpoint).")
    envs: int = Field(1, ge=1, description="Envs stepped at once, their inference batched.")
    device: str = Field("cpu", description="Where the evaluation's policy runs: cpu, cuda, cuda:N.")
    max_steps: int | None = Field(None, ge=1, description="Steps per episode (default: the env's).")
    camera_map: dict[str, str] = Field(default_factory=dict, description="{policy camera: env camera}, as "
                                                                         "`opentau eval --camera-map` takes them.")
    cpus: list[int] | None = Field(None, description="CPU cores the evaluation process is pinned to "
                                                     "(os.sched_setaffinity); null = wherever the OS puts it.")

    @property
    def enabled(self) -> bool:
        return self.env is not None


class ValidationConfig(Section):
    val_split: float = Field(0.0, ge=0, lt=1, description="Fraction of episodes held out for validation (whole episodes).")
    val_freq: int = Field(0, ge=0, description="Validate every N steps (0 = never).")
    max_batches: int | None = Field(None, ge=1, description="Cap on validation batches per rank.")


class EmaConfig(Section):
    """An exponential moving average of the trained weights, kept in fp32 beside them (openpi's recipe)."""

    decay: float = Field(
        0.0, ge=0, lt=1,
        description="After each optimizer step ema = decay * ema + (1 - decay) * weights, from the weights the run "
                    "starts with; 0 = off. openpi uses 0.99 for full fine-tuning and none with LoRA.",
    )

    @property
    def enabled(self) -> bool:
        return self.decay > 0


def machine_range(text: str) -> tuple[int, int] | None:
    """(MIN, MAX) of 'MIN:MAX' with 1 <= MIN <= MAX, else None."""
    low, sep, high = text.strip().partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        return None
    low, high = int(low), int(high)
    return (low, high) if 1 <= low <= high else None


class DistributedConfig(Section):
    timeout_minutes: float = Field(
        60, gt=0,
        description="Hang timeout: how long a rank waits in a collective (e.g. while rank 0 writes a large "
                    "checkpoint), and how long any rank may go without finishing a step, a validation or a save, "
                    "before it is stopped as hung (and the run restarted when max_restarts allows). Applied to every "
                    "backend; NCCL's own default is 10.",
    )
    max_restarts: int = Field(
        0, ge=0,
        description="Restart the ranks from the run's last checkpoint up to this many times when one fails (a crash, "
                    "a kill, a hang), through torch's elastic agent; 0 = a failure ends the run. Failures a restart "
                    "cannot cure (bad input, a checkpoint that fails verification, the same step failing again) end "
                    "it at once.",
    )
    machines: str | None = Field(
        None, description="Elastic machines 'MIN:MAX' (torch's elastic --nnodes): the run goes on while at least MIN "
                          "of its MAX machines (--num_machines) are there; a machine that leaves ends the group, the "
                          "others re-form it and continue from the last checkpoint on the smaller world, keeping the "
                          "global batch; a machine that comes back (`opentau resume RUN --machine_rank K ...`) is "
                          "admitted at the next re-forming. Needs max_restarts >= 1 and machine 0's address "
                          "(--main_process_ip). None: a fixed number of machines.",
    )
    machine_wait_seconds: float = Field(
        30, gt=0,
        description="Elastic machines: once MIN machines are there, how long a re-forming group waits for more "
                    "before it continues without them (the c10d rendezvous' last call).",
    )
    lock_wait_seconds: float = Field(
        330, ge=0,
        description="--resume=auto: how long to wait for a live run that holds the run directory's lock (a requeued "
                    "job that starts while the job it replaces still saves) before refusing; the default outlasts a "
                    "lost node's lock, taken over 300 s after its last heartbeat.",
    )

    @field_validator("machines", mode="before")
    @classmethod
    def _machine_range(cls, value):
        if value is None:
            return None
        if machine_range(str(value)) is None:
            raise PydanticCustomError("machine_range", "must be MIN:MAX, two whole numbers with 1 <= MIN <= MAX (e.g. 1:2)")
        return str(value).strip()

    @property
    def machine_range(self) -> tuple[int, int] | None:
        return machine_range(self.machines) if self.machines else None

    memory_check: bool = Field(
        True, description="Refuse a launch whose memory plan exceeds the GPU's memory (the visible card, or config "
                          "validate --gpu-memory); false launches anyway.",
    )


class TrainConfig(BaseSettings):
    """Everything a training run needs. `train_config.json` in each checkpoint is this, resolved."""

    model_config = SettingsConfigDict(
        env_prefix="OPENTAU_", env_nested_delimiter="__", extra="forbid", validate_assignment=True, nested_model_default_partial_update=True
    )

    output_dir: Path = Field(Path("outputs/train/pi05"), description="Run directory: checkpoints/, logs/, metrics.jsonl.")
    overwrite: bool = Field(False, description="Allow an existing output_dir when not resuming (its contents are replaced).")
    resume: bool = Field(False, description="Resume from the checkpoint this config was loaded from (or output_dir's newest). "
                                            "`--resume=auto` on the command line: resume output_dir's (or "
                                            "checkpoint.remote's) last checkpoint when there is one, else start.")
    config_path: Path | None = Field(None, description="Where this config was loaded from (set automatically).")
    seed: int = Field(1000, ge=0)
    steps: int = Field(30000, ge=1, description="Total optimizer steps of the run.")
    batch_size: int = Field(8, ge=1, description="Samples per process per optimizer step (= per_device_batch_size * gradient_accumulation_steps).")
    per_device_batch_size: int | None = Field(None, ge=1, description="Micro-batch per forward; None = batch_size / gradient_accumulation_steps.")
    gradient_accumulation_steps: int = Field(1, ge=1)
    log_freq: int = Field(100, ge=1, description="Log metrics every N steps.")
    save_freq: int = Field(1000, ge=1, description="Save a checkpoint every N steps (and at the last step).")

    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _fill_micro_batch(self) -> "TrainConfig":
        # Derived, so a config that only says batch_size + accumulation is complete; the consistency rule lives in rules.py.
        if self.per_device_batch_size is None and self.batch_size % self.gradient_accumulation_steps == 0:
            object.__setattr__(self, "per_device_batch_size", self.batch_size // self.gradient_accumulation_steps)
        return self

    def to_json_dict(self) -> dict:
        return self.model_dump(mode="json")

    def validation_keys(self) -> list[str]:
        """The metrics each validation reports for this config (train/trainer.py `validate`): `val_<k>` for every
        loss the policy returns (loss, mse_loss, and ce_loss with discrete_action_loss), and with the EMA on
        `ema_val_<k>` for the same losses of the EMA weights."""
        losses = ["loss", "mse_loss"] + (["ce_loss"] if self.policy.discrete_action_loss else [])
        prefixes = ["val_", "ema_val_"] if self.ema.enabled else ["val_"]
        return [prefix + loss for prefix in prefixes for loss in losses]

    @property
    def default_best_metric(self) -> str:
        """What checkpoint.best_metric null means: the loss of the weights export / eval / serve use by default
        (the EMA's when the run keeps one; docs/ARCHITECTURE.md, "EMA weights")."""
        return "ema_val_loss" if self.ema.enabled else "val_loss"
