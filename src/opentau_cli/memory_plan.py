"""The memory plan: the peak memory per GPU of a configured run, computed before launch without a GPU.

Two parts (docs/ARCHITECTURE.md, "Memory plan"):
- what lives through the whole run, from the real model's parameter counts (built on the meta device) and the
  backend's layout: weights, fp32 master weights, AdamW's two moments, gradients, communication buckets, each
  divided among the ranks as the ZeRO stage divides it;
- what one training step allocates on top (activations saved for backward, temporaries, the gradients as they are
  produced), measured by running the real policy's loss and backward on fake tensors (no memory, no compute) at the
  configured per-device batch and shapes, under the precision the backend runs with, with a tracker of live storage.

`measure_step_peak` is the same tracker on real tensors: the test compares the plan with it on pi05_small.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from opentau_cli.config import AccelerateSetup, TrainConfig
from opentau_cli.config.load import _deep_merge
from opentau_cli.config.model import PolicyConfig
from opentau_cli.errors import UserError

GB = 10**9
# DeepSpeed's defaults (elements): the bucket reduced at once (ZeRO-1/2) and the parameters ZeRO-3 keeps gathered.
DS_REDUCE_BUCKET = 5 * 10**8
DS_ALLGATHER_BUCKET = 5 * 10**8
DS_MAX_LIVE_PARAMETERS = 10**9
# torch's AdamW on CUDA (foreach) allocates one fp32 copy of the parameters it updates during its step: the square
# root of the second moment, for every parameter at once (on CPU it updates one parameter at a time).
ADAMW_TEMPORARY_COPIES = 1
# Part of the cache key of step measurements: raised whenever what is measured changes.
MEASURE_VERSION = 2
# The CUDA context, cuBLAS workspaces and the caching allocator's fragmentation: not in any tensor.
CUDA_OVERHEAD = 2 * GB


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created inside the mode and still alive, and their peak: every op's outputs are counted
    once per storage and released when the storage is freed. Works on real and on fake tensors."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = nbytes
        weakref.finalize(storage, self._free, nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: nothing new (storage objects are preserved per storage).
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and not t.is_meta}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta and id(leaf.untyped_storage()) not in inputs:
                self._track(leaf)
        return out


def fake_inputs(policy_cfg: PolicyConfig, batch: int, cameras: int) -> dict:
    """Prepared inputs of the configured shapes (the prompt at its full padded length, every action real)."""
    h, w = policy_cfg.image_resolution
    chunk, width, tokens = policy_cfg.chunk_size, policy_cfg.max_action_dim, policy_cfg.tokenizer_max_length
    return {
        "images": torch.zeros(batch, cameras, 3, h, w),
        "image_masks": torch.ones(batch, cameras, dtype=torch.bool),
        "state": torch.zeros(batch, policy_cfg.max_state_dim),
        "input_ids": torch.zeros(batch, tokens, dtype=torch.long),
        "text_valid": torch.ones(batch, tokens, dtype=torch.bool),
        "batch_size": batch,
        "actions": torch.zeros(batch, chunk, width),
        "action_valid": torch.ones(batch, chunk, dtype=torch.bool),
        "action_dim": width,
        "action_dim_valid": torch.ones(batch, width, dtype=torch.bool),
    }


def step_precision(setup: AccelerateSetup) -> tuple[torch.dtype, bool]:
    """(dtype the weights are held in, whether bf16 autocast runs): DeepSpeed bf16 holds bf16 weights, Accelerate's
    bf16 elsewhere is autocast over fp32 weights."""
    bf16 = setup.mixed_precision == "bf16"
    if setup.backend == "deepspeed" and bf16:
        return torch.bfloat16, False
    return torch.float32, bf16


def policy_module(policy_cfg: PolicyConfig, weights_dtype: torch.dtype, meta: bool = False):
    """The real policy module; `meta`: built on the meta device (no memory, no initialization)."""
    from opentau_cli.policies import build_policy

    with torch.device("meta") if meta else contextlib.nullcontext():
        policy = build_policy(policy_cfg)
        if policy_cfg.lora.enabled:
            from opentau_cli.policies.lora import apply_lora

            apply_lora(policy, policy_cfg.lora)
    if policy_cfg.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    if weights_dtype != torch.float32:
        for p in policy.parameters():  # as DeepSpeed's bf16 engine holds them: every parameter, buffers kept
            p.data = p.data.to(weights_dtype)
    return policy.train()


def _run_step(policy, inputs: dict, autocast: bool) -> None:
    device = inputs["actions"].device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        # Given noise and time: the Beta draw validates its arguments by value, which fake tensors do not have.
        actions = inputs["actions"]
        loss = policy.loss(inputs, noise=torch.zeros_like(actions), time=torch.full((len(actions),), 0.5))["loss"]
    loss.backward()


def step_bytes(policy_cfg: PolicyConfig, batch: int, cameras: int, weights_dtype: torch.dtype, autocast: bool) -> int:
    """Peak bytes one forward + backward allocates on top of the weights (gradients included), measured on fake
    tensors of the full-size model: shapes only, no memory and no arithmetic. Cached per shape and precision."""
    key = json.dumps([MEASURE_VERSION, policy_cfg.model_dump(mode="json"), batch, cameras, str(weights_dtype), autocast,
                      torch.__version__],
                     sort_keys=True)
    cache = _cache_dir() / f"step_{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if cache.is_file():
        return int(json.loads(cache.read_text())["bytes"])
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch_state = torch.random.get_rng_state()
    try:
        policy = policy_module(policy_cfg, weights_dtype, meta=True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            policy.to_empty(device="cpu")
            inputs = fake_inputs(policy_cfg, batch, cameras)
            tracker = LiveBytes()
            with tracker:
                _run_step(policy, inputs, autocast)
    finally:
        torch.random.set_rng_state(torch_state)  # building draws random initial values
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"bytes": tracker.peak}))
    return tracker.peak


def _cache_dir() -> Path:
    root = os.environ.get("OPENTAU_CACHE_DIR") or Path.home() / ".cache" / "opentau"
    return Path(root) / "memory_plan"


@dataclass
class MemoryPlan:
    """Peak bytes per GPU, by part, of one configured run."""

    label: str  # backend, world size, per-device batch, checkpointing
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def fits(self, card: int) -> bool:
        return self.total <= card

    def describe(self, card: int | None = None) -> str:
        parts = ", ".join(f"{name} {gb(n)}" for name, n in self.parts.items() if n)
        line = f"{gb(self.total)} peak per GPU ({self.label}: {parts})"
        if card:
            verdict = "fits" if self.fits(card) else "does NOT fit"
            line += f"; {verdict} a {gb(card)} card (margin {gb(card - self.total)})"
        return line


def gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


def plan_memory(cfg: TrainConfig, setup: AccelerateSetup) -> MemoryPlan:
    """The memory plan of `cfg` launched with `setup` (docs/ARCHITECTURE.md, "Memory plan")."""
    from opentau_cli.policies import count_parameters

    counts = count_parameters(cfg.policy)
    total, trainable = counts["total"], counts["trainable"]
    world = max(1, setup.world_size)
    weights_dtype, autocast = step_precision(setup)
    wbytes = torch.finfo(weights_dtype).bits // 8
    batch = cfg.per_device_batch_size or cfg.batch_size
    step = step_bytes(cfg.policy, batch, cfg.dataset.num_cameras, weights_dtype, autocast)
    grads = wbytes * trainable  # what the step measure holds at its end: one gradient per trainable parameter
    parts: dict[str, int] = {}
    stage = setup.zero_stage if setup.backend == "deepspeed" else None
    if stage is None:
        parts["weights"] = wbytes * total
        parts["gradients"] = grads
        parts["AdamW state"] = 8 * trainable
        # Under DDP the gradients are views into its all-reduce buckets (train/trainer.py, gradient_as_bucket_view):
        # no second copy.
    else:
        shard = lambda n: -(-n // world)  # noqa: E731
        parts["weights"] = wbytes * (shard(total) if stage == 3 else total)
        parts["gradients"] = shard(grads) if stage >= 2 else grads
        parts["AdamW state"] = shard(8 * trainable)
        if weights_dtype != torch.float32:
            parts["fp32 master weights"] = shard(4 * trainable)
        parts["ZeRO buckets"] = wbytes * (DS_REDUCE_BUCKET + DS_ALLGATHER_BUCKET
                                          + (DS_MAX_LIVE_PARAMETERS if stage == 3 else 0))
    if cfg.ema.enabled:
        # train/ema.py: an fp32 copy of what the optimizer trains (LoRA: the adapters and fully trained modules) on
        # every rank under DDP; under ZeRO each rank averages its own partition of the fp32 master weights.
        parts["EMA of the weights (fp32)"] = 4 * trainable if stage is None else -(-4 * trainable // world)
    # The step's two peaks never overlap: activations (forward / backward, freed before the optimizer runs) and the
    # optimizer step's temporaries (torch's foreach AdamW: about 3 fp32 copies of the parameters it updates).
    updated = trainable if stage is None else -(-trainable // world)
    temporaries = ADAMW_TEMPORARY_COPIES * 4 * updated
    activations = max(0, step - grads)
    if activations >= temporaries:
        parts["activations"] = activations
    else:
        parts["AdamW step temporaries (above activations)"] = temporaries
    parts["CUDA overhead"] = CUDA_OVERHEAD
    checkpointing = "on" if cfg.policy.gradient_checkpointing else "off"
    label = (f"{setup.label} on {world} GPU{'s' if world > 1 else ''}, {batch} per device, gradient checkpointing "
             f"{checkpointing}{', LoRA' if cfg.policy.lora.enabled else ''}")
    return MemoryPlan(label=label, parts=parts)


def alternatives(cfg: TrainConfig, setup: AccelerateSetup, card: int) -> list[str]:
    """Settings that would fit `card`, each one change away from `cfg`: gradient checkpointing, the largest smaller
    per-device batch that fits (the same batch_size through accumulation), ZeRO-2, LoRA."""
    def fits(change: dict, other_setup: AccelerateSetup | None = None) -> bool:
        changed = TrainConfig.model_validate(_deep_merge(cfg.model_dump(), change))
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
    raise UserError(f"The run needs about {gb(plan.total)} per GPU ({plan.label}) but the card has {gb(card)}{hint} "
                    "(--distributed.memory_check=false launches anyway).")


# The card a launch is checked against: `config validate --gpu-memory`, else the visible CUDA card, else unknown.
_CARD: dict[str, int | None] = {}


def set_card_memory(nbytes: int | None) -> None:
    _CARD["bytes"] = nbytes


def card_memory(machine=None) -> int | None:
    """The card size set by --gpu-memory, else that of this machine's first CUDA GPU (not of a --gpus target)."""
    if _CARD.get("bytes"):
        return _CARD["bytes"]
    if (machine is None or not machine.target) and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def check_memory(cfg: TrainConfig, setup: AccelerateSetup, machine) -> None:
    """The launch rule (plan.py): refuse a run whose plan exceeds the card, when the card is known."""
    card = card_memory(machine)
    if card and cfg.distributed.memory_check:
        check_fits(cfg, setup, card)


def parse_size(text: str) -> int:
    """'80GB', '80 GB', '80G', '141GB', '24GiB' -> bytes."""
    cleaned = text.strip().replace(" ", "").upper()
    for suffix, unit in (("GIB", 2**30), ("GB", GB), ("G", GB)):
        if cleaned.endswith(suffix):
            try:
                value = float(cleaned[: -len(suffix)])
            except ValueError:
                break
            if value > 0:
                return int(value * unit)
    raise UserError(f"--gpu-memory takes a size such as 80GB or 24GiB, got {text!r}.")


def measure_step_peak(policy, inputs: dict, optimizer, autocast: bool) -> int:
    """Peak live bytes of a steady-state real training step: one step first (AdamW creates its state), then the
    second (forward, backward, optimizer step, gradients freed) measured with the tracker, plus the bytes that lived
    through it (weights and AdamW state). The reference the plan is checked against."""
    _run_step(policy, inputs, autocast)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tracker = LiveBytes()
    with tracker:
        _run_step(policy, inputs, autocast)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    return weights + state + tracker.peak
