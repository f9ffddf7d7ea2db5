"""pi05 (and pi0) as one torch module built from transformers pieces, computing what openpi's pi05 computes.

What is reused from transformers: `PI0Config` (sub-configs), `PaliGemmaModel` (SigLIP vision tower, projector, Gemma
language model), a Gemma model as the action expert, Gemma's attention projections / MLP / RMSNorm / rotary
embedding.

What is written here is what pi05 changes, plus the per-layer control it needs:
- the prefix (images + prompt) runs through the VLM layers, keeping each layer's keys/values (a KV cache, as in
  transformers' PI0); the expert's layers then attend to that cache and to the action tokens. This equals joint
  attention because the prefix never attends to the suffix;
- adaRMS: the expert's RMSNorms take scale, shift and a residual gate from the flow-matching time;
- the robot state, quantile-normalized, is discretized into 256 bins inside the prompt (pi0 instead uses a state
  token and mean/std normalization);
- precision as in openpi: the patch and position embeddings, every norm (the adaRMS dense layers too) and the
  action / time projections compute in fp32 while the rest may run in bf16 (autocast, or bf16 weights);
- knowledge insulation: the expert sees detached prefix keys/values;
- an optional cross-entropy loss on uniformly binned action tokens appended to the prefix (a simple stand-in for
  pi05's FAST tokens), causal among themselves and hidden from the expert.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import transformers.generation.utils  # noqa: F401  (model construction imports it lazily; see policies/__init__.py)
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.gemma.modeling_gemma import GemmaModel, GemmaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.paligemma.modeling_paligemma import PaliGemmaModel

from opentau_cli.config.model import PolicyConfig
from opentau_cli.data.images import to_unit_float
from opentau_cli.data.normalization import IDENTITY, MEAN_STD, QUANTILE, STATS, STATS_OF, mode_of, normalize, unnormalize
from opentau_cli.errors import UserError
from opentau_cli.policies.pi05.configuration import arch_config
from opentau_cli.policies.pi05.tokenization import PromptTokenizer, action_token_id, load_tokenizer

# Parameters that openpi keeps in fp32 when the rest of the model is bf16 (matched as name fragments): SigLIP's patch
# and position embeddings, every Gemma norm of the VLM and the expert (the adaRMS dense layers included), and the
# projections between actions / time and the expert. They compute in fp32 in every mode: fp32 weights under DDP's
# bf16 autocast and after cast_weights(bf16); under DeepSpeed bf16, which stores every weight in bf16, from those.
FP32_PARAMETERS = (
    "vision_tower.embeddings.patch_embedding.", "vision_tower.embeddings.position_embedding.",
    "input_layernorm.", "post_attention_layernorm.", "language_model.norm.", "expert.norm.",
    "embed_suffix.", "action_out_proj.",
)
# Bins of the optional discrete action tokens span the normalized range holding nearly every value.
DISCRETE_RANGE = {QUANTILE: 1.0, MEAN_STD: 3.0}


def discretize(x: torch.Tensor, bins: int, limit: float) -> torch.Tensor:
    """Uniform bins over [-limit, limit] of a normalized value (clipped)."""
    scaled = (x.float().clamp(-limit, limit) + limit) / (2 * limit)
    return (scaled * bins).long().clamp(0, bins - 1)


def flow_matching_pair(actions: torch.Tensor, noise: torch.Tensor, time: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The noisy actions x_t = t * noise + (1 - t) * actions and the target velocity u = noise - actions, in fp32
    whatever the surrounding autocast or the weights' dtype (docs/ARCHITECTURE.md, "Precision")."""
    actions, noise, time = actions.float(), noise.float(), time.float()
    with no_autocast(actions):
        noisy = time[:, None, None] * noise + (1 - time[:, None, None]) * actions
        return noisy, noise - actions


def real_widths(batch: dict, key: str, width: int, device) -> torch.Tensor:
    """Each sample's real state / action dims (`batch[key]`, docs/ARCHITECTURE.md "Batch format"); absent: all `width`."""
    if key not in batch:
        return torch.full((len(batch["state"]),), width, dtype=torch.int64, device=device)
    return torch.as_tensor(batch[key], dtype=torch.int64, device=device).reshape(-1)


def no_autocast(like: torch.Tensor):
    return torch.autocast(like.device.type, enabled=False)


# The fp32 layers compute inside their own forward, where ZeRO-3 has gathered their parameters.
class Fp32Linear(nn.Linear):
    """A Linear that computes in fp32 whatever the surrounding autocast, its weights upcast where stored in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with no_autocast(x):
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class Fp32Conv2d(nn.Conv2d):
    """SigLIP's patch embedding, computed in fp32 like Fp32Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with no_autocast(x):
            return self._conv_forward(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


def time_embedding(time: torch.Tensor, width: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Sine-cosine embedding of the flow time (periods 4e-3..4, sines then cosines), computed in float64 as openpi does."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * time.double()[:, None]
    return torch.cat([angle.sin(), angle.cos()], dim=1).float()


def sample_time(batch_size: int, device) -> torch.Tensor:
    """Flow-matching times t ~ Beta(1.5, 1) * 0.999 + 0.001: weighted towards noise (t=1), never exactly 0."""
    beta = torch.distributions.Beta(torch.tensor(1.5, device=device), torch.tensor(1.0, device=device))
    return beta.sample((batch_size,)) * 0.999 + 0.001


class AdaRMS(nn.Module):  # not named *RMSNorm: transformers would re-init it as a plain norm (gate 0)
    """RMSNorm whose scale, shift and residual gate are a linear function of the time conditioning.

    Always 3*dim rows (scale, shift, gate), as in the published pi05, also for the expert's final norm, whose gate
    is computed and unused: the module holds the published weights as they are.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.dim = eps, dim
        # Raw parameters created with their final values (no in-place init after construction): safe under ZeRO-3's
        # zero.Init, which partitions parameters as soon as a module's __init__ returns.
        self.weight = nn.Parameter(torch.zeros(3 * dim, cond_dim))
        # scale 0, shift 0, gate 1 at init: starts as a plain norm + residual. openpi zero-inits the gate too, which
        # only suits loading pretrained weights; a gate of 0 would silence every expert layer when training from scratch.
        bias = torch.zeros(3 * dim)
        bias[2 * dim :] = 1.0
        self.bias = nn.Parameter(bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        with no_autocast(x):
            modulation = F.linear(cond.float(), self.weight.float(), self.bias.float())[:, None, :]
        scale, shift, gate = modulation.split(self.dim, dim=-1)
        return (normed * (1 + scale) + shift).to(x.dtype), gate.to(x.dtype)


class Pi05TimeEmbedding(nn.Module):
    """Noisy actions -> expert tokens; time -> the adaRMS conditioning (sinusoid, then a 2-layer MLP). All in fp32."""

    def __init__(self, arch):
        super().__init__()
        self.width = arch.dit_config.hidden_size
        self.action_in_proj = Fp32Linear(arch.max_action_dim, self.width)
        self.time_mlp_in = Fp32Linear(self.width, self.width)
        self.time_mlp_out = Fp32Linear(self.width, self.width)

    def forward(self, noisy_actions: torch.Tensor, time: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.action_in_proj(noisy_actions)
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_embedding(time, self.width)))))
        return tokens, cond


class Pi0ActionTimeEmbedding(nn.Module):
    """pi0's suffix: a state token, then each noisy action fused with the time embedding by a 2-layer MLP. All in fp32.

    Parameter names as in transformers' PI0ActionTimeEmbedding (the LeRobot pi0 layout); written here to compute in
    fp32 with openpi's float64 time embedding.
    """

    def __init__(self, arch):
        super().__init__()
        self.width = width = arch.dit_config.hidden_size
        self.action_in_proj = Fp32Linear(arch.max_action_dim, width)
        self.state_proj = Fp32Linear(arch.max_state_dim, width)
        self.action_time_mlp_in = Fp32Linear(2 * width, width)
        self.action_time_mlp_out = Fp32Linear(width, width)

    def forward(self, state: torch.Tensor, noisy_actions: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        actions = self.action_in_proj(noisy_actions)
        times = time_embedding(time, self.width)[:, None, :].expand_as(actions)
        fused = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([actions, times], dim=2))))
        return torch.cat([self.state_proj(state)[:, None, :], fused], dim=1)


def _norm(norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | None):
    if isinstance(norm, AdaRMS):
        return norm(x, cond)
    return norm(x), None


def _gated(residual: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return residual + (out if gate is None else out * gate)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    batch, length, _ = x.shape
    return x.view(batch, length, -1, head_dim).transpose(1, 2)


def _attend(q, k, v, mask) -> torch.Tensor:
    """Attention of q's heads over k/v's (fewer) heads under a dense boolean mask (batch, queries, keys).

    torch's grouped-query attention (`enable_gqa`) runs only in the flash and math kernels on CUDA, and flash takes no
    mask: with both, CUDA falls back to the math kernel (full fp32 score matrices). Expanding each key/value head to its
    query heads computes the same function in the memory-efficient kernel."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    return out.transpose(1, 2).flatten(2)


# What torch's profiler calls each scaled_dot_product_attention kernel.
SDPA_KERNELS = {
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_attention_math": "math",
}


def attention_kernels(run) -> dict[str, int]:
    """Run `run()` under torch's profiler and count the scaled-dot-product-attention kernels it used, by name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name in SDPA_KERNELS:
            counts[SDPA_KERNELS[event.name]] = counts.get(SDPA_KERNELS[event.name], 0) + 1
    return counts


class Pi05Policy(nn.Module):
    """The policy module: `forward(batch) -> losses`, `sample_actions(batch) -> actions`."""

    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.cfg = cfg
        self.norm_mode = mode_of(cfg.type)
        arch = arch_config(cfg)
        # The expert never reads token ids: a 1-row table instead of a vocabulary-sized one, removed below.
        arch.dit_config.vocab_size = 1
        self.arch = arch
        self.vocab_size = arch.vlm_config.text_config.vocab_size
        self.head_dim = arch.vlm_config.text_config.head_dim
        self.tokenizer = load_tokenizer(cfg.tokenizer_path, self.vocab_size)
        # Action tokens take the last ids of the vocabulary: they must not overlap the tokenizer's own ids.
        if cfg.discrete_action_loss and self.tokenizer.reserved + cfg.discrete_action_bins > self.vocab_size:
            raise UserError(
                f"policy.discrete_action_bins={cfg.discrete_action_bins} does not fit the {self.vocab_size}-token vocabulary "
                f"next to the tokenizer's {self.tokenizer.reserved} ids; lower it."
            )

        self.vlm = PaliGemmaModel(arch.vlm_config)
        self.expert = GemmaModel(arch.dit_config)
        # Unused parameters break DDP without find_unused_parameters: drop what the expert never reads.
        del self.expert.embed_tokens
        if cfg.type == "pi05":
            width = arch.dit_config.hidden_size
            self.embed_suffix = Pi05TimeEmbedding(arch)
            for layer in self.expert.layers:
                layer.input_layernorm = AdaRMS(width, width)
                layer.post_attention_layernorm = AdaRMS(width, width)
            self.expert.norm = AdaRMS(width, width)
        else:
            self.embed_suffix = Pi0ActionTimeEmbedding(arch)
        self.action_out_proj = Fp32Linear(arch.dit_config.hidden_size, cfg.max_action_dim)
        # Same parameters, an fp32 forward (swapping the class keeps transformers' initial values and any ZeRO-3 partition).
        self.vlm.vision_tower.embeddings.patch_embedding.__class__ = Fp32Conv2d

        # Dataset statistics travel with the weights; identity until set_stats (or a checkpoint) fills them. All four
        # are kept whichever normalization this type uses, so an exporter can write openpi's norm_stats in full.
        for key, width in (("state", cfg.max_state_dim), ("action", cfg.max_action_dim)):
            for stat in STATS:
                self.register_buffer(f"{key}_{stat}", torch.full((width,), IDENTITY[stat]))
        self.register_buffer("state_dim", torch.tensor([cfg.max_state_dim], dtype=torch.int64))
        self.register_buffer("action_dim", torch.tensor([cfg.max_action_dim], dtype=torch.int64))

        self.gradient_checkpointing = False
        self.set_trainable()

    # ----------------------------------------------------------------------------------------------- setup
    @property
    def image_resolution(self) -> tuple[int, int]:
        return tuple(self.cfg.image_resolution)

    @property
    def language_model(self) -> GemmaModel:
        return self.vlm.language_model

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the bulk of the weights (bf16 under DeepSpeed bf16 or after cast_weights, else fp32)."""
        return self.language_model.layers[0].self_attn.q_proj.weight.dtype

    def set_stats(self, stats: dict) -> None:
        """Fill the normalization buffers from `{"state": {"mean", "std", "q01", "q99"}, "action": {...}}` (real dims).

        The statistics this type's normalization reads are required (q01/q99 for pi05, mean/std for pi0); the others
        are kept when given and left at identity otherwise.
        """
        needed = STATS_OF[self.norm_mode]
        for key, limit_name in (("state", "max_state_dim"), ("action", "max_action_dim")):
            given = {k: torch.as_tensor(v, dtype=torch.float32).flatten() for k, v in stats[key].items() if k in STATS}
            missing = [k for k in needed if k not in given]
            if missing:
                raise UserError(f"The {key} statistics lack {'/'.join(missing)}, which {self.cfg.type}'s {self.norm_mode} normalization needs.")
            width = given[needed[0]].numel()
            limit = getattr(self.cfg, limit_name)
            if width > limit:
                raise UserError(f"The dataset's {key} has {width} dims but policy.{limit_name}={limit}; raise policy.{limit_name}.")
            for stat in STATS:
                buffer = getattr(self, f"{key}_{stat}").fill_(IDENTITY[stat])
                if stat in given:
                    buffer[: given[stat].numel()] = given[stat].to(buffer.device)
            getattr(self, f"{key}_dim").fill_(width)

    def _stats(self, key: str) -> dict[str, torch.Tensor]:
        return {stat: getattr(self, f"{key}_{stat}").float() for stat in STATS}

    def prompt_tokenizer(self) -> PromptTokenizer:
        """This policy's prompt rule with the statistics it holds now, on the host: what the data workers tokenize
        training batches with (train/trainer.py hands it over after the build and after a restore)."""
        stats = {k: v.detach().cpu() for k, v in self._stats("state").items()} if self.cfg.type == "pi05" else None
        return PromptTokenizer(self.tokenizer, self.cfg.tokenizer_max_length, stats, self.norm_mode)

    def fp32_parameter_names(self) -> list[str]:
        """The parameters openpi keeps in fp32 when the rest is bf16 (FP32_PARAMETERS)."""
        return [n for n, _ in self.named_parameters() if any(fragment in n for fragment in FP32_PARAMETERS)]

    def cast_weights(self, dtype: torch.dtype) -> "Pi05Policy":
        """Every parameter to `dtype` except the fp32 set, as openpi lays out its bf16 model; buffers stay as they are."""
        keep = set(self.fp32_parameter_names())
        for name, param in self.named_parameters():
            param.data = param.data.to(torch.float32 if name in keep else dtype)
        return self

    def reset_fp32_buffers(self) -> None:
        """Recompute the non-learned buffers in fp32 (after a build inside an init context that cast them)."""
        for module in self.modules():
            if isinstance(module, GemmaRotaryEmbedding) and module.rope_type == "default":
                inv_freq, _ = module.compute_default_rope_parameters(module.config)
                module.inv_freq = inv_freq.to(module.inv_freq.device)
                module.original_inv_freq = inv_freq.clone().to(module.inv_freq.device)
        for key in ("state", "action"):
            for stat in STATS:
                setattr(self, f"{key}_{stat}", getattr(self, f"{key}_{stat}").float())

    def unused_parameter_names(self) -> list[str]:
        """Parameters whose outputs nothing reads in the current mode (kept in the state_dict, never trained)."""
        if self.cfg.discrete_action_loss:
            return []
        # Without the CE loss nothing reads the prefix's final hidden states: the last VLM layer only contributes K/V.
        last = f"vlm.language_model.layers.{len(self.language_model.layers) - 1}."
        unused = [
            n
            for n, _ in self.named_parameters()
            if n.startswith(last) and not any(k in n for k in ("input_layernorm", "self_attn.k_proj", "self_attn.v_proj"))
        ]
        return unused + [n for n, _ in self.named_parameters() if n.startswith("vlm.language_model.norm.")]

    def set_trainable(self) -> None:
        """requires_grad per freeze_vision_encoder / train_expert_only, and off for parameters nothing reads."""
        cfg = self.cfg
        frozen_prefixes = []
        if cfg.freeze_vision_encoder:
            frozen_prefixes.append("vlm.vision_tower.")
        # With knowledge insulation and no CE loss no gradient reaches the VLM at all.
        if cfg.train_expert_only or (cfg.knowledge_insulation and not cfg.discrete_action_loss):
            frozen_prefixes.append("vlm.")
        unused = set(self.unused_parameter_names())
        for name, param in self.named_parameters():
            param.requires_grad_(name not in unused and not name.startswith(tuple(frozen_prefixes)))

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each transformer layer's activations in backward (VLM, expert and SigLIP layers)."""
        self.gradient_checkpointing = True
        self.vlm.vision_tower.activation_checkpointing_enable({"use_reentrant": False})

    def _maybe_checkpoint(self, fn, *args):
        if self.gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    # ------------------------------------------------------------------------------------------ inputs
    def _prepare(self, batch: dict, with_actions: bool) -> dict:
        """Scale uint8 images, normalize, zero-pad to max dims, take the prompt's token ids (the batch's, else
        tokenized here with the binned state for pi05); floats stay fp32.

        The batch's raw floats arrive as the data pipeline made them: everything here computes in fp32, outside any
        autocast, whatever the weights' dtype (docs/ARCHITECTURE.md, "Precision")."""
        device = self.action_out_proj.weight.device
        with torch.autocast(device.type, enabled=False):
            return self._prepare_fp32(batch, with_actions, device)

    def _prepare_fp32(self, batch: dict, with_actions: bool, device) -> dict:
        state = batch["state"].to(device=device, dtype=torch.float32)
        batch_size, state_dim = state.shape
        if state_dim > self.cfg.max_state_dim:
            raise UserError(f"The batch state has {state_dim} dims but policy.max_state_dim={self.cfg.max_state_dim}.")
        # Training batches arrive tokenized by the data workers with this policy's statistics; other batches (eval,
        # serve, hand-built) are tokenized here by the same rule, which reads the state back to the host.
        tokens = batch if "input_ids" in batch else self.prompt_tokenizer().batch_tokens(batch)
        state = normalize(state, self._stats("state"), self.norm_mode)
        images = to_unit_float(batch["images"].to(device))  # uint8 travels; scaled here, on the device
        out = {
            "images": images * 2 - 1,  # [0, 1] -> SigLIP's [-1, 1]
            "image_masks": batch["image_masks"].to(device=device, dtype=torch.bool),
            "state": F.pad(state, (0, self.cfg.max_state_dim - state_dim)),
            "input_ids": tokens["input_ids"].to(device=device, dtype=torch.int64),
            "text_valid": tokens["text_valid"].to(device=device, dtype=torch.bool),
            "batch_size": batch_size,
        }
        if with_actions:
            actions = batch["actions"].to(device=device, dtype=torch.float32)
            action_dim = actions.shape[-1]
            if action_dim > self.cfg.max_action_dim:
                raise UserError(f"The batch actions have {action_dim} dims but policy.max_action_dim={self.cfg.max_action_dim}.")
            if actions.shape[1] != self.cfg.chunk_size:
                raise UserError(f"The batch has action chunks of {actions.shape[1]} steps but policy.chunk_size={self.cfg.chunk_size}.")
            actions = normalize(actions, self._stats("action"), self.norm_mode)
            out["actions"] = F.pad(actions, (0, self.cfg.max_action_dim - action_dim))
            out["action_valid"] = ~batch["action_is_pad"].to(device=device, dtype=torch.bool)
            out["action_dim"] = action_dim
            # (batch, max_action_dim): the dims the loss reads, each sample's real ones (zero padding is not trained).
            widths = real_widths(batch, "action_dim", action_dim, device)
            out["action_dim_valid"] = torch.arange(self.cfg.max_action_dim, device=device)[None] < widths[:, None]
        return out

    def _vision_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """SigLIP on (n, 3, H, W) pixels in [-1, 1]; the patch and position embeddings in fp32.

        SigLIP's own forward, with its embedding step written out so that it stays fp32 under autocast.
        """
        vision = self.vlm.vision_tower
        embeddings = vision.embeddings
        patches = embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        with no_autocast(patches):
            hidden = patches + embeddings.position_embedding(embeddings.position_ids).float()
        hidden = vision.encoder(inputs_embeds=hidden.to(self.compute_dtype)).last_hidden_state
        return vision.post_layernorm(hidden)

    def _embed_prefix(self, inputs: dict, action_tokens: torch.Tensor | None):
        """Image tokens + prompt tokens (+ shifted action tokens for the CE loss) and their masks/positions."""
        images = inputs["images"]
        batch_size, num_cameras = images.shape[:2]
        vision_trains = any(p.requires_grad for p in self.vlm.vision_tower.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and vision_trains):
            features = self._vision_features(images.flatten(0, 1))
        image_embeds = self.vlm.multi_modal_projector(features)
        tokens_per_image = image_embeds.shape[1]
        image_embeds = image_embeds.reshape(batch_size, num_cameras * tokens_per_image, -1)
        image_valid = inputs["image_masks"].repeat_interleave(tokens_per_image, dim=1)

        parts, valid = [image_embeds, self.language_model.embed_tokens(inputs["input_ids"]).to(image_embeds.dtype)], [image_valid, inputs["text_valid"]]
        context_length = image_embeds.shape[1] + inputs["input_ids"].shape[1]
        # Block ids: the context is one bidirectional block, each action token its own block (causal among them).
        blocks = [torch.zeros(batch_size, context_length, dtype=torch.long, device=images.device)]
        if action_tokens is not None:
            start = torch.full_like(action_tokens[:, :1], self.tokenizer.start_id)
            shifted = torch.cat([start, action_tokens[:, :-1]], dim=1)
            parts.append(self.language_model.embed_tokens(shifted).to(image_embeds.dtype))
            valid.append(torch.ones_like(shifted, dtype=torch.bool))
            blocks.append(torch.arange(1, shifted.shape[1] + 1, device=images.device).expand(batch_size, -1))
        embeds, valid, blocks = torch.cat(parts, 1), torch.cat(valid, 1), torch.cat(blocks, 1)
        mask = (blocks[:, None, :] <= blocks[:, :, None]) & valid[:, None, :]
        # Every query sees at least itself, so padded rows stay finite (a fully masked row would give NaN).
        mask = mask | torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
        positions = (valid.cumsum(-1) - 1).clamp_min(0)
        context_valid = valid[:, :context_length]
        expert_keys = F.pad(context_valid, (0, valid.shape[1] - context_length))  # the expert never sees action tokens
        return embeds, mask, positions, expert_keys, context_length

    def _embed_suffix(self, state, noisy_actions, time):
        """Expert input tokens (in the compute dtype), the adaRMS conditioning (fp32; None for pi0), block ids."""
        if self.cfg.type == "pi05":
            tokens, cond = self.embed_suffix(noisy_actions, time)
            blocks = torch.zeros(tokens.shape[1], dtype=torch.long, device=tokens.device)
        else:
            tokens, cond = self.embed_suffix(state, noisy_actions, time), None
            # pi0: the state token sees only itself; the action tokens see the state and each other.
            blocks = torch.ones(tokens.shape[1], dtype=torch.long, device=tokens.device)
            blocks[0] = 0
        return tokens.to(self.compute_dtype), cond, blocks

    # ------------------------------------------------------------------------------------------ layers
    def _prefix_layer(self, index, hidden, cos, sin, mask, need_output: bool):
        layer = self.language_model.layers[index]
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        k, v = _heads(attn.k_proj(x), self.head_dim), _heads(attn.v_proj(x), self.head_dim)
        if not need_output:  # last layer without the CE loss: only its keys/values are read
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            return hidden, k, v
        q = _heads(attn.q_proj(x), self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        hidden = hidden + attn.o_proj(_attend(q, k, v, mask))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, k, v

    def _expert_layer(self, index, hidden, cond, prefix_k, prefix_v, cos, sin, mask):
        layer = self.expert.layers[index]
        attn = layer.self_attn
        if self.cfg.knowledge_insulation:
            prefix_k, prefix_v = prefix_k.detach(), prefix_v.detach()
        x, gate = _norm(layer.input_layernorm, hidden, cond)
        q, k, v = (_heads(p(x), self.head_dim) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = torch.cat([prefix_k.to(k.dtype), k], dim=2), torch.cat([prefix_v.to(v.dtype), v], dim=2)
        hidden = _gated(hidden, attn.o_proj(_attend(q, k, v, mask)), gate)
        x, gate = _norm(layer.post_attention_layernorm, hidden, cond)
        return _gated(hidden, layer.mlp(x), gate)

    def _run_prefix(self, embeds, mask, positions, need_output: bool):
        """Prefix through the VLM; returns each layer's (k, v) and the final normed hidden states (or None)."""
        cos, sin = self.language_model.rotary_emb(embeds, positions)
        hidden, cache = embeds, []
        layers = len(self.language_model.layers)
        for i in range(layers):
            hidden, k, v = self._maybe_checkpoint(self._prefix_layer, i, hidden, cos, sin, mask, need_output or i < layers - 1)
            cache.append((k, v))
        return cache, (self.language_model.norm(hidden) if need_output else None)

    def _run_expert(self, tokens, cond, blocks, cache, expert_keys, context_positions_end):
        batch_size, length = tokens.shape[:2]
        positions = context_positions_end[:, None] + torch.arange(length, device=tokens.device)[None]
        cos, sin = self.language_model.rotary_emb(tokens, positions)
        own = (blocks[None, :] <= blocks[:, None]).expand(batch_size, -1, -1)
        mask = torch.cat([expert_keys[:, None, :].expand(-1, length, -1), own], dim=-1)
        hidden = tokens
        for i, (k, v) in enumerate(cache):
            hidden = self._maybe_checkpoint(self._expert_layer, i, hidden, cond, k, v, cos, sin, mask)
        hidden, _ = _norm(self.expert.norm, hidden, cond)
        return self.action_out_proj(hidden[:, -self.cfg.chunk_size :])

    # ------------------------------------------------------------------------------------------ API
    def forward(self, batch: dict, noise: torch.Tensor | None = None, time: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Flow-matching loss (and the optional discrete-action CE loss) on one batch."""
        return self.loss(self._prepare(batch, with_actions=True), noise, time)

    def loss(self, inputs: dict, noise: torch.Tensor | None = None, time: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The losses on prepared inputs (`_prepare`): everything after tokenization, so that the memory plan can run
        it on fake tensors of the configured shapes (opentau_cli/plan/memory.py)."""
        actions = inputs["actions"]
        batch_size = inputs["batch_size"]
        if time is None:
            time = sample_time(batch_size, actions.device)
        if noise is None:
            noise = torch.randn_like(actions)
        noisy, target = flow_matching_pair(actions, noise.to(actions.device), time.to(actions.device))

        use_ce = self.cfg.discrete_action_loss
        action_tokens = target_bins = None
        if use_ce:
            real = actions[..., : inputs["action_dim"]]
            target_bins = discretize(real, self.cfg.discrete_action_bins, DISCRETE_RANGE[self.norm_mode]).flatten(1)  # step-major
            action_tokens = action_token_id(self.vocab_size, target_bins)
        vlm_trains = any(p.requires_grad for p in self.vlm.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and vlm_trains):
            embeds, mask, positions, expert_keys, context_length = self._embed_prefix(inputs, action_tokens)
            cache, prefix_out = self._run_prefix(embeds, mask, positions, need_output=use_ce)
        context_end = positions[:, context_length - 1] + 1
        tokens, cond, blocks = self._embed_suffix(inputs["state"], noisy, time)
        velocity = self._run_expert(tokens, cond, blocks, cache, expert_keys, context_end)

        weight = (inputs["action_valid"][:, :, None] & inputs["action_dim_valid"][:, None, :]).float()
        mse = ((velocity - target) ** 2 * weight).sum() / weight.sum().clamp_min(1)
        weights = self.cfg.loss_weighting  # every term present: config/model.py fills the defaults
        out = {"mse_loss": mse}
        loss = weights["mse"] * mse
        if use_ce:
            bins = self.cfg.discrete_action_bins
            # Logits over the action-bin rows of the (tied) embedding only: the full 257k vocabulary would not fit.
            head = self.language_model.embed_tokens.weight[self.vocab_size - bins :]
            logits = F.linear(prefix_out[:, context_length:], head).float()  # row r = token vocab-bins+r = bin bins-1-r
            target_rows = bins - 1 - target_bins
            token_valid = (inputs["action_valid"][:, :, None] & inputs["action_dim_valid"][:, None, : inputs["action_dim"]]).flatten(1)
            ce = F.cross_entropy(logits.flatten(0, 1), target_rows.flatten(), reduction="none")
            ce = (ce * token_valid.flatten()).sum() / token_valid.sum().clamp_min(1)
            out["ce_loss"] = ce
            loss = loss + weights["ce"] * ce
        out["loss"] = loss
        return out

    def _velocity(self, state, x, time, cache, expert_keys, context_end):
        """The action expert's velocity at flow time `time`: the body of sampling's loop (compile_sampling)."""
        tokens, cond, blocks = self._embed_suffix(state, x, time)
        return self._run_expert(tokens, cond, blocks, cache, expert_keys, context_end)

    def compile_sampling(self, mode: str | None = None) -> None:
        """torch.compile the body of sampling's loop, which runs num_inference_steps times per chunk on the same
        shapes (the prefix runs once). The first chunk after this compiles (tens of seconds); later ones reuse it."""
        self._velocity = torch.compile(self._velocity, mode=mode, dynamic=False)

    @torch.no_grad()
    def sample_actions(self, batch: dict, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Integrate the flow from noise (t=1) to actions (t=0) in num_inference_steps Euler steps; un-normalized."""
        inputs = self._prepare(batch, with_actions=False)
        batch_size, device = inputs["batch_size"], inputs["images"].device
        embeds, mask, positions, expert_keys, context_length = self._embed_prefix(inputs, None)
        cache, _ = self._run_prefix(embeds, mask, positions, need_output=False)
        context_end = positions[:, context_length - 1] + 1
        if noise is None:
            noise = torch.randn(batch_size, self.cfg.chunk_size, self.cfg.max_action_dim, device=device)
        x = noise.to(device, torch.float32)
        dt = torch.tensor(-1.0 / self.cfg.num_inference_steps, device=device)
        time = torch.ones((), device=device)  # accumulated in fp32 step by step, as openpi does
        for _ in range(self.cfg.num_inference_steps):
            x = x + dt * self._velocity(inputs["state"], x, time.expand(batch_size), cache, expert_keys, context_end)
            time = time + dt
        action_dim = int(self.action_dim.item())
        return unnormalize(x[:, : self.cfg.n_action_steps, :action_dim], self._stats("action"), self.norm_mode)
