"""Build a policy from its config: on the current device or init context, on the meta device without storage
(random draws kept), or inside DeepSpeed's zero.Init with the same initial weights."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from opentau_cli.config.model import PolicyConfig

# Imported here, not inside build_policy: transformers imports lazily, and an import that happens inside DeepSpeed's
# zero.Init (which patches tensor construction) fails in torch._dynamo.
from opentau_cli.policies.pi05 import Pi05Policy


def build_policy(policy_cfg: PolicyConfig, stats: dict | None = None, *, empty: bool = False,
                 rng_draws: bool = True) -> torch.nn.Module:
    """Build the policy on the current default device / init context (meta, zero.Init); fp32 weights.

    Sets requires_grad per the config and turns on activation checkpointing when asked. A `tokenizer_path` that is
    a Hugging Face repo id is resolved to its local snapshot first. Does not load `pretrained_path` (call
    `load_pretrained` once the weights are materialized, or `build_pretrained`) and does not compile.

    `empty`: every parameter on the meta device (no storage, no initial values), every buffer real and computed as
    in an ordinary build; the random initialization draws on scratch memory, so the global RNG ends where an
    ordinary build leaves it (docs/ARCHITECTURE.md, "Starting from pretrained weights"). `rng_draws=False` skips
    those draws (about a minute of CPU for the full pi05) where nothing reads the RNG before it is seeded again.
    """
    policy_cfg = _with_local_tokenizer(policy_cfg)
    if empty:
        with _parameters_without_storage(rng_draws):
            policy = Pi05Policy(policy_cfg)
    else:
        policy = _build_under_zero3(policy_cfg) if _zero3_init_active() else Pi05Policy(policy_cfg)
    if stats is not None:
        policy.set_stats(stats)
    if policy_cfg.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    return policy


def _with_local_tokenizer(policy_cfg: PolicyConfig) -> PolicyConfig:
    path = policy_cfg.tokenizer_path
    if path is None or Path(path).exists():
        return policy_cfg
    from opentau_cli.policies import hub

    return policy_cfg.model_copy(update={"tokenizer_path": hub.resolve(str(path), "policy.tokenizer_path")})


class _DrawsOnScratch(TorchDispatchMode):
    """Runs every random op aimed at a meta tensor once more on scratch memory of the same shape, strides and dtype:
    the values are thrown away, the global RNG advances exactly as it does for a real tensor (how many numbers an
    op draws depends on its size, strides and dtype only). One scratch buffer, as large as the largest parameter."""

    def __init__(self):
        super().__init__()
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def stand_in(self, t):
        if not (isinstance(t, torch.Tensor) and t.is_meta):
            return t
        span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
        nbytes = span * t.element_size()
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(t.dtype).as_strided(t.shape, t.stride())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and any(
                isinstance(a, torch.Tensor) and a.is_meta for a in tree_leaves((args, kwargs))):
            func(*tree_map(self.stand_in, args), **tree_map(self.stand_in, kwargs))
        return func(*args, **kwargs)


# torch.nn.init returns early on a meta tensor in these (trunc_normal_ samples by rejection, so how much it draws
# depends on the values): run them whole on a stand-in instead.
_SKIP_META = ("trunc_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def _parameters_without_storage(rng_draws: bool):
    """Parameters created on the meta device (buffers stay real); random initialization drawn on scratch, or not
    at all without `rng_draws`."""
    import transformers.initialization as hf_init
    from accelerate import init_on_device

    if not rng_draws:
        with init_on_device(torch.device("meta"), include_buffers=False):
            yield
        return
    draws = _DrawsOnScratch()

    def on_stand_in(init):
        def run(tensor, *args, **kwargs):
            if tensor.is_meta:
                init(draws.stand_in(tensor), *args, **kwargs)
                return tensor
            return init(tensor, *args, **kwargs)
        return run

    # Where torch and transformers look these functions up (transformers patches the same places).
    homes = [sys.modules[m] for m in hf_init.TORCH_MODULES_TO_PATCH if m in sys.modules]
    saved = []
    for name in _SKIP_META:
        original = getattr(torch.nn.init, name)
        saved += [(home, name, original) for home in homes if getattr(home, name, None) is original]
        saved.append((hf_init.TORCH_INIT_FUNCTIONS, name, hf_init.TORCH_INIT_FUNCTIONS[name]))
    try:
        for home, name, original in saved:
            if isinstance(home, dict):
                home[name] = on_stand_in(original)
            else:
                setattr(home, name, on_stand_in(original))
        with init_on_device(torch.device("meta"), include_buffers=False), draws:
            yield
    finally:
        for home, name, original in saved:
            if isinstance(home, dict):
                home[name] = original
            else:
                setattr(home, name, original)


def _zero3_init_active() -> bool:
    partition = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return partition is not None and partition.zero_init_context > 0


def _build_under_zero3(policy_cfg: PolicyConfig) -> torch.nn.Module:
    """Build inside the caller's deepspeed.zero.Init with the same initial weights as an ordinary build.

    Sub-modules are partitioned as soon as their own __init__ returns, so transformers' post_init would initialize
    empty shards: run it on gathered parameters, in the same order (and so with the same random draws) as without
    ZeRO-3. zero.Init also casts floating tensors created inside it (RoPE frequencies, statistics buffers): recompute
    those in fp32.
    """
    import deepspeed
    import transformers.modeling_utils as hf_modeling
    from deepspeed.runtime.zero import partition_parameters
    from transformers.modeling_utils import PreTrainedModel

    original_init, original_flag = PreTrainedModel.init_weights, hf_modeling.is_deepspeed_zero3_enabled

    def init_weights(self):
        with deepspeed.zero.GatheredParameters(list(self.parameters()), modifier_rank=0):
            original_init(self)

    PreTrainedModel.init_weights = init_weights
    # Seeing ZeRO-3 on, transformers would open its own zero.Init with weight init off (it expects a checkpoint load).
    hf_modeling.is_deepspeed_zero3_enabled = lambda: False
    try:
        policy = Pi05Policy(policy_cfg)
    finally:
        PreTrainedModel.init_weights, hf_modeling.is_deepspeed_zero3_enabled = original_init, original_flag
    partition_parameters.shutdown_init_context()
    try:
        policy.reset_fp32_buffers()
    finally:
        partition_parameters.restore_init_context()
    return policy
