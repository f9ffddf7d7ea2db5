"""An exponential moving average of the trained weights (`ema.decay`, openpi's recipe; docs/ARCHITECTURE.md, "EMA
weights"): after each optimizer step ema = decay * ema + (1 - decay) * w, in fp32, starting from the weights the run
starts with (after any pretrained load and `accelerator.prepare`).

Single process / DDP: every rank keeps the EMA of every trainable parameter (the same on every rank, as the weights
are) and rank 0 writes it, by parameter name, as `ema.safetensors`. DeepSpeed ZeRO-1/2/3: each rank keeps the EMA of
its own flat fp32 master partitions (one per parameter group, what the wrapped AdamW steps), so no rank holds a full
copy, and writes them as `ema_rank<r>.safetensors` (`group_<g>`) laid out exactly as DeepSpeed saves those
partitions in its optimizer shards (ZeRO-1/2 without the alignment padding): the ZeRO reader cuts them by the plan
it cuts the master weights by (store/zero.py). FSDP2: the EMA of each parameter is a DTensor laid out as
the parameter (each rank averages its own shard) and is saved with the model's shards by DCP, under `ema.` in
`fsdp_state/` (store/dcp.py). With LoRA the trainable tensors are the adapters and the
fully trained modules, so those are what is averaged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from opentau_cli.errors import RunError
from opentau_cli.store.layout import EMA_STATE, EMA_WEIGHTS, ema_group_name, ema_rank_file

CHUNK = 1 << 24  # values updated at a time: the temporary (1 - decay) * w stays small beside a large partition


def ema_update_(ema, weights, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * weights, in place, for one tensor or matching lists of them, rounded as
    that expression is in fp32 (two products, then their sum). torch's multi-tensor (foreach) ops update groups of
    at most CHUNK values at a time: a few kernels for many small tensors, a small temporary beside a large one."""
    group, weighted, size = [], [], 0

    def update_group() -> None:
        torch._foreach_mul_(group, decay)
        torch._foreach_add_(group, torch._foreach_mul(weighted, 1.0 - decay))
        group.clear()
        weighted.clear()

    pairs = zip(ema, weights) if isinstance(ema, (list, tuple)) else [(ema, weights)]
    for e, w in pairs:
        for e_part, w_part in zip(e.view(-1).split(CHUNK), w.detach().reshape(-1).split(CHUNK)):
            if size + e_part.numel() > CHUNK:
                update_group()
                size = 0
            group.append(e_part)
            weighted.append(w_part.float())
            size += e_part.numel()
    if group:
        update_group()


@dataclass
class WeightEMA:
    """This rank's EMA: `live` are the tensors averaged (parameters, or ZeRO's flat fp32 partitions), `shadow` their
    fp32 averages, `lengths` how many values of each a checkpoint holds, `file` what this rank writes (None: a DDP
    rank other than 0 writes nothing)."""

    decay: float
    names: list[str]
    live: list[torch.Tensor]
    shadow: list[torch.Tensor]
    lengths: list[int]
    file: str | None
    zero_stage: int | None = None
    _zero_opt: object = None
    _module: object = None  # the unwrapped model (load_full finds parameters by name in it)
    _rank: int = 0
    sharded: bool = False  # FSDP2: live and shadow are DTensors; the shadow is saved with DCP, not by `files`

    @classmethod
    def build(cls, decay: float, accelerator, model) -> "WeightEMA":
        """The EMA of what `model` (prepared) trains now, on every rank."""
        from opentau_cli.store.dcp import is_sharded
        from opentau_cli.train.reshard import flat_partitions, zero_optimizer

        if is_sharded(model):  # FSDP2: each shadow a DTensor with its parameter's placement
            named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            live = [p for _, p in named]
            return cls(decay, [name for name, _ in named], live, [_fp32_copy(p) for p in live], [p.numel() for p in live],
                       None, _module=model, _rank=accelerator.process_index, sharded=True)
        zero_opt, stage = zero_optimizer(accelerator)
        if zero_opt is None:
            module = accelerator.unwrap_model(model)
            named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
            live = [p for _, p in named]
            return cls(decay, [name for name, _ in named], live, [_fp32_copy(p) for p in live], [p.numel() for p in live],
                       EMA_WEIGHTS if accelerator.is_main_process else None, _module=module)
        live = list(flat_partitions(zero_opt, stage))
        # ZeRO-1/2 pad each group's partition for alignment and save it without the padding (its state_dict).
        padding = list(zero_opt.groups_padding) if stage < 3 else [0] * len(live)
        return cls(decay, [ema_group_name(g) for g in range(len(live))], live, [_fp32_copy(t) for t in live],
                   [t.numel() - pad for t, pad in zip(live, padding)], ema_rank_file(accelerator.process_index),
                   zero_stage=stage, _zero_opt=zero_opt, _module=accelerator.unwrap_model(model),
                   _rank=accelerator.process_index)

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step from the weights as they are now (call it after each optimizer step)."""
        ema_update_(_local(self.shadow), _local(self.live), self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of this rank's EMA, by name (views, not copies)."""
        return {name: ema.view(-1)[:n] if self.zero_stage is not None else ema
                for name, ema, n in zip(self.names, self.shadow, self.lengths)}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor], source: str = "the checkpoint") -> None:
        mine = self.state_dict()
        if set(tensors) != set(mine):
            missing, extra = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
            raise RunError(f"{source} does not hold this run's EMA (missing {missing[:3]}, unexpected {extra[:3]}).")
        for name, dest in mine.items():
            if tuple(tensors[name].shape) != tuple(dest.shape):
                raise RunError(f"{source}: the EMA tensor '{name}' has shape {tuple(tensors[name].shape)}, this run's "
                               f"{tuple(dest.shape)}.")
            dest.copy_(tensors[name])

    def files(self) -> dict[str, dict[str, torch.Tensor]]:
        """The checkpoint file this rank writes and its tensors ({} on a DDP rank other than 0)."""
        return {self.file: self.state_dict()} if self.file else {}

    def load(self, ckpt_dir: Path) -> None:
        """Continue the EMA a checkpoint of the same topology holds (its manifest was checked by the resume plan)."""
        from safetensors.torch import load_file

        if self.sharded:
            from opentau_cli.store.dcp import EMA_KEY, load_into

            load_into(Path(ckpt_dir), EMA_KEY, self.state_dict())
            return
        path = Path(ckpt_dir) / (self.file or EMA_WEIGHTS)
        if not path.is_file():
            raise RunError(f"{path} is missing: the checkpoint holds no EMA for this rank.")
        self.load_state_dict(load_file(str(path)), str(path))

    @torch.no_grad()
    def load_full(self, saved: dict) -> None:
        """Take the EMA of another topology (an elastic resume; docs/ARCHITECTURE.md, "Resume contract"): `saved`
        gives each parameter's full fp32 EMA by name (a callable). Under ZeRO each rank keeps its own slice: DeepSpeed's
        own setters of the fp32 master weights cut it into the live partitions, which are then copied into the EMA
        and given their live values back (the model's own weights are not touched)."""
        from opentau_cli.train.reshard import CanonicalState, saved_name, zero3_slice

        module_params = dict(self._module.named_parameters(remove_duplicate=False))
        trainable = [(name, p) for name, p in self._module.named_parameters() if p.requires_grad]

        def full(name, p) -> torch.Tensor:
            found = saved_name(CanonicalState(weights=saved), module_params, p, name)
            if found is None:
                raise RunError(f"the checkpoint's EMA holds no tensor for parameter '{name}': it does not fit this run.")
            return saved[found]().to(torch.float32)

        if self.sharded:
            from opentau_cli.store.dcp import shard_like

            for name, shadow in zip(self.names, self.shadow):
                shadow.to_local().copy_(shard_like(full(name, module_params[name]), shadow).to_local())
            return
        if self.zero_stage is None:
            for name, shadow in zip(self.names, self.shadow):
                shadow.copy_(full(name, module_params[name]).view_as(shadow))
            return
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

        live = [t.detach().clone() for t in self.live]
        try:
            for name, p in trainable:
                value = full(name, p).to(self.live[0].device)
                if self.zero_stage == 3:
                    safe_set_local_fp32_param(p, zero3_slice(value, p.ds_tensor.numel(), self._rank))
                else:
                    safe_set_full_fp32_param(p, value)
            for shadow, t in zip(self.shadow, self.live):
                shadow.copy_(t)
        finally:
            for t, keep in zip(self.live, live):
                t.copy_(keep)

    @contextlib.contextmanager
    @torch.no_grad()
    def swap_in(self):
        """The model computes with the EMA weights inside the block (every rank enters it: a collective under
        ZeRO-1/2); the live weights come back exactly afterwards. Holds one copy of this rank's live tensors."""
        live = _local(self.live)
        saved = [t.detach().clone() for t in live]
        try:
            for t, ema in zip(live, _local(self.shadow)):
                t.copy_(ema)
            self._to_model()
            yield
        finally:
            for t, keep in zip(live, saved):
                t.copy_(keep)
            self._to_model()

    def _to_model(self) -> None:
        """Under ZeRO the model computes with its own (bf16) copy of the fp32 partitions: refresh it from them. Under
        FSDP2 a unit left gathered (reshard_after_forward: false) would compute with the gathered copy: every unit
        is resharded, so its next forward gathers the shards as they are now."""
        if self.sharded:
            from torch.distributed.fsdp import FSDPModule

            for m in self._module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
            return
        if self.zero_stage is None:
            return
        opt = self._zero_opt
        if self.zero_stage < 3:
            opt.update_lp_params()
            return
        # What ZeRO-3's step does around its update: every parameter back to its partition (also those it keeps
        # gathered, the persistent small ones), each group's partitions from its fp32 partition, then the persistent
        # parameters gathered again.
        opt._partition_all_parameters()
        for g in range(len(self.live)):
            opt._reassign_or_swap_out_partitioned_parameters(g)
        if opt.persistent_parameters:
            opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
        opt.invalidate_secondary_tensor()


def _local(tensors: list) -> list:
    """This rank's part of each tensor: a DTensor's local shard (same storage), a plain tensor itself."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32, copy=True).contiguous()


def build_ema(cfg, accelerator, model) -> WeightEMA | None:
    """The run's EMA when `ema.decay` is set, else None."""
    return WeightEMA.build(cfg.ema.decay, accelerator, model) if cfg.ema.enabled else None


def ema_record(ema: WeightEMA) -> dict:
    return {"decay": ema.decay}


def resume_ema(ema: WeightEMA | None, state: dict, ckpt_dir: Path, accelerator, model, *, resharded: bool = False
               ) -> WeightEMA | None:
    """The EMA a resumed launch continues: the checkpoint's (same topology), or, when the checkpoint holds none, a
    new one from the restored weights; each case that is not a plain continuation is said in the rank-0 log."""
    saved = state.get(EMA_STATE)
    say = (lambda text: print(text, flush=True)) if accelerator.is_main_process else (lambda text: None)
    if ema is None:
        if saved:
            say(f"The checkpoint's EMA (decay {saved.get('decay')}) is not continued: ema.decay is 0 in this launch.")
        return None
    if not saved:
        say(f"The checkpoint holds no EMA: the EMA starts at step {state.get('step')} from its weights.")
        return WeightEMA.build(ema.decay, accelerator, model)
    if resharded:
        ema.load_full(saved_by_name(ckpt_dir, state))
    else:
        ema.load(ckpt_dir)
    return ema


def saved_by_name(ckpt_dir: Path, state: dict) -> dict:
    """A checkpoint's EMA as full fp32 tensors by parameter name, each read when called: ema.safetensors, or the
    ranks' partitions cut by the ZeRO reader's plan (store/zero.py)."""
    if state.get("backend") == "deepspeed":
        from opentau_cli.store.zero import read_zero_checkpoint

        return {e.name: e.produce for e in read_zero_checkpoint(ckpt_dir, ema=True).entries}
    if state.get("backend") == "fsdp":
        from opentau_cli.store.dcp import EMA_KEY, saved_entries

        return {name: e.produce for name, e in saved_entries(ckpt_dir, EMA_KEY + ".").items()}
    from safetensors import safe_open

    f = safe_open(str(Path(ckpt_dir) / EMA_WEIGHTS), framework="pt")
    return {name: (lambda name=name: f.get_tensor(name)) for name in f.keys()}
