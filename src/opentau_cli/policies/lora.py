"""LoRA fine-tuning (peft): adapters on a built policy, what a LoRA checkpoint holds, and the merge into a plain model.

`apply_lora` injects peft's LoRA layers into the policy in place, so every name stays the policy's own: an adapted
module `M` holds `M.base_layer.weight` (frozen) and `M.lora_A.default.weight` / `M.lora_B.default.weight`. A LoRA
checkpoint holds only what trains (the adapters, `full_modules`) and the buffers (statistics), never the frozen
base; its training_state.json names the base (`base_reference`), which is loaded first on resume and at export.
`merge_adapter` folds the adapters into the base: merged = base + (alpha / rank) * B @ A.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from opentau_cli.config.model import LoraConfig, PolicyConfig
from opentau_cli.errors import UserError

ADAPTER = "default"  # peft's adapter name, part of every adapter key
_ADAPTER_KEY = re.compile(rf"^(?P<module>.+)\.lora_(?P<which>[AB])\.{ADAPTER}\.weight$")
BASE_KEY = "lora_base"  # where training_state.json records the base weights


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _never_trained(policy: nn.Module) -> set[str]:
    """Parameters no gradient reaches in this mode: an adapter on them would never train (and would break DDP)."""
    names = set(policy.unused_parameter_names())
    cfg = policy.cfg
    if cfg.knowledge_insulation and not cfg.discrete_action_loss:  # as in Pi05Policy.set_trainable
        names |= {n for n, _ in policy.named_parameters() if n.startswith("vlm.")}
    return names


def target_names(policy: nn.Module, lora_cfg: LoraConfig) -> list[str]:
    """The Linear modules that get adapters: those `target_modules` names (peft's own matching), less those whose
    weight no gradient reaches. Refuses a target that is not a Linear and a selection that is empty."""
    from peft import LoraConfig as PeftLoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    probe = PeftLoraConfig(r=max(1, lora_cfg.rank), target_modules=lora_cfg.target_modules)
    never = _never_trained(policy)
    targets = []
    for name, module in policy.named_modules():
        if not name or not check_target_module_exists(probe, name):
            continue
        if not isinstance(module, nn.Linear):
            raise UserError(f"policy.lora.target_modules matches {name}, a {type(module).__name__}: LoRA adapts Linear "
                            "layers only (e.g. vlm.language_model.layers.0.self_attn.q_proj).")
        if f"{name}.weight" not in never:
            targets.append(name)
    if not targets:
        raise UserError(f"policy.lora.target_modules={lora_cfg.target_modules!r} matches no trainable Linear layer of the "
                        f"{policy.cfg.preset} policy (names look like vlm.language_model.layers.0.self_attn.q_proj, "
                        "expert.layers.0.mlp.down_proj).")
    return targets


def full_parameter_names(policy: nn.Module, lora_cfg: LoraConfig) -> list[str]:
    """The parameters `full_modules` trains in full; refuses a module name that holds none."""
    names = [n for n, _ in policy.named_parameters()]
    never = _never_trained(policy)
    chosen = []
    for module in lora_cfg.full_modules:
        found = [n for n in names if n.startswith(module + ".")]
        if not found:
            raise UserError(f"policy.lora.full_modules names '{module}', which holds no parameter of the "
                            f"{policy.cfg.preset} policy (e.g. embed_suffix, action_out_proj, expert.norm).")
        chosen += [n for n in found if n not in never and not is_adapter(n)]
    return chosen


def apply_lora(policy: nn.Module, lora_cfg: LoraConfig) -> nn.Module:
    """Inject the adapters in place and train only them and `full_modules`. Call once the base weights are loaded
    and before `accelerator.prepare` (under ZeRO-3 on the partitioned model: DeepSpeed partitions the new adapters
    when the engine is built). Draws lora_A's initial values from the global RNG, in module order."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    targets = target_names(policy, lora_cfg)
    full = set(full_parameter_names(policy, lora_cfg))
    peft_cfg = PeftLoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                              target_modules=targets, bias="none")
    inject_adapter_in_model(peft_cfg, policy, adapter_name=ADAPTER)
    for name, param in policy.named_parameters():
        param.requires_grad_(is_adapter(name) or name in full)
    return policy


def checkpoint_keys(model: nn.Module) -> set[str]:
    """The state-dict entries a LoRA checkpoint holds: every trainable parameter and every buffer."""
    params = dict(model.named_parameters())
    return {k for k in model.state_dict() if k not in params or params[k].requires_grad}


def _plain(key: str) -> str:
    return key[len("module."):] if key.startswith("module.") else key  # DDP's wrapper prefix


def register_checkpoint_hooks(accelerator, model: nn.Module) -> tuple[dict, dict]:
    """Make `accelerator.save_state` / `load_state` write and read only what trains; returns the keyword arguments
    the two calls need (DeepSpeed writes its own files: it is told to leave the frozen parameters out).

    Single / DDP: the weights handed to the writer are filtered; a load checks that the file holds exactly those
    keys, then loads non-strictly over the base already in place. FSDP2: the DCP state holds only those keys."""
    from opentau_cli.errors import RunError
    from opentau_cli.store.layout import MODEL_WEIGHTS

    from opentau_cli.store.dcp import is_sharded

    keep = checkpoint_keys(model)
    if accelerator.state.deepspeed_plugin is not None:
        return {"exclude_frozen_parameters": True}, {"load_module_strict": False}
    if is_sharded(model):  # FSDP2: its DCP hook writes and reads `keep` only (train/fsdp.py prepare)
        return {}, {}

    def keep_trainable(models, weights, output_dir):
        for state in weights:
            for key in [k for k in state if _plain(k) not in keep]:
                del state[key]

    def check_trainable(models, input_dir):
        from safetensors import safe_open

        with safe_open(str(Path(input_dir) / MODEL_WEIGHTS), framework="pt") as f:
            found = {_plain(k) for k in f.keys()}
        if found != keep:
            extra, missing = sorted(found - keep), sorted(keep - found)
            raise RunError(f"{input_dir}/{MODEL_WEIGHTS} does not hold this LoRA policy's trained tensors "
                           f"(missing {missing[:3]}, unexpected {extra[:3]}).")

    accelerator.register_save_state_pre_hook(keep_trainable)
    accelerator.register_load_state_pre_hook(check_trainable)
    return {}, {"strict": False}


# ----------------------------------------------------------------------------------------- the base weights
def base_reference(policy_cfg: PolicyConfig, seed: int) -> dict:
    """What a LoRA checkpoint records of its frozen base: the source (path or repo id) and the xxh3-128 of each of
    its weight files; without pretrained_path the base is the seeded initial policy, recorded by its seed."""
    if policy_cfg.pretrained_path is None:
        return {"source": None, "seed": seed}
    from opentau_cli.policies import hub
    from opentau_cli.policies.pretrained import weight_files
    from opentau_cli.store.manifest import hash_file

    path = hub.resolve(str(policy_cfg.pretrained_path), "policy.pretrained_path")
    return {"source": str(policy_cfg.pretrained_path), "files": {f.name: hash_file(f) for f in weight_files(path)}}


def check_resume(ckpt_dir: Path, saved_policy: dict, state: dict, cfg) -> None:
    """Refuse a resume whose LoRA setting differs from the checkpoint's, or whose base weights changed (UserError)."""
    saved = LoraConfig(**saved_policy.get("lora", {}))
    now = cfg.policy.lora
    if saved != now:
        raise UserError(f"Checkpoint '{ckpt_dir}' was trained with policy.lora={saved.model_dump(mode='json')} and this "
                        f"launch has {now.model_dump(mode='json')}: resume with the checkpoint's own LoRA setting.")
    if not now.enabled:
        return
    check_base(ckpt_dir, state, cfg)


def check_base(ckpt_dir: Path, state: dict, cfg) -> None:
    """Refuse (UserError) a LoRA checkpoint whose base weights, as `cfg` finds them now, are not those it recorded."""
    recorded = state.get(BASE_KEY)
    if recorded is None:
        raise UserError(f"Checkpoint '{ckpt_dir}' is a LoRA checkpoint without a record of its base weights in its "
                        "training_state.json; its adapters cannot be used.")
    current = base_reference(cfg.policy, cfg.seed)
    if _content(current) != _content(recorded):  # the content decides: a moved or re-downloaded base is the same
        raise UserError(f"Checkpoint '{ckpt_dir}' holds LoRA adapters of the base weights {_described(recorded)} and "
                        f"this launch's base ({_described(current)}) is not the same content: use the base weights it "
                        "was trained on.")


def _content(ref: dict) -> tuple:
    return ("files", ref.get("files")) if ref.get("source") else ("seed", ref.get("seed"))


def _described(ref: dict) -> str:
    return ref["source"] if ref.get("source") else f"the seeded initial policy (seed {ref.get('seed')})"


# ----------------------------------------------------------------------------------------- merge
def merge_adapter(state: dict[str, torch.Tensor], lora_cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """A plain policy state dict from a LoRA one: each adapted weight becomes base + (alpha / rank) * B @ A
    (computed in fp32, stored in the base's dtype), the adapter keys go and `M.base_layer.x` is named `M.x` again.

    `state` holds the base under either name (`M.base_layer.weight` from an adapted policy, `M.weight` from a plain
    base state dict updated with a checkpoint's tensors). Refuses an adapter without its pair or its base."""
    scale = lora_cfg.alpha / lora_cfg.rank
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    merged: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        found = _ADAPTER_KEY.match(key)
        if found:
            adapters.setdefault(found["module"], {})[found["which"]] = tensor
        elif is_adapter(key):
            raise ValueError(f"{key}: not an adapter of peft's adapter '{ADAPTER}'.")
        else:
            merged[key.replace(".base_layer.", ".")] = tensor
    for module, pair in adapters.items():
        weight = f"{module}.weight"
        if set(pair) != {"A", "B"} or weight not in merged:
            raise ValueError(f"{module}: needs lora_A, lora_B and its base weight to merge (has {sorted(pair)}).")
        base = merged[weight]
        delta = pair["B"].to(torch.float32) @ pair["A"].to(torch.float32)
        merged[weight] = (base.to(torch.float32) + scale * delta.to(base.device)).to(base.dtype)
    return merged


def restore_policy(cfg, trained: dict[str, torch.Tensor]) -> nn.Module:
    """The adapted policy of a LoRA checkpoint, in memory (CPU, fp32): the base built and loaded as training did
    (the seeded initial policy, then policy.pretrained_path), the adapters, full modules and buffers from `trained`
    (the checkpoint's tensors; check_base first). Under DeepSpeed bf16 the run saw its base rounded to bf16."""
    from accelerate.utils import set_seed

    from opentau_cli.policies.build import build_policy
    from opentau_cli.policies.pretrained import load_pretrained

    set_seed(cfg.seed)
    policy = build_policy(cfg.policy)
    if cfg.policy.pretrained_path is not None:
        load_pretrained(policy, cfg.policy.pretrained_path, strict=cfg.policy.pretrained_strict)
    apply_lora(policy, cfg.policy.lora)
    keep = checkpoint_keys(policy)
    if set(trained) != keep:
        missing, extra = sorted(keep - set(trained)), sorted(set(trained) - keep)
        raise UserError(f"The checkpoint's tensors are not those of its LoRA policy (missing {missing[:3]}, unexpected "
                        f"{extra[:3]}).")
    policy.load_state_dict(trained, strict=False)
    return policy


def merged_state_dict(cfg, trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's policy as a plain state dict (the names of a policy without LoRA), adapters merged."""
    return merge_adapter(restore_policy(cfg, trained).state_dict(), cfg.policy.lora)
