"""What the memory plan measures of the policy, with torch (docs/ARCHITECTURE.md, "Memory plan"): its sizes from a
build on the meta device, one training step's bytes and ZeRO-3's order of modules from a forward (and backward) on
fake tensors (no memory, no arithmetic). plan/memory.py keeps the results on disk and computes the plan from them,
without importing torch once they are kept: a launch of a policy measured before plans in a command that never
imports torch on a machine without GPUs (docs/ARCHITECTURE.md, "Start-up").
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from opentau_cli.config.model import PolicyConfig

class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created inside the mode and still alive, and their peaks: every op's outputs are
    counted once per storage and released when the storage is freed. Storage that becomes a parameter's gradient
    (`mark_gradients`) is counted apart, so that `peak_other` is the peak of everything else. Works on real and on
    fake tensors."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self.gradients = 0  # bytes of live gradients
        self.peak_other = 0  # the peak of current - gradients
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> [nbytes, is a gradient]

    def _free(self, entry: list) -> None:
        self.current -= entry[0]
        if entry[1]:
            self.gradients -= entry[0]

    def _track(self, storage) -> list:
        if storage not in self._seen:
            entry = [storage.nbytes(), False]
            self._seen[storage] = entry
            weakref.finalize(storage, self._free, entry)
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
            self.peak_other = max(self.peak_other, self.current - self.gradients)
        return self._seen[storage]

    def mark_gradients(self, parameters) -> None:
        """Count each parameter's gradient, once the backward has accumulated it, as a gradient."""
        def accumulated(p: torch.Tensor) -> None:
            entry = self._track(p.grad.untyped_storage())
            if not entry[1]:
                entry[1] = True
                self.gradients += entry[0]

        for p in parameters:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(accumulated)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: nothing new (storage objects are preserved per storage).
        # Only an op whose schema says a result aliases an input can return one; the others' inputs are not looked at
        # (a fifth of a step's measuring went to collecting them).
        inputs = ({id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and not t.is_meta}
                  if _aliases_an_input(func) else ())
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta and id(leaf.untyped_storage()) not in inputs:
                self._track(leaf.untyped_storage())
        return out


@functools.cache
def _aliases_an_input(func) -> bool:
    """Whether `func` (an aten op) may return one of its inputs' storage: a view, an in-place or an out= op."""
    return any(ret.alias_info is not None for ret in func._schema.returns)


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


def policy_module(policy_cfg: PolicyConfig, weights_dtype: str, meta: bool = False):
    """The real policy module with its weights in `weights_dtype` ("float32", "bfloat16"); `meta`: built on the meta
    device (no memory, no initialization)."""
    from opentau_cli.policies import build_policy

    with torch.device("meta") if meta else contextlib.nullcontext():
        policy = build_policy(policy_cfg)
        if policy_cfg.lora.enabled:
            from opentau_cli.policies.lora import apply_lora

            apply_lora(policy, policy_cfg.lora)
    if policy_cfg.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    if weights_dtype != "float32":
        for p in policy.parameters():  # as DeepSpeed's bf16 engine holds them: every parameter, buffers kept
            p.data = p.data.to(getattr(torch, weights_dtype))  # a name of memory.DTYPE_BYTES
    return policy.train()


def _forward(policy, inputs: dict, autocast: bool) -> torch.Tensor:
    device = inputs["actions"].device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        # Given noise and time: the Beta draw validates its arguments by value, which fake tensors do not have.
        actions = inputs["actions"]
        return policy.loss(inputs, noise=torch.zeros_like(actions), time=torch.full((len(actions),), 0.5))["loss"]


def measure_step(policy, inputs: dict, autocast: bool) -> dict[str, int]:
    """Run one forward + backward of `policy` under a LiveBytes tracker (real or fake tensors): memory.StepBytes's
    fields."""
    tracker = LiveBytes()
    tracker.mark_gradients(policy.parameters())
    with tracker:
        loss = _forward(policy, inputs, autocast)
        forward = tracker.peak_other
        loss.backward()
        del loss
    return {"forward": forward, "backward": tracker.peak_other, "backward_with_gradients": tracker.peak,
            "gradients": tracker.gradients}


def record_trace(policy, inputs: dict, autocast: bool) -> dict[str, list]:
    """Run the policy's loss once (real or fake tensors) and record its memory.ModuleTrace's fields."""
    params = list(policy.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    modules = [m for m in policy.modules() if any(True for _ in m.parameters(recurse=False))]
    forward: list[int] = []
    grad_out = [False] * len(modules)
    handles = []
    for i, module in enumerate(modules):
        def pre(_module, _args, i=i):
            forward.append(i + 1)

        def post(_module, _args, out, i=i):
            forward.append(-(i + 1))
            grad_out[i] = grad_out[i] or any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(out))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        _forward(policy, inputs, autocast)
    finally:
        for handle in handles:
            handle.remove()
    return {"numels": [p.numel() for p in params], "forward": forward, "grad_out": grad_out,
            "module_params": [[index[id(p)] for p in m.parameters(recurse=False)] for m in modules]}


def _on_fake_tensors(policy_cfg: PolicyConfig, weights_dtype: str, measure):
    """`measure(policy)` of the full-size policy built on the meta device and made of fake tensors; torch's random
    state as it was (building draws random initial values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch_state = torch.random.get_rng_state()
    try:
        policy = policy_module(policy_cfg, weights_dtype, meta=True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            policy.to_empty(device="cpu")
            return measure(policy)
    finally:
        torch.random.set_rng_state(torch_state)


def step_bytes(policy_cfg: PolicyConfig, batch: int, cameras: int, weights_dtype: str, autocast: bool) -> dict[str, int]:
    """One forward + backward of the full-size policy at `batch`, on fake tensors: memory.StepBytes's fields."""
    return _on_fake_tensors(policy_cfg, weights_dtype,
                            lambda policy: measure_step(policy, fake_inputs(policy_cfg, batch, cameras), autocast))


def module_trace(policy_cfg: PolicyConfig, cameras: int) -> dict[str, list]:
    """The full-size policy's forward at batch 1, on fake tensors: memory.ModuleTrace's fields."""
    return _on_fake_tensors(policy_cfg, "float32",
                            lambda policy: record_trace(policy, fake_inputs(policy_cfg, 1, cameras), autocast=False))


def sizes(policy_cfg: PolicyConfig) -> dict[str, int]:
    """The policy's parameter counts from a build on the meta device: memory.Sizes's fields."""
    policy = policy_module(policy_cfg.model_copy(update={"gradient_checkpointing": False}), "float32", meta=True)
    from opentau_cli.policies.pi05.configuration import hidden_size
    from opentau_cli.train.fsdp import layer_groups

    params = list(policy.parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for _, group in layer_groups(policy) for layer in group]
    total = sum(p.numel() for p in params)
    return {"total": total, "trainable": sum(p.numel() for p in params if p.requires_grad),
            "largest_trainable": max((p.numel() for p in params if p.requires_grad), default=0),
            "largest_layer": max(layers, default=0), "root": total - sum(layers), "hidden_size": hidden_size(policy_cfg)}
