"""What every rank builds (Accelerator, data, policy, AdamW, cosine schedule) and one training step.

`build_trainer` and `Trainer.train_step` are shared by `opentau train` (the worker's `fit`) and `opentau profile`
(which hands the step a timer and saves no checkpoints), so both run exactly the same code path.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from opentau_cli.config import AccelerateSetup, TrainConfig
from opentau_cli.data.fingerprint import FINGERPRINTS
from opentau_cli.data.remote import DataUnavailable
from opentau_cli.store.layout import EMA_STATE
from opentau_cli.store.topology import topologies, topology_entry, with_topology
from opentau_cli.train import fsdp
from opentau_cli.train.augment import ImageAugment
from opentau_cli.train.ema import WeightEMA, build_ema, ema_record, resume_ema
from opentau_cli.train.schedule import lr_factor
from opentau_cli.train.timing import NO_TIMER, StepTimer


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up, then cosine from lr down to decay_lr over decay_steps (default: the run's steps)."""
    return lr_factor(cfg.scheduler, cfg.optimizer.lr, cfg.steps)


def process_group_kwargs(cfg: TrainConfig, setup: AccelerateSetup, cuda: bool):
    """How Accelerate initializes the process group: `distributed.timeout_minutes` on every backend, CUDA or not (a
    rank waits that long in a collective while rank 0 saves), and gloo for DeepSpeed without CUDA ("CPU recipes")."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    timeout = timedelta(minutes=cfg.distributed.timeout_minutes)
    if setup.backend == "deepspeed" and not cuda:
        return InitProcessGroupKwargs(backend="gloo", timeout=timeout)
    # Accelerate picks the backend itself (nccl on CUDA, gloo for MULTI_CPU); the default field is not passed on.
    return InitProcessGroupKwargs(timeout=timeout)


def process_group_timeout():
    """The timeout the default process group was created with (None without one), read from torch's own backend
    object: what the GPU self-check and the tests compare with `distributed.timeout_minutes`."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if torch.device("cuda") in group._device_types else "cpu")
    return group._get_backend(device).options._timeout


def make_accelerator(cfg: TrainConfig, setup: AccelerateSetup, *, tensorboard_dir=None):
    """An Accelerator for this backend, with the CPU recipes of docs/ARCHITECTURE.md ("CPU recipes") when CUDA is absent."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    cuda = torch.cuda.is_available()
    kwargs: dict = dict(
        # FSDP2's MixedPrecisionPolicy casts (train/fsdp.py); Accelerate's autocast would run over it.
        mixed_precision="no" if setup.backend == "fsdp" else setup.mixed_precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        # One scheduler step per optimizer step (Accelerate would otherwise step it num_processes times).
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[process_group_kwargs(cfg, setup, cuda)],
    )
    if setup.backend == "ddp":
        from accelerate.utils import DistributedDataParallelKwargs

        # The gradients are views into DDP's all-reduce buckets instead of a second copy of them (Trainer.update
        # zeroes them in place so they stay there): one gradient-sized buffer less per GPU (docs/ARCHITECTURE.md,
        # "Memory plan").
        kwargs["kwargs_handlers"].append(DistributedDataParallelKwargs(gradient_as_bucket_view=True))
    if tensorboard_dir is not None:
        kwargs.update(log_with="tensorboard", project_config=ProjectConfiguration(project_dir=str(cfg.output_dir), logging_dir=str(tensorboard_dir)))
    if setup.backend != "deepspeed":
        kwargs["cpu"] = not cuda  # under torchrun this is MULTI_CPU over gloo, with the launcher's world size
    accelerator = Accelerator(**kwargs)
    if setup.backend == "deepspeed":
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        # We do not hand the DataLoader to prepare(), so DeepSpeed cannot infer the micro-batch.
        ds["train_micro_batch_size_per_gpu"] = cfg.per_device_batch_size
        ds["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
        ds["train_batch_size"] = cfg.per_device_batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes
        if cfg.optimizer.grad_clip_norm > 0:
            ds["gradient_clipping"] = cfg.optimizer.grad_clip_norm
        else:
            ds.pop("gradient_clipping", None)
        # "auto" bucket sizes in a deepspeed_config_file: Accelerate fills them from model.config.hidden_size, which
        # the policy does not have; the same values from its width, as the memory plan counts them.
        from opentau_cli.config.accelerate import zero_settings
        from opentau_cli.policies.pi05.configuration import hidden_size

        zero = ds.setdefault("zero_optimization", {})
        resolved = zero_settings(zero, hidden_size(cfg.policy))
        for key, value in list(zero.items()):
            name = key if key in resolved else f"stage3_{key}"  # DeepSpeed reads each stage3_ key without it too
            if value == "auto" and name in resolved:
                zero[key] = resolved[name]
    return accelerator


def is_zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def init_context(accelerator, cfg: TrainConfig):
    """ZeRO-3 builds the model inside deepspeed.zero.Init so every parameter is partitioned as it is created."""
    if not is_zero3(accelerator):
        return contextlib.nullcontext()
    zero = dict(accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}))
    config = {
        "train_micro_batch_size_per_gpu": cfg.per_device_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "zero_optimization": zero,
        "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
    }
    return _zero3_build(config)


@contextlib.contextmanager
def _zero3_build(config: dict):
    """zero.Init so the model is built partitioned; build_policy runs transformers' init on gathered parameters.

    zero.Init would also recast torch.arange to float, changing RoPE buffers; transformers' guard keeps them.
    """
    import deepspeed
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=config):
        yield


def to_device(batch: dict, device) -> dict:
    """The batch on `device` exactly as the data pipeline made it: no dtype cast, whatever the backend's precision.

    The policy normalizes raw states / actions in fp32 and casts to its compute dtype itself (docs/ARCHITECTURE.md,
    "Precision"); a bf16 cast here would round a raw reading near 1000 by up to 4 before normalization.
    """
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class StepResult:
    """What the loop learns from a step: the train metrics record (on log steps, else None) and whether some rank
    was asked to stop (preemption)."""

    record: dict | None
    stop: bool


@dataclass
class Trainer:
    """Everything one rank trains with, plus the tiny state that survives a resume (step, samples seen)."""

    cfg: TrainConfig
    setup: AccelerateSetup
    accelerator: object
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    data: object
    step: int = 0
    samples_seen: int = 0
    _sums: dict = field(default_factory=dict)
    _logged_steps: int = 0
    _grad_norm: torch.Tensor | float = float("nan")  # read on log steps only: reading it waits for the device
    _train_time: float = 0.0
    _trainable: list | None = None  # the parameters clip_gradients clips, listed on first use
    # LoRA (policies/lora.py): the record of the frozen base, and what save_state / load_state need to write and read
    # only the trained tensors.
    lora_base: dict | None = None
    save_state_kwargs: dict = field(default_factory=dict)
    load_state_kwargs: dict = field(default_factory=dict)
    # The launches the run went through before this one (training_state.json "topologies"), and the step this one
    # started at.
    topologies: list = field(default_factory=list)
    launch_step: int = 0
    # dataset.augment (train/augment.py): on the device, per sample; a no-op when off.
    augment: ImageAugment = field(default_factory=lambda: ImageAugment("none", 0))
    ema: WeightEMA | None = None  # the EMA of the trained weights (ema.decay; train/ema.py)

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.accelerator.num_processes

    def next_batch(self) -> dict:
        # The DataLoader draws a seed from the global torch RNG whenever it starts an iterator (first batch, new epoch,
        # after a resume); forking keeps those draws out of the model's random stream so a resumed run matches.
        with torch.random.fork_rng(devices=[]):
            batch = self.agreed_next(self.data.stream)
        return self.augment(to_device(self.augment.prepare(batch), self.accelerator.device))

    def agreed_next(self, batches):
        """next(batches); when the data comes from object storage, every rank then agrees that every rank has its
        batch before any computes on it: a rank whose store stayed away (DataUnavailable) stops every rank at the
        same point, from where they save together (docs/ARCHITECTURE.md, "Datasets in object storage")."""
        if not self.data.remote:
            return next(batches)
        failure = None
        try:
            batch = next(batches)
        except DataUnavailable as e:
            failure = e
        if any_rank(self.accelerator, failure is not None):
            raise first_failure(self.accelerator, failure)
        return batch

    def train_step(self, timer: StepTimer = NO_TIMER, *, stop_requested: bool = False) -> StepResult:
        """One optimizer step, then the collectives every rank runs after it: the metrics gather on log steps and the
        agreement on stopping (every step, so that no rank leaves the loop alone). The timer sees every phase; the
        step ends when its collectives do."""
        start = time.perf_counter()
        self.update(timer)
        self._train_time += time.perf_counter() - start
        self.step += 1
        self._logged_steps += 1
        self.samples_seen += self.global_batch
        with timer.phase("sync"):
            record = self.collect_metrics() if self.is_log_step() else None
            stop = any_rank(self.accelerator, stop_requested)
        timer.end_step()
        return StepResult(record=record, stop=stop)

    def update(self, timer: StepTimer) -> None:
        """One optimizer update: gradient_accumulation_steps micro-batches, clip, AdamW, schedule, zero_grad."""
        acc, accum = self.accelerator, self.cfg.gradient_accumulation_steps
        if not self.model.training:  # only validation switches it off; a walk over every module costs ~0.6 ms a step
            self.model.train()
        start = self.data.stream.state_dict() if self.data.remote else None  # only a store can go away mid-step
        for _ in range(accum):
            with timer.phase("data"):
                try:
                    batch = self.next_batch()
                except DataUnavailable:  # the step did not happen: its data position is where it began
                    self.data.stream.load_state_dict(start)
                    raise
            with acc.accumulate(self.model):
                with timer.phase("forward"):
                    out = self.model(batch)
                with timer.phase("backward"):
                    self.backward(out["loss"])
                for k, v in out.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 0:
                        self._sums[k] = self._sums.get(k, 0.0) + v.detach().float() / accum
                if acc.sync_gradients:
                    with timer.phase("optimizer"):
                        self.clip_and_step()
                        if self.ema is not None:
                            self.ema.update()
                    with timer.phase("zero_grad_sched"):
                        self.scheduler.step()
                        # DDP: zeroed in place, the gradients stay views into DDP's buckets (make_accelerator); set
                        # to None, the next backward would allocate a second copy beside the buckets.
                        self.optimizer.zero_grad(set_to_none=self.setup.backend != "ddp")

    def backward(self, loss: torch.Tensor) -> None:
        """Accelerate's backward, except that under DeepSpeed the engine's step (clip, optimizer step, ZeRO update),
        which Accelerate runs inside backward at the accumulation boundary, is left to clip_and_step. The engine
        calls and their order are those of Accelerate's DeepSpeedEngineWrapper.backward."""
        engine = self.deepspeed_engine()
        if engine is None:
            self.accelerator.backward(loss)
            return
        engine.set_gradient_accumulation_boundary(is_boundary=self.accelerator.sync_gradients)
        engine.backward(loss)

    def clip_and_step(self) -> None:
        """At the accumulation boundary: clip and step. Under DeepSpeed the engine's step does both; the gradient
        norm is then read from the engine, and the prepared optimizer's own step is a no-op."""
        engine = self.deepspeed_engine()
        if engine is not None:
            engine.step()
        self._grad_norm = self.clip_gradients()
        self.optimizer.step()

    def deepspeed_engine(self):
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        return None if wrapped is None else wrapped.engine

    def is_log_step(self) -> bool:
        return self.step % self.cfg.log_freq == 0 or self.step == self.cfg.steps

    def clip_gradients(self) -> torch.Tensor | float:
        """The global gradient norm before clipping, left on the device (no host sync outside log steps)."""
        clip = self.cfg.optimizer.grad_clip_norm
        if self._trainable is None:  # fixed once prepared (a restore loads into the same parameters)
            self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        norm = self.accelerator.clip_grad_norm_(self._trainable, clip if clip > 0 else float("inf"))
        return float("nan") if norm is None else norm

    def collect_metrics(self) -> dict:
        """Mean of each loss term over the steps since the last call, averaged over ranks (a collective).

        samples_per_s counts training steps only (not validation or checkpoint time)."""
        acc = self.accelerator
        names = sorted(self._sums)
        local = torch.stack([torch.as_tensor(self._sums[n], dtype=torch.float32) for n in names]).to(acc.device)
        mean = acc.reduce(local, reduction="mean") / max(1, self._logged_steps)
        record = {"kind": "train", "step": self.step}
        record.update({n: float(v) for n, v in zip(names, mean.tolist())})
        record["lr"] = float(self.scheduler.get_last_lr()[0])
        record["grad_norm"] = float(self._grad_norm)
        record["samples_per_s"] = self._logged_steps * self.global_batch / max(self._train_time, 1e-9)
        record["samples_seen"] = self.samples_seen
        self._sums, self._logged_steps, self._train_time = {}, 0, 0.0
        return record

    @torch.no_grad()
    def validate(self) -> dict | None:
        """Loss over the held-out episodes on every rank (ZeRO-3 needs every rank in every forward), reduced."""
        acc, loader = self.accelerator, self.data.val_loader
        cap = self.cfg.validation.max_batches
        mine = len(loader) if loader is not None else 0
        if cap:
            mine = min(mine, cap)
        n = int(min_over_ranks(acc, mine))
        if n == 0:
            return None
        record = {"kind": "val", "step": self.step, "val_batches": n * acc.num_processes}
        record.update({f"val_{k}": v for k, v in self._validation_losses(n).items()})
        if self.ema is not None:  # the same batches and noise, computed with the EMA weights
            with self.ema.swap_in():
                record.update({f"ema_val_{k}": v for k, v in self._validation_losses(n).items()})
        return record

    @torch.no_grad()
    def _validation_losses(self, n: int) -> dict[str, float]:
        acc, loader = self.accelerator, self.data.val_loader
        self.model.eval()
        sums: dict[str, torch.Tensor] = {}
        # A fixed seed per rank: comparable numbers across evaluations, and the training random stream is untouched.
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            torch.manual_seed(self.cfg.seed + 7 * acc.process_index + 1)
            it = iter(loader)
            for _ in range(n):
                batch = to_device(self.agreed_next(it), acc.device)
                out = self.model(batch)
                for k, v in out.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 0:
                        sums[k] = sums.get(k, 0.0) + v.detach().float()
        self.model.train()
        names = sorted(sums)
        total = acc.reduce(torch.stack([sums[k] for k in names]).to(acc.device), reduction="mean") / n
        return dict(zip(names, total.tolist()))

    def state_dict(self) -> dict:
        from opentau_cli import __version__
        from opentau_cli.policies.lora import BASE_KEY

        import accelerate
        import transformers

        versions = {"opentau": __version__, "torch": torch.__version__, "accelerate": accelerate.__version__,
                    "transformers": transformers.__version__}
        if self.setup.backend == "deepspeed":
            import deepspeed

            versions["deepspeed"] = deepspeed.__version__
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "sampler": self.data.stream.state_dict(),
            # Summed over ranks; follows from the data position (docs/ARCHITECTURE.md, "Data order").
            "samples_per_dataset": dict(zip(self.data.names, self.data.stream.samples_per_dataset())),
            # Each dataset's own statistics: what serves the policy on that dataset's robot.
            "datasets": [{"name": name, "weight": weight, "stats": stats}
                         for name, weight, stats in zip(self.data.names, self.data.weights, self.data.member_stats)],
            "dataset_revisions": self.data.revisions,  # the Hub datasets' commits, which a resume stays on
            FINGERPRINTS: self.data.fingerprints,  # the local datasets' files, which a resume checks (data/fingerprint.py)
            "world_size": self.accelerator.num_processes,
            "backend": self.setup.backend,
            "zero_stage": self.setup.zero_stage if self.setup.backend == "deepspeed" else None,
            "mixed_precision": self.setup.mixed_precision,
            "preset": self.cfg.policy.preset,
            "seed": self.cfg.seed,
            "accelerate": self.setup.to_dict(),
            "topologies": with_topology(self.topologies, topology_entry(self.launch_step, self.setup, self.cfg)),
            "versions": versions,
            **({BASE_KEY: self.lora_base} if self.lora_base is not None else {}),
            **({EMA_STATE: ema_record(self.ema)} if self.ema is not None else {}),
        }

    def checkpoint_files(self) -> dict:
        """The files this rank adds to a checkpoint beside Accelerate's save_state: its EMA's (train/ema.py)."""
        return self.ema.files() if self.ema is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.step = self.launch_step = int(state["step"])
        self.samples_seen = int(state.get("samples_seen", 0))
        self.topologies = topologies(state)
        self.data.stream.load_state_dict(state["sampler"])

    def share_prompt_tokenizer(self) -> None:
        """The data workers tokenize prompts by the policy's rule with the statistics it holds now: after the build
        (and accelerate.prepare), and again after a restore, whose checkpoint brings its own."""
        self.data.set_prompt_tokenizer(self.accelerator.unwrap_model(self.model).prompt_tokenizer())

    def restore(self, checkpoints, ckpt_dir) -> dict:
        """Resume from `ckpt_dir`: Accelerate's load_state under the topology it was saved by (`checkpoints`: the
        run's CheckpointManager), else an elastic resume (train/reshard.py). Returns the checkpoint's training
        state."""
        from opentau_cli.store.runs import read_training_state
        from opentau_cli.store.topology import is_reshard
        from opentau_cli.train.reshard import load_resharded

        resharded = is_reshard(read_training_state(ckpt_dir), self.setup)
        if resharded:
            state = load_resharded(ckpt_dir, self.accelerator, self.model, self.optimizer, self.scheduler, seed=self.cfg.seed)
        else:
            state = checkpoints.load(ckpt_dir)
        self.load_state_dict(state)
        self.share_prompt_tokenizer()
        self.ema = resume_ema(self.ema, state, ckpt_dir, self.accelerator, self.model, resharded=resharded)
        return state


def min_over_ranks(accelerator, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=accelerator.device)
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def any_rank(accelerator, flag: bool) -> bool:
    """True when flag is set on any rank (a collective: every rank must call it at the same point). The flag travels
    on the host over gloo, so asking every step never waits for the device's queued work."""
    if accelerator.num_processes == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, group=host_group())
    return bool(t.item() > 0)


def first_failure(accelerator, failure: DataUnavailable | None) -> DataUnavailable:
    """The failure of the lowest rank that had one, on every rank (a collective, after any_rank said one did)."""
    import torch.distributed as dist

    if accelerator.num_processes == 1:
        return failure
    everyone = [None] * accelerator.num_processes
    dist.all_gather_object(everyone, None if failure is None else (type(failure).__name__, str(failure)),
                           group=host_group())
    name, text = next(f for f in everyone if f is not None)
    return next(c for c in (DataUnavailable, *DataUnavailable.__subclasses__()) if c.__name__ == name)(text)


_HOST_GROUP: dict = {}


def host_group():
    """A gloo process group over every rank for small host-side agreements (None: the default group is gloo already),
    with the default group's timeout (distributed.timeout_minutes: it waits while rank 0 saves). Created on first use,
    which every rank reaches at the same point (the first step's stop agreement)."""
    import torch.distributed as dist

    if "group" not in _HOST_GROUP:
        _HOST_GROUP["group"] = None if dist.get_backend() == "gloo" else \
            dist.new_group(backend="gloo", timeout=process_group_timeout())
    return _HOST_GROUP["group"]


def build_policy_model(cfg: TrainConfig, stats: dict, accelerator, console=None) -> torch.nn.Module:
    """The policy (partitioned under ZeRO-3), started from `policy.pretrained_path` when set. The load report goes
    into the run's log with every name and, from rank 0, its summary to `console` (the launcher's terminal)."""
    from accelerate.utils import set_seed

    # zero.Init patches torch.Tensor.__new__; modules imported lazily inside it (torch._dynamo via transformers)
    # fail to import, so load them first (the policy package imports its own modules eagerly for the same reason).
    import torch._dynamo  # noqa: F401

    from opentau_cli.policies import build_policy, build_pretrained, load_pretrained
    from opentau_cli.policies.lora import apply_lora

    lora = cfg.policy.lora
    loads = cfg.policy.pretrained_path is not None and not (cfg.resume and not lora.enabled)
    with init_context(accelerator, cfg):
        set_seed(cfg.seed)  # seeded here, inside the context: entering zero.Init draws from the RNG
        if loads and not is_zero3(accelerator):
            # Built without random initialization, each parameter read from the file into its own storage: about
            # one copy of the weights in host RAM per rank. Before build_trainer seeds each rank, only LoRA's
            # adapters draw from the RNG: without LoRA the initialization's draws are skipped too.
            model, report = build_pretrained(cfg.policy, stats, dataset_stats=stats, rng_draws=lora.enabled)
        else:
            model = build_policy(cfg.policy, stats)
    if cfg.policy.pretrained_path is not None and not loads:
        print(f"Resuming: the checkpoint's weights replace policy.pretrained_path={cfg.policy.pretrained_path} (not read).", flush=True)
    elif loads:
        if is_zero3(accelerator):
            # Every rank matches the checkpoint (the same refusals everywhere); rank 0 fills one gathered parameter
            # at a time, so no rank ever holds a second full copy of the model.
            report = load_pretrained(model, cfg.policy.pretrained_path, strict=cfg.policy.pretrained_strict,
                                     dataset_stats=stats, partitioned=True)
        if accelerator.is_main_process:
            print(report.full(), flush=True)
            if console is not None:
                console.write(report.summary() + "\n")
                console.flush()
    if lora.enabled:
        # On the loaded base, also when resuming: a LoRA checkpoint holds only what trains.
        apply_lora(model, lora)
    if cfg.policy.use_torch_compile and not is_zero3(accelerator):
        model.compile()  # in place: state_dict keys stay those of the plain module
    return model


def build_trainer(cfg: TrainConfig, setup: AccelerateSetup, *, tensorboard_dir=None, console=None) -> Trainer:
    """Build everything a rank trains with. Order is fixed (seed, data, model, optimizer, prepare, per-rank seed) so
    that a resumed run draws random numbers exactly as the original did."""
    from accelerate.utils import set_seed

    from opentau_cli.data import build_data
    from opentau_cli.policies.lora import base_reference, register_checkpoint_hooks

    accelerator = make_accelerator(cfg, setup, tensorboard_dir=tensorboard_dir)
    set_seed(cfg.seed)  # same initial weights on every rank and every backend
    data = build_data(cfg, accelerator.process_index, accelerator.num_processes)
    model = build_policy_model(cfg, data.stats, accelerator, console)
    if data.is_mixture and cfg.policy.pretrained_path is not None and not cfg.resume:
        # The members were carried into data.stats as they were loaded (data/mixture.py): the policy normalizes with
        # exactly those, whatever statistics the pretrained checkpoint brought.
        model.set_stats(data.stats)
        if accelerator.is_main_process:
            print("Mixture: each dataset is normalized with its own statistics; those of policy.pretrained_path are not used.", flush=True)
    if setup.backend == "fsdp":  # sharded before the optimizer is made: it steps the shards (train/fsdp.py)
        model = fsdp.shard_for_launch(model, setup, accelerator)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    lora = {}
    if cfg.policy.lora.enabled:
        save_kwargs, load_kwargs = register_checkpoint_hooks(accelerator, model)
        base = base_reference(cfg.policy, cfg.seed) if accelerator.is_main_process else None  # rank 0 writes it
        lora = dict(lora_base=base, save_state_kwargs=save_kwargs, load_state_kwargs=load_kwargs)
    if setup.backend == "fsdp":
        model, optimizer, scheduler = fsdp.prepare(accelerator, model, optimizer, scheduler, lora=cfg.policy.lora.enabled)
    else:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    set_seed(cfg.seed + accelerator.process_index)  # each rank its own noise / flow-matching time stream
    trainer = Trainer(cfg=cfg, setup=setup, accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                      data=data, augment=ImageAugment(cfg.dataset.augment, cfg.seed), ema=build_ema(cfg, accelerator, model), **lora)
    if setup.backend == "fsdp":  # the EMA's shards are saved with the model's (train/fsdp.py)
        fsdp.checkpoint_ema(accelerator, lambda: trainer.ema)
    trainer.share_prompt_tokenizer()
    return trainer
