"""The memory plan: the peak memory per GPU of a configured run, computed before launch without a GPU.

docs/ARCHITECTURE.md, "Memory plan". The peak is the largest of a training step's phases, each on top of what lives
through the whole run for the backend (weights, AdamW state, fp32 master weights, the EMA, DDP's gradient buckets,
DeepSpeed's buffers, each divided among the ranks as the ZeRO stage divides it):
- forward: the activations the forward keeps for the backward, with the gradients that live then (under gradient
  accumulation the previous micro-batches');
- backward: activations being freed as gradients appear (all of them at once without DDP or ZeRO; under DDP they
  land in the buckets, under ZeRO in this rank's partition and the reduce bucket);
- optimizer: the gradients (or their partition), AdamW's temporaries and the EMA's update.
What a step allocates is measured by running the real policy's loss and backward on fake tensors (no memory, no
compute) at the configured per-device batch and shapes, under the backend's precision, with a tracker of live storage
that tells gradients from everything else (plan/measure.py, the only part that needs torch; its results are kept on
disk). Then the device's own costs: on CUDA the context, NCCL's buffers and the caching allocator's fragmentation; on
CPU (what a test can measure) glibc's retention of freed memory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from opentau_cli.config import AccelerateSetup, TrainConfig
from opentau_cli.config.accelerate import deepspeed_zero_section, zero_settings
from opentau_cli.config.load import deep_merge
from opentau_cli.config.model import PolicyConfig
from opentau_cli.errors import UserError

GIB = 2**30
MIB = 2**20
# train/ema.py updates at most this many values at a time (its CHUNK): one fp32 temporary of that size.
EMA_CHUNK = 1 << 24

# The device's own costs, each with where its figure comes from (docs/ARCHITECTURE.md, "Memory plan").
# CUDA's context with torch's kernels loaded: what nvidia-smi shows for a process that has allocated no tensor,
# 0.5-0.8 GiB on A100/H100 with CUDA 12; the upper end.
CUDA_CONTEXT = 800 * MIB
# NCCL's buffers for the default process group: NCCL_BUFFSIZE (4 MiB, NCCL's documented default) per channel, for
# sending and receiving, to each of the 2 ring neighbours, with up to 32 channels over NVLink: 4 x 32 x 2 x 2 MiB.
NCCL_BUFFERS = 512 * MIB
# The caching allocator's fragmentation, as a share of the peak allocated: blocks it reserved but cannot reuse for
# the request at hand (torch.cuda.memory_reserved above memory_allocated), commonly several percent in training;
# 10% until the GPU self-check's reserved / allocated row measures it.
CUDA_FRAGMENTATION = 0.10
# The same under ZeRO-3, whose every module gathers its parameters into new buffers of their own sizes on a stream of
# their own and frees them again: 20%. Published measurements bound it: reserved 23% above allocated for ZeRO-3
# against 9% for ZeRO-2 on one model with room to spare (DeepSpeed issue 3734); on the upstream tool's pi05 guide
# run, ZeRO-3 holding more than ZeRO-2 at 8 per GPU though it allocates less (above 15%) and fitting 80 GB cards at
# 16 (at most 20%). docs/ARCHITECTURE.md, "Memory plan"; docs/PUBLISHED_MEMORY.md.
CUDA_FRAGMENTATION_ZERO3 = 0.20
# glibc's retention on CPU, as a share of the peak allocated: freed blocks below its dynamic mmap threshold (raised
# up to 32 MiB as large blocks are freed) stay in its heaps instead of going back to the kernel. Measured on
# pi05_small at 224x224, 16 per device (benchmarks/bench_memory_plan.py --glibc default, BENCHMARKS.md): 12% (DDP with
# ema.decay, ZeRO-3) to 37% (ZeRO-2 with gradient checkpointing) above what the plan allocates, which the same
# launches reach with MALLOC_MMAP_THRESHOLD_=131072 (every freed block returned at once); a middle figure. It does not
# cover FSDP2 on CPU: each unit's all-gather and reduce-scatter buffers, freed and allocated again every layer, stay in
# the heaps, about 0.6 GiB per rank on pi05_small whatever the batch (docs/ARCHITECTURE.md, "Memory plan").
CPU_RETENTION = 0.25
# Part of the cache key of step measurements, with a hash of this file and of the policy's code.
MEASURE_VERSION = 3


def gib(n: int) -> str:
    """Bytes as nvidia-smi counts them: GiB (1024^3 bytes), MiB below one GiB."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


@dataclass(frozen=True)
class StepBytes:
    """What one forward + backward allocates on top of the weights, measured (`step_bytes`)."""

    forward: int  # the peak during the forward: at its end, the activations kept for the backward
    backward: int  # the peak of everything but gradients over forward and backward (gradients elsewhere: DDP, ZeRO)
    backward_with_gradients: int  # the peak with the gradients as they appear (none before the step)
    gradients: int  # every gradient, at the end


# Bytes per element of the weights' dtypes step_precision names.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def step_precision(setup: AccelerateSetup) -> tuple[str, bool]:
    """(dtype the weights are held in, "float32" or "bfloat16"; whether bf16 autocast runs): DeepSpeed bf16 holds bf16
    weights, Accelerate's bf16 elsewhere is autocast over fp32 weights."""
    bf16 = setup.mixed_precision == "bf16"
    if setup.backend in ("deepspeed", "fsdp") and bf16:  # FSDP2 computes with bf16 copies of its fp32 shards
        return "bfloat16", False
    return "float32", bf16


@functools.cache  # a process's code does not change while it runs: read once, not per measurement
def _code_version() -> str:
    """What the measurements and the policy's sizes depend on besides their inputs: this file, plan/measure.py and the
    policies' code (found, not imported: importing it imports transformers)."""
    import importlib.util

    digest = hashlib.sha256(Path(__file__).read_bytes() + Path(__file__).with_name("measure.py").read_bytes())
    for folder in importlib.util.find_spec("opentau_cli.policies").submodule_search_locations:
        for path in sorted(Path(folder).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _library_versions() -> list[str | None]:
    """The versions of what builds the policy (read from the installed metadata, nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return [installed("torch"), installed("transformers"), installed("peft")]


def step_bytes(policy_cfg: PolicyConfig, batch: int, cameras: int, weights_dtype: str, autocast: bool) -> StepBytes:
    """What one forward + backward of the full-size model allocates, on fake tensors (plan/measure.py). Kept on disk
    per shape and precision (and code and library versions: _kept_on_disk)."""
    def measured() -> StepBytes:
        from opentau_cli.plan import measure

        return StepBytes(**measure.step_bytes(policy_cfg, batch, cameras, weights_dtype, autocast))

    key = [policy_cfg.model_dump(mode="json"), batch, cameras, weights_dtype, autocast]
    return _kept_on_disk("step", StepBytes, key, measured)


def _kept_on_disk(kind: str, cls, key: list, measure):
    """A result of `measure()` (a `cls`), kept in cache_dir() under a hash of `key`, MEASURE_VERSION, the measured
    code's version and the versions of the libraries that build the policy (torch, transformers, peft: another
    transformers may lay out attention, and so the activations, otherwise): read back when whole and of `cls`'s fields,
    else measured again. Written under another name and renamed into place, so a launch that reads it meanwhile finds it
    whole or absent."""
    digest = hashlib.sha256(json.dumps([kind, MEASURE_VERSION, _code_version(), _library_versions(), *key],
                                    sort_keys=True).encode())
    cache = cache_dir() / f"{kind}_{digest.hexdigest()[:20]}.json"
    with contextlib.suppress(OSError, ValueError, TypeError):
        return cls(**json.loads(cache.read_text()))
    result = measure()
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        written = cache.with_name(f".{cache.name}.{os.getpid()}")
        written.write_text(json.dumps(result.__dict__))
        os.replace(written, cache)
    return result


def cache_dir() -> Path:
    root = os.environ.get("OPENTAU_CACHE_DIR") or Path.home() / ".cache" / "opentau"
    return Path(root) / "memory_plan"


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of the configured policy, from a build on the meta device."""

    total: int
    trainable: int
    largest_trainable: int  # elements of the largest trainable tensor (CPU AdamW's temporaries)
    largest_layer: int = 0  # elements of the largest transformer layer (an FSDP2 unit, train/fsdp.py)
    root: int = 0  # elements outside every transformer layer (FSDP2's root unit and the fp32 modules)
    hidden_size: int = 0  # the width DeepSpeed's "auto" bucket sizes follow (policies/pi05/configuration.py)


def sizes(policy_cfg: PolicyConfig) -> Sizes:
    from opentau_cli.plan import measure

    return Sizes(**measure.sizes(policy_cfg))


@dataclass(frozen=True)
class ModuleTrace:
    """The order in which a forward uses the policy's parameters, as ZeRO-3's hooks see it: every parameter's size,
    the parameters each module owns itself (those ZeRO-3 gathers for it), and the forward as module events, +m+1 when
    module m starts, -(m+1) when it ends; `grad_out[m]`: its output needs a gradient (only then does ZeRO-3 gather
    it again in the backward)."""

    numels: list[int]
    module_params: list[list[int]]
    forward: list[int]
    grad_out: list[bool]

    def events(self) -> list[tuple[bool, int, bool]]:
        """(fetch, module, in the backward) for the forward, then the backward: the forward's events reversed, a
        module gathered when its output's gradient arrives and released once its inputs' are computed."""
        forward = [(e > 0, abs(e) - 1, False) for e in self.forward]
        backward = [(not fetch, m, True) for fetch, m, _ in reversed(forward) if self.grad_out[m]]
        return forward + backward


def module_trace(policy_cfg: PolicyConfig, cameras: int) -> ModuleTrace:
    """The ModuleTrace of the full-size policy, from one forward on fake tensors of the configured shapes (batch 1,
    plan/measure.py). Kept on disk like step_bytes."""
    def measured() -> ModuleTrace:
        from opentau_cli.plan import measure

        return ModuleTrace(**measure.module_trace(policy_cfg, cameras))

    return _kept_on_disk("trace", ModuleTrace, [policy_cfg.model_dump(mode="json"), cameras], measured)


def zero3_gathered(trace: ModuleTrace, settings: dict[str, int]) -> tuple[int, int]:
    """The elements ZeRO-3 holds gathered, beyond the parameters it keeps whole: the most during the forward, and as
    the backward starts (where the activations peak; later in the backward it may gather more, with most activations
    freed), as DeepSpeed's parameter coordinator decides once it has recorded the step's trace (from the second step
    on; runtime/zero/partitioned_param_coordinator.py): each module's own parameters are gathered when it starts and
    released when it ends unless used again within stage3_max_reuse_distance elements of the trace; parameters are
    fetched ahead in trace order, up to stage3_prefetch_bucket_size at a time while fewer than
    stage3_max_live_parameters are gathered. docs/ARCHITECTURE.md, "Memory plan"."""
    import bisect
    from collections import defaultdict, deque

    numels, own = trace.numels, trace.module_params
    persist = [n <= settings["stage3_param_persistence_threshold"] for n in numels]
    events = trace.events()
    fetched = [m for fetch, m, _ in events if fetch]  # the module order ZeRO-3 records
    reach = [0]  # elements of the modules before each trace position
    uses: dict[int, list[int]] = defaultdict(list)  # parameter -> trace positions using it
    for position, m in enumerate(fetched):
        reach.append(reach[-1] + sum(numels[p] for p in own[m]))
        for p in own[m]:
            uses[p].append(position)
    queue = deque((p, position) for position, m in enumerate(fetched) for p in sorted(set(own[m])))
    fetched_for: dict[int, float] = defaultdict(lambda: float("-inf"))
    available: set[int] = set()
    live = gathered = 0  # every gathered element (the prefetch budget's count); those not kept whole
    peak, at_backward = 0, None
    position = 0

    def gather(p: int) -> None:
        nonlocal live, gathered
        available.add(p)
        live += numels[p]
        gathered += 0 if persist[p] else numels[p]

    for fetch, m, backward in events:
        if fetch:
            params = set(own[m])
            for _ in [p for p in params if fetched_for[p] < position]:  # this module's entries, unless fetched ahead
                p, used_at = queue.popleft()
                fetched_for[p] = used_at
            for p in params - available:
                gather(p)
            budget, ahead, chosen = min(settings["stage3_max_live_parameters"] - live,
                                        settings["stage3_prefetch_bucket_size"]), 0, []
            while queue and ahead < budget:
                p, used_at = queue.popleft()
                fetched_for[p] = max(fetched_for[p], used_at)
                if p not in available and p not in chosen:
                    chosen.append(p)
                    ahead += numels[p]
            for p in chosen:
                gather(p)
            if not backward:
                peak = max(peak, gathered)
            elif at_backward is None:
                at_backward = gathered
            position += 1
        else:
            for p in set(own[m]) & available:
                later = bisect.bisect_left(uses[p], position)
                reused = later < len(uses[p]) and reach[uses[p][later]] - reach[position] < settings["stage3_max_reuse_distance"]
                if not persist[p] and not reused and fetched_for[p] <= position:
                    available.discard(p)
                    live -= numels[p]
                    gathered -= numels[p]
    return peak, at_backward or 0


@dataclass
class MemoryPlan:
    """Peak bytes per GPU of one configured run: what lives through the run, each phase of a step on top of it (the
    peak is the largest), the model's build when it holds more than any step (FSDP2 on CPU), and the device's own
    costs."""

    label: str  # backend, world size, per-device batch, checkpointing
    lives: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # forward / backward / optimizer -> their parts
    device_costs: dict[str, int] = field(default_factory=dict)
    build: dict[str, int] = field(default_factory=dict)  # what the model's build holds, before anything of `lives`

    @property
    def build_is_peak(self) -> bool:
        return sum(self.build.values()) > self.step_peak

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: sum(self.phases[name].values()))

    @property
    def step_peak(self) -> int:
        """What lives through the run plus the largest phase of a step."""
        return sum(self.lives.values()) + sum(self.phases[self.peak_phase].values())

    @property
    def allocated(self) -> int:
        """The peak of what tensors hold: a step's (`step_peak`), or the build's where that is larger."""
        return max(self.step_peak, sum(self.build.values()))

    @property
    def total(self) -> int:
        return self.allocated + sum(self.device_costs.values())

    @property
    def parts(self) -> dict[str, int]:
        """Every part of the peak, added up to `total`: what lives, the peak phase's parts (or the build's), the
        device's costs."""
        if self.build_is_peak:
            return {**self.build, **self.device_costs}
        parts = dict(self.lives)
        for name, n in self.phases[self.peak_phase].items():
            parts[name] = parts.get(name, 0) + n
        return {**parts, **self.device_costs}

    def fits(self, card: int) -> bool:
        return self.total <= card

    def describe(self, card: int | None = None) -> str:
        def listed(parts: dict[str, int]) -> str:
            return ", ".join(f"{name} {gib(n)}" for name, n in parts.items() if n)

        steps = "; ".join(f"{name} {gib(sum(p.values()))}" for name, p in self.phases.items())
        peak = self.peak_phase
        step = (f"through the run {gib(sum(self.lives.values()))} ({listed(self.lives)}) + the {peak} "
                f"{gib(sum(self.phases[peak].values()))} ({listed(self.phases[peak])}; by phase: {steps})")
        if self.build_is_peak:
            head = (f"the model's build {gib(sum(self.build.values()))} ({listed(self.build)}; above a step's "
                    f"{gib(self.step_peak)}: {step})")
        else:
            head = step
        line = f"{gib(self.total)} peak per GPU ({self.label}) = {head} + {listed(self.device_costs)}"
        if card:
            verdict = "fits" if self.fits(card) else "does NOT fit"
            line += f"; {verdict} a {gib(card)} card (margin {gib(card - self.total)})"
        return line


_SIZES: dict[str, Sizes] = {}


def cached_sizes(policy_cfg: PolicyConfig) -> Sizes:
    """`sizes`, once per process and on disk per config, version of the policies' code and of the libraries that build
    the policy: a launch of a policy built before plans without importing transformers (docs/ARCHITECTURE.md,
    "Start-up"). A policy whose build reads a tokenizer directory is built every time (the key does not hold its
    files), and a policy that cannot be built is never cached: its refusal comes from the build, every time."""
    key = policy_cfg.model_dump_json()
    if key not in _SIZES:
        if policy_cfg.tokenizer_path is None:
            _SIZES[key] = _kept_on_disk("sizes", Sizes, [policy_cfg.model_dump(mode="json")], lambda: sizes(policy_cfg))
        else:
            _SIZES[key] = sizes(policy_cfg)
    return _SIZES[key]


def parameter_counts(policy_cfg: PolicyConfig) -> dict[str, int]:
    """Total and trainable parameters of the configured policy (with policy.lora on, of the adapted policy: which also
    checks that its targets exist), from a build on the meta device (`cached_sizes`)."""
    s = cached_sizes(policy_cfg)
    return {"total": s.total, "trainable": s.trainable}


def plan_memory(cfg: TrainConfig, setup: AccelerateSetup, device: str = "cuda") -> MemoryPlan:
    """The memory plan of `cfg` launched with `setup` on `device` ("cuda", or "cpu": what a CPU launch of the same
    run holds; docs/ARCHITECTURE.md, "Memory plan")."""
    s = cached_sizes(cfg.policy)
    world = max(1, setup.world_size)
    weights_dtype, autocast = step_precision(setup)
    w = DTYPE_BYTES[weights_dtype]
    batch = cfg.per_device_batch_size or cfg.batch_size
    step = step_bytes(cfg.policy, batch, cfg.dataset.num_cameras, weights_dtype, autocast)
    accumulates = cfg.gradient_accumulation_steps > 1
    stage = setup.zero_stage if setup.backend == "deepspeed" else None
    cpu = device == "cpu"

    def shard(n: int) -> int:
        return -(-n // world)

    # AdamW's temporaries: on CUDA torch's foreach step takes the square root of every second moment at once (one
    # fp32 copy of what it updates); on CPU it updates one tensor at a time, holding two fp32 copies of that tensor
    # (the square root and its quotient). ZeRO hands it one flat fp32 partition.
    updated = s.trainable if stage is None else shard(s.trainable)
    largest = s.largest_trainable if stage is None else updated
    adamw_temporaries = 8 * largest if cpu else 4 * updated
    fsdp = setup.backend == "fsdp"
    # train/ema.py: each rank averages its own ZeRO partition or FSDP2 shard (fp32 under FSDP2 whatever the compute
    # dtype: the shards are the master weights), else the whole of what trains.
    ema = (s.trainable if stage is None and not fsdp else shard(s.trainable)) if cfg.ema.enabled else 0
    optimizer: dict[str, int] = {"AdamW temporaries": adamw_temporaries}
    if ema:
        optimizer["EMA update temporary"] = 4 * min(EMA_CHUNK, ema) * (2 if w != 4 and not fsdp else 1)
    lives: dict[str, int] = {}
    build: dict[str, int] = {}
    if fsdp:
        lives, forward, backward, optimizer = _fsdp_phases(s, step, world, w, accumulates, cpu, optimizer)
        build = _fsdp_build(s, world, cpu)
    elif stage is None:
        lives["weights"] = w * s.total
        lives["AdamW state"] = 8 * s.trainable
        if setup.backend == "ddp":
            # train/trainer.py: the gradients are views into DDP's all-reduce buckets (gradient_as_bucket_view),
            # zeroed in place: they live through the run; the backward's own gradient tensors are copied in and freed.
            lives["gradients (DDP buckets)"] = step.gradients
            forward = {"activations": step.forward}
            backward = {"activations": step.backward}
        elif accumulates:  # the previous micro-batches' gradients are held through the next forward and backward
            forward = {"activations": step.forward, "gradients": step.gradients}
            backward = {"activations": step.backward, "gradients": step.gradients}
        else:  # set to None after each step: the backward allocates them as the activations are freed
            forward = {"activations": step.forward}
            backward = {"activations and gradients": step.backward_with_gradients}
        if setup.backend != "ddp":
            optimizer = {"gradients": step.gradients, **optimizer}
    else:
        # The sizes DeepSpeed runs with: a deepspeed_config_file's, "auto" as Accelerate fills it, else DeepSpeed's.
        settings = zero_settings(deepspeed_zero_section(setup), s.hidden_size)
        # On CPU a buffer DeepSpeed allocates but only partly writes is resident only where written: the reduce
        # bucket holds at most every trainable gradient.
        bucket = w * min(settings["reduce_bucket_size"], s.trainable if cpu else settings["reduce_bucket_size"])
        partition = shard(s.trainable)
        if stage <= 2:
            lives["fp32 master weights"] = 4 * partition  # a copy even when the weights are fp32
            lives["AdamW state"] = 8 * partition
            lives["weights"] = w * s.total
            # Each backward allocates the reduce bucket the gradients are copied into as they appear (on CPU
            # resident as they are written, like gradients appearing) and fills this rank's partition of them, in the
            # weights' dtype; the optimizer gets the partition flattened to fp32. The bucket is freed at the end of
            # the backward; under accumulation the partition is held through the next forward.
            held = w * partition if accumulates else 0
            forward = {"activations": step.forward, "gradient partition": held}
            if cpu:
                backward = {"activations and reduce bucket": step.backward_with_gradients, "gradient partition": w * partition}
            else:
                backward = {"activations": step.backward, "ZeRO reduce bucket": bucket, "gradient partition": w * partition}
            optimizer = {"gradient partition": w * partition, "fp32 gradient partition": 4 * partition, **optimizer}
        else:
            lives, forward, backward, optimizer = _zero3_phases(cfg, s, step, settings, world, w, cpu, bucket, optimizer)
    if ema:
        # train/ema.py: an fp32 copy of what the optimizer trains (LoRA: the adapters and fully trained modules) on
        # every rank under DDP; under ZeRO each rank averages its own partition of the fp32 master weights, under
        # FSDP2 its own shard of each parameter.
        lives["EMA of the weights (fp32)"] = 4 * ema
    plan = MemoryPlan(label="", lives=lives, phases={"forward": forward, "backward": backward, "optimizer step": optimizer},
                      build=build)
    allocated = plan.allocated
    if cpu:
        plan.device_costs = {f"glibc retention ({CPU_RETENTION:.0%} of allocated)": int(CPU_RETENTION * allocated)}
    else:
        plan.device_costs = {"CUDA context": CUDA_CONTEXT}
        if world > 1:
            plan.device_costs["NCCL buffers"] = NCCL_BUFFERS
        share = CUDA_FRAGMENTATION_ZERO3 if stage == 3 else CUDA_FRAGMENTATION
        plan.device_costs[f"allocator fragmentation ({share:.0%} of allocated)"] = int(share * allocated)
    checkpointing = "on" if cfg.policy.gradient_checkpointing else "off"
    unit = ("CPU process" if cpu else "GPU") + ("es" if cpu and world > 1 else "s" if world > 1 else "")
    plan.label = (f"{setup.label} on {world} {unit}, {batch} per device, gradient "
                  f"checkpointing {checkpointing}{', LoRA' if cfg.policy.lora.enabled else ''}")
    return plan


def _zero3_phases(cfg: TrainConfig, s: Sizes, step: StepBytes, settings: dict[str, int], world: int, w: int, cpu: bool,
                  bucket: int, optimizer: dict):
    """DeepSpeed ZeRO-3 as it runs (runtime/zero/stage3.py, docs/ARCHITECTURE.md "Memory plan"): through the run this
    rank's partition of every parameter in the weights' dtype `w`, the parameters under
    stage3_param_persistence_threshold whole, the fp32 master partition (a copy even of fp32 weights), AdamW's moments,
    the reduce bucket (allocated once) and the gradient partition (in `w`, DeepSpeed's default accumulation dtype). In
    the forward and the backward the parameters gathered (zero3_gathered) and the all-gather buffers of those fetched
    ahead; in the backward also, when the trainable parameters overfill the bucket, the flat copy a full bucket is
    reduce-scattered from (reduce_scatter_coalesced). The optimizer steps one sub-group of the partition at a time: its
    gradients flattened to fp32 and AdamW's temporaries."""

    def shard(n: int) -> int:
        return -(-n // world)

    trace = module_trace(cfg.policy, cfg.dataset.num_cameras)
    persisted = sum(n for n in trace.numels if n <= settings["stage3_param_persistence_threshold"])
    partition = shard(s.trainable)
    lives = {"weights (this rank's partition)": w * shard(s.total), "parameters kept whole": w * persisted,
             "fp32 master weights": 4 * partition, "AdamW state": 8 * partition, "ZeRO reduce bucket": bucket,
             "gradient partition": w * partition}
    forward_gathered, backward_gathered = zero3_gathered(trace, settings)
    in_flight = w * min(settings["stage3_prefetch_bucket_size"], s.total - persisted)
    forward = {"activations": step.forward, "gathered parameters": w * forward_gathered,
               "all-gather buffers in flight": in_flight}
    backward = {"activations": step.backward, "gathered parameters": w * backward_gathered,
                "all-gather buffers in flight": in_flight,
                "reduce-scatter copy of a full bucket": bucket if s.trainable > settings["reduce_bucket_size"] else 0}
    stepped = min(partition, settings["sub_group_size"])
    optimizer = {"fp32 gradient partition": 4 * stepped, **optimizer,
                 "AdamW temporaries": (8 if cpu else 4) * stepped}
    return lives, forward, backward, optimizer


def _fsdp_phases(s: Sizes, step, world: int, w: int, accumulates: bool, cpu: bool, optimizer: dict):
    """FSDP2 (train/fsdp.py): fp32 shards of the weights, AdamW state and gradients; in the step, the root unit
    gathered from its forward to the end of the backward (FSDP2 does not reshard the root after forward) and the layer
    being computed with the next one prefetched, in the compute dtype `w`."""

    def shard(n: int) -> int:
        return -(-n // world)

    lives = {"weights (fp32 shard)": 4 * shard(s.total), "AdamW state": 8 * shard(s.trainable)}
    gathered = w * (s.root + 2 * s.largest_layer)
    grads = 4 * shard(s.trainable)
    held = grads if accumulates else 0  # the sharded gradients of the previous micro-batches
    forward = {"activations": step.forward, "gathered parameters": gathered, "gradient shards": held}
    # The activations are freed as the gradients appear, each layer's kept as its fp32 shard: `k` times the bytes of
    # the unsharded gradient the measured step holds. The peak of activations + k x gradients over the backward is at
    # most the straight line between k = 0 (step.backward) and k = 1 (step.backward_with_gradients): a maximum of
    # functions linear in k is convex in k. Under accumulation the earlier micro-batches' shards hold throughout.
    k = 4 / (w * world)
    grown = min(k, 1) * (step.backward_with_gradients - step.backward) + max(k - 1, 0) * step.gradients
    shards = {"activations": step.backward, "gradient shards": grads} if accumulates else \
        {"activations and gradient shards": step.backward + math.ceil(grown)}
    # A layer's unsharded gradients in the compute dtype, their fp32 copy for the reduction, and the root's, which
    # are reduced last.
    backward = {**shards, "gathered parameters": gathered,
                "unsharded gradients": w * (s.root + s.largest_layer) + 4 * s.largest_layer}
    adamw = 8 * shard(s.largest_trainable) if cpu else 4 * shard(s.trainable)
    optimizer = {"gradient shards": grads, **optimizer, "AdamW temporaries": adamw}
    return lives, forward, backward, optimizer


def _fsdp_build(s: Sizes, world: int, cpu: bool) -> dict[str, int]:
    """What building the model holds under FSDP2 (train/fsdp.py), before the optimizer exists: every rank builds the
    whole policy in fp32 in host memory, then fully_shard makes one unit at a time, each unit's shard copied out of
    its whole tensors before they are freed. On CPU that host memory is the device's: the whole model plus the
    largest unit's shard. On CUDA each unit comes to the GPU whole to be sharded there: the shards made so far plus
    the largest unit, whole and its shard (below what a step adds to the same shards)."""

    def shard(n: int) -> int:
        return -(-n // world)

    unit = max(s.largest_layer, s.root)
    if cpu:
        return {"the whole model as built (fp32)": 4 * s.total, "a unit's shard being made": 4 * shard(unit)}
    return {"weights (fp32 shard)": 4 * shard(s.total), "a unit moved whole to be sharded": 4 * (unit + shard(unit))}


def alternatives(cfg: TrainConfig, setup: AccelerateSetup, card: int) -> list[str]:
    """Settings that would fit `card`, each one change away from `cfg`: gradient checkpointing, the largest smaller
    per-device batch that fits (the same batch_size through accumulation), ZeRO-2, LoRA."""
    def fits(change: dict, other_setup: AccelerateSetup | None = None) -> bool:
        changed = TrainConfig.model_validate(deep_merge(cfg.model_dump(), change))
        return plan_memory(changed, other_setup or setup).fits(card)

    found = []
    zero3 = setup.backend == "deepspeed" and setup.zero_stage == 3
    if not cfg.policy.gradient_checkpointing and not zero3 and fits({"policy": {"gradient_checkpointing": True}}):
        found.append("--policy.gradient_checkpointing=true")
    batch = cfg.per_device_batch_size or cfg.batch_size
    for smaller in range(batch - 1, 0, -1):
        if batch % smaller == 0:
            accum = cfg.gradient_accumulation_steps * batch // smaller
            if fits({"per_device_batch_size": smaller, "gradient_accumulation_steps": accum}):
                found.append(f"--per_device_batch_size={smaller} --gradient_accumulation_steps={accum} (the same batch_size)")
                break
    if setup.world_size > 1 and not (setup.backend == "deepspeed" and (setup.zero_stage or 0) >= 2):
        zero2 = AccelerateSetup(backend="deepspeed", zero_stage=2, num_processes=setup.world_size, mixed_precision="bf16")
        if fits({}, zero2):
            found.append("DeepSpeed ZeRO-2 (configs/examples/accelerate_deepspeed_config.yaml)")
    if not cfg.policy.lora.enabled and fits({"policy": {"lora": {"rank": 16}}}):
        found.append("--policy.lora.rank=16")
    return found


def check_fits(cfg: TrainConfig, setup: AccelerateSetup, card: int) -> None:
    """Refuse (UserError, exit 2) a run whose plan exceeds `card` bytes per GPU, naming settings that would fit."""
    plan = plan_memory(cfg, setup)
    if plan.fits(card):
        return
    fixes = alternatives(cfg, setup, card)
    hint = ("; these would fit: " + "; ".join(fixes)) if fixes else "; no single change of per-device batch, gradient " \
        "checkpointing, ZeRO stage or LoRA fits it: use larger cards"
    raise UserError(f"The run needs about {gib(plan.total)} per GPU ({plan.label}) but the card has {gib(card)}{hint} "
                    "(--distributed.memory_check=false launches anyway).")


# The card a launch is checked against: `config validate --gpu-memory`, else the visible CUDA card, else unknown.
_CARD: dict[str, int | None] = {}


def set_card_memory(nbytes: int | None) -> None:
    _CARD["bytes"] = nbytes


def card_memory(machine=None) -> int | None:
    """The card size set by --gpu-memory, else that of this machine's first CUDA GPU (not of a --gpus target):
    torch's total_memory, the bytes nvidia-smi shows in MiB."""
    if _CARD.get("bytes"):
        return _CARD["bytes"]
    from opentau_cli.config.rules import cuda_is_available

    if (machine is None or not machine.target) and cuda_is_available():
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    return None


def check_memory(cfg: TrainConfig, setup: AccelerateSetup, machine) -> None:
    """The launch rule (plan/run_plan.py): refuse a run whose plan exceeds the card, when the card is known."""
    card = card_memory(machine)
    if card and cfg.distributed.memory_check:
        check_fits(cfg, setup, card)


def parse_size(text: str) -> int:
    """A card size for --gpu-memory (units.parse_card_size: 80GB and 80GiB are both the card sold as 80 GB)."""
    from opentau_cli.units import parse_card_size

    return parse_card_size(text, "--gpu-memory")
