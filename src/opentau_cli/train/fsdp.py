"""FSDP2: the policy sharded with torch's `fully_shard`, per transformer layer and at the root (docs/ARCHITECTURE.md,
"FSDP2").

opentau applies `fully_shard` itself, on GPUs and on CPU processes over gloo alike: Accelerate's launcher turns an
FSDP config into plain CPU DDP on a machine without GPUs, so the same code path on both needs it done here. The
model is never handed to `accelerator.prepare` (that would wrap it in DDP); the optimizer and scheduler stay plain
torch objects and the checkpoint writes them with torch.distributed.checkpoint (store/dcp.py).
"""

from __future__ import annotations

import warnings

import torch

from opentau_cli.config.accelerate import AccelerateSetup, FsdpSettings, fsdp_settings


def layer_groups(policy) -> list[tuple[str, list[torch.nn.Module]]]:
    """(where, layers) of each transformer stack: SigLIP's encoder layers, the Gemma decoder layers, the action
    expert's layers."""
    return [
        ("vlm.vision_tower.encoder.layers", list(policy.vlm.vision_tower.encoder.layers)),
        ("vlm.language_model.layers", list(policy.language_model.layers)),
        ("expert.layers", list(policy.expert.layers)),
    ]


def fp32_modules(policy) -> list[str]:
    """The modules whose parameters openpi keeps in fp32 (the policy's fp32 set): under bf16 each is a unit of its
    own that gathers fp32 parameters, so they compute in fp32 as under DeepSpeed bf16 ("Precision")."""
    names = sorted({name.rsplit(".", 1)[0] for name in policy.fp32_parameter_names()})
    return [n for n in names if not any(n.startswith(other + ".") for other in names)]


def shard_policy(policy: torch.nn.Module, settings: FsdpSettings, device: torch.device) -> torch.nn.Module:
    """Apply `fully_shard` to `policy` in place (every process of the default group holds one shard) and return it.

    Units: the fp32 set under bf16, each transformer layer, then the root; the batch reaches the root unrounded
    (its inputs are not cast), the layers compute in the parameters' dtype."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    bf16 = settings.mixed_precision == "bf16"
    compute = torch.bfloat16 if bf16 else None
    layer_mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if bf16 else None)
    root_mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if bf16 else None,
                                   cast_forward_inputs=False)
    fp32_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    common = dict(mesh=mesh, offload_policy=CPUOffloadPolicy() if settings.offload_params else OffloadPolicy())
    modules = dict(policy.named_modules())
    # Layers return views (their keys / values); the policy never changes a layer's output in place, which is what
    # FSDP's warning about views is for.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    if bf16:
        for name in fp32_modules(policy):
            fully_shard(modules[name], mp_policy=fp32_mp, reshard_after_forward=settings.reshard_after_forward, **common)
    if settings.wrap == "TRANSFORMER_BASED_WRAP":
        for _, layers in layer_groups(policy):
            for layer in layers:
                if type(layer).__name__ in settings.layer_classes:
                    fully_shard(layer, mp_policy=layer_mp, reshard_after_forward=settings.reshard_after_forward, **common)
        route_layer_calls(policy)
    fully_shard(policy, mp_policy=root_mp, reshard_after_forward=settings.reshard_after_forward, **common)
    return policy


def shard_for_launch(policy: torch.nn.Module, setup: AccelerateSetup, accelerator) -> torch.nn.Module:
    """The built policy sharded for this launch (before its optimizer is made, over the sharded parameters); rank 0's
    log says which units it made."""
    policy = shard_policy(policy, fsdp_settings(setup), accelerator.device)
    if accelerator.is_main_process:
        print(describe_units(policy), flush=True)
    return policy


def describe_units(policy) -> str:
    """'FSDP2 units: 2 SigLIP encoder layers, 2 Gemma decoder layers, 2 action expert layers, 9 fp32 modules, the
    root (2 processes)': the modules fully_shard made units of."""
    from torch.distributed.fsdp import FSDPModule

    counts = [sum(isinstance(layer, FSDPModule) for layer in layers) for _, layers in layer_groups(policy)]
    layer_ids = {id(layer) for _, layers in layer_groups(policy) for layer in layers}
    fp32 = sum(isinstance(m, FSDPModule) and id(m) not in layer_ids and m is not policy for m in policy.modules())
    mesh_size = next(p for p in policy.parameters()).device_mesh.size()
    return (f"FSDP2 units: {counts[0]} SigLIP encoder layers, {counts[1]} Gemma decoder layers, {counts[2]} action "
            f"expert layers, {fp32} fp32 modules, the root ({mesh_size} processes).")


def prepare(accelerator, model, optimizer, scheduler, *, lora: bool = False):
    """What `accelerator.prepare` does for the other backends: the model is already sharded and is not handed to
    Accelerate (it would wrap it in DDP), the optimizer stays torch's (its state is sharded like the parameters) and
    the scheduler is Accelerate's; save_state / load_state write and read the sharded model and optimizer with DCP
    (store/dcp.py). With `lora` a checkpoint holds only what trains and the buffers, as for every backend
    (policies/lora.py); the frozen base is built again on resume."""
    from opentau_cli.policies.lora import checkpoint_keys
    from opentau_cli.store.dcp import register_with

    register_with(accelerator, model, optimizer, checkpoint_keys(model) if lora else None)
    return model, optimizer, accelerator.prepare(scheduler)


def checkpoint_ema(accelerator, ema) -> None:
    """Every save of this launch also writes the EMA (`ema()`: the launch's WeightEMA or None, train/ema.py) with
    the model's shards, under `ema.` in the DCP state (store/dcp.py)."""
    from opentau_cli.store.dcp import registered

    registered(accelerator).ema = lambda: (e.state_dict() if (e := ema()) is not None else None)


def route_layer_calls(policy) -> None:
    """The policy runs its Gemma and expert layers through its own methods (`_prefix_layer`, `_expert_layer`: the
    joint attention over both streams), never through the layer's forward, where FSDP gathers a unit's parameters.
    Each layer gets the method as a forward of its own (`register_fsdp_forward_method`), and the policy calls it
    there, so a layer's parameters are gathered for its call and freed after, as with forward."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    for method, layers in (("_prefix_layer", policy.language_model.layers), ("_expert_layer", policy.expert.layers)):
        if not all(isinstance(layer, FSDPModule) for layer in layers):
            continue
        body = getattr(type(policy), method).__get__(policy)
        for layer in layers:
            layer.opentau_layer_call = body
            register_fsdp_forward_method(layer, "opentau_layer_call")

        def call(index, *args, _layers=layers):
            return _layers[index].opentau_layer_call(index, *args)

        setattr(policy, method, call)
