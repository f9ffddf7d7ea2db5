"""Elastic resume: continue a checkpoint under another number of processes or machines, or another backend
(docs/ARCHITECTURE.md, "Resume contract").

A checkpoint is first read into a topology-free form: for every parameter name its full fp32 weight (the fp32
master weight where DeepSpeed keeps one), AdamW's exp_avg / exp_avg_sq and step count, plus buffers, frozen
parameters and the scheduler. DeepSpeed ZeRO-1/2/3 shards are read with the safe shard reader and cut by the
ZeRO reader's plan (store/zero.py); a single / DDP checkpoint's optimizer.bin and scheduler.bin with
`weights_only` loads after the pickle scan. That state is then put into the freshly prepared launch: plain torch
parameters and optimizer state for single / DDP, DeepSpeed's own `safe_set_full_fp32_param` /
`safe_set_full_optimizer_state` for ZeRO, and read back with `safe_get_*` to check it arrived exactly.

The data position is topology-free already (data/sampler.py); the global batch is kept by store/topology.py's
`fit_global_batch`.
On the same number of processes (a backend change alone) every rank continues its own random streams from the
checkpoint, so the run goes on with the uninterrupted run's flow-matching noise and times; on another number the
new ranks' streams are derived from (seed, step, rank): an old rank's state is never given to another rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from opentau_cli.errors import RunError, UserError
from opentau_cli.store.layout import MODEL_WEIGHTS, OPTIMIZER, SCHEDULER, TRAIN_CONFIG, rank_state_file

MOMENTS = ("exp_avg", "exp_avg_sq")


# The topology-free state.

@dataclass
class CanonicalState:
    """Full tensors by parameter / buffer name, each read only when asked (a callable), plus the optimizer's step
    count per trainable parameter and the scheduler's state."""

    weights: dict[str, Callable] = field(default_factory=dict)
    moments: dict[str, dict[str, Callable]] = field(default_factory=dict)  # "exp_avg" -> name -> tensor
    steps: dict[str, float] = field(default_factory=dict)
    scheduler: dict | None = None


def read_canonical(ckpt_dir: Path, trainable: list[str]) -> CanonicalState:
    """The state of checkpoint `ckpt_dir` by name; `trainable`: the trainable parameter names in the optimizer's
    order (single / DDP optimizer state is saved by index). The checkpoint's pickles were scanned by check_resumable."""
    import torch

    from opentau_cli.store.runs import read_training_state

    ckpt_dir = Path(ckpt_dir)
    state = read_training_state(ckpt_dir)
    canon = CanonicalState()
    if state.get("backend") == "deepspeed":
        from opentau_cli.store.zero import read_zero_checkpoint

        zero = read_zero_checkpoint(ckpt_dir, moments=True)
        canon.weights = {e.name: e.produce for e in zero.entries}
        canon.moments = {m: {name: e.produce for name, e in zero.moments.get(m, {}).items()} for m in MOMENTS}
        if zero.optimizer_step is not None:
            canon.steps = {name: float(zero.optimizer_step) for name in canon.moments["exp_avg"]}
    elif state.get("backend") == "fsdp":  # its DCP shards by name (store/dcp.py)
        from opentau_cli.store.dcp import read_canonical as read_dcp

        canon.weights, canon.moments, canon.steps = read_dcp(ckpt_dir, MOMENTS)
    else:
        from safetensors import safe_open

        weights = safe_open(str(ckpt_dir / MODEL_WEIGHTS), framework="pt")
        canon.weights = {name: (lambda name=name: weights.get_tensor(name)) for name in weights.keys()}
        optim = torch.load(ckpt_dir / OPTIMIZER, map_location="cpu", weights_only=True, mmap=True)
        order = [i for group in optim["param_groups"] for i in group["params"]]
        if len(order) != len(trainable):
            raise UserError(f"Checkpoint '{ckpt_dir}' holds optimizer state for {len(order)} parameters and this "
                            f"policy trains {len(trainable)}: it does not fit this config.")
        canon.moments = {m: {} for m in MOMENTS}
        for index, name in zip(order, trainable):
            s = optim["state"].get(index)
            if not s:
                continue  # never stepped
            for m in MOMENTS:
                canon.moments[m][name] = lambda t=s[m]: t
            canon.steps[name] = float(s["step"])
    if (ckpt_dir / SCHEDULER).is_file():
        canon.scheduler = torch.load(ckpt_dir / SCHEDULER, map_location="cpu", weights_only=True)
    return canon


# Putting it into a prepared launch.

def zero_optimizer(accelerator):
    """DeepSpeed's ZeRO optimizer of a prepared launch (None for single / DDP) and its stage."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        return None, None
    engine = wrapped.engine
    return engine.optimizer, engine.zero_optimization_stage()


def flat_partitions(zero_opt, stage: int) -> list:
    """This rank's flat fp32 master partitions, one per parameter group: what the wrapped AdamW steps."""
    return zero_opt.fp32_partitioned_groups_flat if stage == 3 else zero_opt.single_partition_of_fp32_groups


def _trainable(module) -> list:
    """(name, parameter) of every trainable parameter, in the optimizer's order (a tied one once, by its first name)."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def saved_name(canon: CanonicalState, module_params: dict, p, name: str) -> str | None:
    """The name a parameter's full tensor is saved under: its own or that of a parameter tied to it (None: absent)."""
    if name in canon.weights:
        return name
    return next((other for other, q in module_params.items() if q is p and other in canon.weights), None)


def _weight(canon: CanonicalState, module_params: dict, p, name: str):
    """A parameter's saved full tensor under its own name or the name of a parameter tied to it."""
    saved = saved_name(canon, module_params, p, name)
    if saved is None:
        raise UserError(f"the checkpoint holds no tensor for parameter '{name}': it does not fit this config.")
    return canon.weights[saved]()


def _never_stepped(canon: CanonicalState, module_params: dict, trainable: list) -> set[str]:
    """Trainable parameters the checkpoint holds weights but no AdamW state for: they never received a gradient
    (AdamW creates a parameter's state at its first gradient). A parameter without weights does not fit."""
    stateless = {n for n, _ in trainable if n not in canon.moments.get("exp_avg", {})}
    absent = [n for n, p in trainable if n in stateless and saved_name(canon, module_params, p, n) is None]
    if absent:
        raise UserError(f"the checkpoint holds neither weights nor optimizer state for '{absent[0]}' ({len(absent)} "
                        "parameters): it does not fit this config.")
    return stateless


def apply_canonical(canon: CanonicalState, accelerator, model, optimizer, scheduler, *, frozen_from_base: bool = False) -> None:
    """Put `canon` into a freshly prepared model / optimizer / scheduler (every rank calls it; a collective under
    ZeRO). Trainable weights, AdamW's moments and steps, frozen parameters, buffers and the scheduler.

    A trainable parameter that never received a gradient has no AdamW state in the checkpoint: it gets none under
    single / DDP (as in the run that saved it) and zero moments under ZeRO (which steps every parameter of a group;
    zero moments are what a parameter without gradients keeps there). `frozen_from_base`: a LoRA checkpoint holds no
    frozen parameters; the launch built them from the base the resume checked, and they stay as built."""
    import torch

    from opentau_cli.store.dcp import apply_full, is_sharded

    module = accelerator.unwrap_model(model)
    zero_opt, stage = zero_optimizer(accelerator)
    params = dict(module.named_parameters(remove_duplicate=False))  # every name, tied ones too
    trainable = _trainable(module)
    stateless = _never_stepped(canon, params, trainable)
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name in canon.weights:
                buf.copy_(canon.weights[name]())
        if is_sharded(module):  # FSDP2: each rank's shard of the full tensors (store/dcp.py)
            apply_full(module, optimizer, lambda name, p: _weight(canon, params, p, name), canon.moments, canon.steps,
                       stateless, lambda name, p: not p.requires_grad and frozen_from_base
                       and saved_name(canon, params, p, name) is None)
        elif zero_opt is None:
            base = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
            for name, p in module.named_parameters():
                if p.requires_grad or not frozen_from_base or saved_name(canon, params, p, name) is not None:
                    p.copy_(_weight(canon, params, p, name))
            for name, p in trainable:
                if name in stateless:
                    base.state.pop(p, None)
                    continue
                base.state[p] = {"step": torch.tensor(canon.steps[name], dtype=torch.float32),
                                 **{m: canon.moments[m][name]().to(p.device, torch.float32).clone() for m in MOMENTS}}
        else:
            _apply_zero(canon, accelerator, module, params, zero_opt, stage, trainable, stateless, frozen_from_base)
    if canon.scheduler is not None:
        inner = scheduler.scheduler if hasattr(scheduler, "scheduler") else scheduler
        inner.load_state_dict(canon.scheduler)
        for group, lr in zip(inner.optimizer.param_groups, inner.get_last_lr()):
            group["lr"] = lr  # load_state would restore it with the optimizer's param_groups


def _apply_zero(canon, accelerator, module, params, zero_opt, stage, trainable, stateless, frozen_from_base) -> None:
    import deepspeed
    import torch
    from deepspeed.utils import (
        safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_optimizer_state,
    )

    flats = flat_partitions(zero_opt, stage)
    step = next(iter(canon.steps.values()))
    if any(s != step for s in canon.steps.values()):
        raise RunError("the checkpoint's parameters are at different optimizer steps; ZeRO keeps one per group.")
    base = zero_opt.optimizer
    for flat in flats:  # AdamW creates its state at the first step; give every flat partition one to fill
        base.state[flat] = {"step": torch.tensor(step, dtype=torch.float32),
                            **{m: torch.zeros_like(flat) for m in MOMENTS}}
    if stage < 3:
        zero_opt._hp_optimizer_states_linked = False  # link each parameter's fragments to that state (as step does)
        zero_opt._lazy_init_hp_params_optimizer_state()
    device = accelerator.device
    for name, p in trainable:
        weight = _weight(canon, params, p, name)
        moments = {m: torch.zeros_like(weight) if name in stateless else canon.moments[m][name]() for m in MOMENTS}
        for key, value in {None: weight, **moments}.items():
            value = value.to(device, torch.float32)
            if stage == 3:
                # This rank's slice: DeepSpeed's full setter cuts the last rank's slice past the end of a tensor
                # whose size does not divide by the world size (its partitions are zero-padded).
                local = zero3_slice(value, p.ds_tensor.numel(), accelerator.process_index)
                if key is None:
                    safe_set_local_fp32_param(p, local)
                else:
                    safe_set_local_optimizer_state(p, local, key)
            elif key is None:
                safe_set_full_fp32_param(p, value)
            else:
                safe_set_full_optimizer_state(p, value, key)
    def kept_as_built(name, p) -> bool:
        return frozen_from_base and not p.requires_grad and saved_name(canon, params, p, name) is None

    if stage < 3:
        zero_opt.update_lp_params()  # the model's own (bit16) weights from the fp32 partitions, gathered
        for name, p in module.named_parameters():
            if not p.requires_grad and not kept_as_built(name, p):
                p.copy_(_weight(canon, params, p, name))
    else:
        rank0 = accelerator.is_main_process
        for name, p in module.named_parameters():  # partitioned: set the full tensor through a gather, one at a time
            if kept_as_built(name, p):
                continue
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if rank0:
                    p.copy_(_weight(canon, params, p, name))


def zero3_slice(value, part: int, rank: int):
    """Rank `rank`'s `part` values of a full tensor under ZeRO-3's partitioning (zero-padded at the end)."""
    import torch

    flat = value.flatten()
    out = torch.zeros(part, dtype=flat.dtype, device=flat.device)
    piece = flat[rank * part : (rank + 1) * part]
    out[: piece.numel()] = piece
    return out


def live_parameters(accelerator, model, optimizer):
    """Yield (name, {"weight", "exp_avg", "exp_avg_sq": full fp32 tensor or None, "step": float or None}) for every
    trainable parameter as the launch holds it now, one parameter at a time (a collective under ZeRO and FSDP2:
    every rank iterates)."""
    from opentau_cli.store.dcp import is_sharded, live_full

    module = accelerator.unwrap_model(model)
    zero_opt, stage = zero_optimizer(accelerator)
    if is_sharded(module):
        yield from live_full(module, optimizer, MOMENTS)
        return
    if zero_opt is None:
        base = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    else:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        step = zero_opt.optimizer.state.get(flat_partitions(zero_opt, stage)[0], {}).get("step")
    for name, p in _trainable(module):
        if zero_opt is None:
            s = base.state.get(p, {})
            values = {"weight": p.detach(), **{m: s.get(m) for m in MOMENTS}, "step": s.get("step")}
        else:
            values = {"weight": safe_get_full_fp32_param(p), **{m: safe_get_full_optimizer_state(p, m) for m in MOMENTS},
                      "step": step}
        yield name, {k: (None if v is None else float(v) if k == "step" else v.detach().float().cpu())
                             for k, v in values.items()}


def check_applied(canon: CanonicalState, accelerator, model, optimizer) -> None:
    """Every trainable tensor and step the launch now holds equals the checkpoint's, bit for bit (else RunError). A
    parameter that never received a gradient (no AdamW state saved) holds no state, or zero moments under ZeRO."""
    import torch

    module = accelerator.unwrap_model(model)
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, have in live_parameters(accelerator, model, optimizer):
        saved = saved_name(canon, params, params[name], name)
        stateless = name not in canon.moments["exp_avg"]
        want = {"weight": canon.weights.get(saved) if saved else None, **{m: canon.moments[m].get(name) for m in MOMENTS}}
        for what, produce in want.items():
            if stateless and what in MOMENTS:
                if have[what] is not None and bool(have[what].any()):
                    raise RunError(f"Elastic resume: '{name}' never received a gradient but holds AdamW state in the new launch.")
                continue
            if have[what] is None or produce is None or not torch.equal(have[what], produce().float().view_as(have[what])):
                raise RunError(f"Elastic resume: the {what} of '{name}' did not arrive exactly in the new launch.")
        if not stateless and have["step"] != canon.steps.get(name):
            raise RunError(f"Elastic resume: the optimizer step of '{name}' did not arrive in the new launch.")


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A new rank's random stream after an elastic resume: from (seed, step, rank), never an old rank's state."""
    import numpy as np

    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def restore_rank_rng(ckpt_dir: Path, rank: int) -> None:
    """This process continues the random streams that rank `rank` saved (Python, numpy, torch CPU and CUDA), as
    Accelerate's load_state restores them (a weights_only load; the checkpoint's pickles were scanned before)."""
    import random

    import numpy as np
    import torch
    from accelerate.utils import load

    states = load(Path(ckpt_dir) / rank_state_file(rank), map_location="cpu")
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def load_resharded(ckpt_dir: Path, accelerator, model, optimizer, scheduler, *, seed: int) -> dict:
    """Restore checkpoint `ckpt_dir` into a launch of another topology (every rank); returns its training state."""
    from accelerate.utils import set_seed

    from opentau_cli.policies.lora import BASE_KEY
    from opentau_cli.store.runs import read_training_state

    state = read_training_state(Path(ckpt_dir))
    trainable = [name for name, _ in _trainable(accelerator.unwrap_model(model))]
    canon = read_canonical(ckpt_dir, trainable)
    apply_canonical(canon, accelerator, model, optimizer, scheduler, frozen_from_base=BASE_KEY in state)
    check_applied(canon, accelerator, model, optimizer)
    if int(state["world_size"]) == accelerator.num_processes:
        restore_rank_rng(ckpt_dir, accelerator.process_index)  # rank i keeps rank i's streams
    else:
        set_seed(derived_seed(seed, int(state["step"]), accelerator.process_index))
    if "sampler" in state and "position" not in state["sampler"]:
        state["sampler"] = sampler_position(state, json.loads((Path(ckpt_dir) / TRAIN_CONFIG).read_text()))
    return state


def sampler_position(state: dict, saved_cfg: dict) -> dict:
    """The data stream's state with its global sample position, for a checkpoint saved before the stream recorded
    it: the batches each rank delivered x that launch's global micro-batch."""
    sampler = state["sampler"]
    micro = saved_cfg.get("per_device_batch_size") or saved_cfg["batch_size"] // saved_cfg.get("gradient_accumulation_steps", 1)
    return dict(sampler, position=int(sampler["batch"]) * int(micro) * int(state["world_size"]))
