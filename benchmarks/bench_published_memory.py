"""The memory plan beside every published pi05 GPU training-memory figure we know (docs/PUBLISHED_MEMORY.md).

For each figure: the run configured as closely as our pi05 allows (a real `opentau config validate` invocation, the
example config changed to the published settings, `--gpus N --gpu-memory <card>`), the plan it prints, and the
difference split into named parts: what the published model holds that ours does not (computed here, each from its
sizes), what the published figure counts that the plan does not or the other way round (the measure), and the rest,
unexplained. Prints the table docs/PUBLISHED_MEMORY.md holds; tests/test_published_memory.py ties its "our plan"
column to what `config validate` prints and checks that every row adds up.

    python benchmarks/bench_published_memory.py             # the table (a few minutes: one fake-tensor step per shape)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO  # noqa: E402

GIB = 2**30
GB = 10**9
# The published model's sizes (pi05 as the upstream tool, openpi and LeRobot build it; ours has the same 3.35B).
VOCAB, WIDTH = 257_152, 2048  # PaliGemma's vocabulary and width: the response head's logits, the lm_head weight
FAST_VOCAB = 2048  # the FAST tokenizer's vocabulary: the upstream tool's discrete-action head
TOTAL, TRAINABLE = 3_353_433_872, 3_244_377_872  # our pi05, full fine-tune (config validate prints both)
LAST_LAYER = TOTAL - TRAINABLE  # the last VLM layer's q/o/MLP and final norm: ours computes and trains none of them
EMBEDDING = VOCAB * WIDTH  # looked up, not multiplied: autocast keeps no bf16 copy of it
# Activations one Gemma-2B decoder layer keeps for the backward per sample (bf16, sdpa), measured on fake tensors with
# the memory plan's own tracker (LiveBytes) over a transformers GemmaDecoderLayer: `last_layer_per_sample`.


def last_layer_per_sample(tokens: int) -> int:
    """Bytes one Gemma-2B decoder layer (pi05's VLM) keeps for the backward per sample over `tokens` tokens."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding

    from opentau_cli.plan.measure import LiveBytes

    cfg = GemmaConfig(hidden_size=WIDTH, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1,
                      head_dim=256, num_hidden_layers=1, vocab_size=8)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        layer = GemmaDecoderLayer(cfg, 0).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer.to_empty(device="cpu")
        x = torch.zeros(1, tokens, WIDTH, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(tokens)[None]
        tracker = LiveBytes()
        with tracker:
            out = layer(x, position_embeddings=GemmaRotaryEmbedding(cfg)(x, positions), attention_mask=None,
                        position_ids=positions)
        kept = tracker.current  # what the backward needs, and the output
        del out
        return kept


def ce_logits(batch: int, positions: int, vocab: int) -> int:
    """A cross-entropy head's logits as the backward starts: the fp32 log-softmax output kept by the forward, its
    gradient and the logits' gradient, 12 bytes per logit."""
    return 12 * batch * positions * vocab


def eager_attention(batch: int, tokens: int, layers: int = 18, heads: int = 8, head_dim: int = 256) -> int:
    """What the upstream tool's eager joint attention (paligemma_with_expert.eager_attention_forward) keeps for the
    backward beyond a fused kernel's output, per layer: the fp32 softmax output and its bf16 copy (6 bytes per
    probability) and the fp32 copies of the queries and of the keys expanded to every head."""
    return batch * layers * (6 * heads * tokens**2 + 2 * 4 * tokens * heads * head_dim)


def bf16_activations(run: list[str], n: int) -> int:
    """How much less the step keeps when the weights are bf16 (no autocast) instead of fp32 under bf16 autocast: our
    own policy measured both ways by the memory plan's fake-tensor step (plan/memory.py step_bytes). Under autocast the
    residual stream stays fp32 and the bf16 copies of the weights are kept for the backward."""
    from opentau_cli.config import load_config
    from opentau_cli.plan.memory import step_bytes

    overrides = [a for a in run[6:]]  # after --accelerate-config Y --gpus N --gpu-memory C
    cfg = load_config(REPO / "configs/examples/pi05_config.json",
                      ["--policy.pretrained_path=null", "--policy.tokenizer_path=null", *overrides], environ={})
    autocast = step_bytes(cfg.policy, n, cfg.dataset.num_cameras, "float32", True)
    bf16 = step_bytes(cfg.policy, n, cfg.dataset.num_cameras, "bfloat16", False)
    return max(bf16.forward, bf16.backward) - max(autocast.forward, autocast.backward)


@dataclass
class Row:
    key: str  # the row's id in the doc (its run is listed under the same id)
    figure: str  # the published figure as published
    source: str
    run: list[str]  # `opentau config validate configs/examples/pi05_config.json` arguments
    published: float | None = None  # GiB, where the figure is a peak; else the claim below
    claim: str = "peak"  # "peak", "fits" (the card holds the run), "oom", "above" (needs more than `published`)
    allocator: float = 0.10  # the plan's allocator allowance for this backend (plan/memory.py)
    parts: object = None  # () -> [(part, GiB)]: what the published model holds that ours does not (computed on demand)
    measure: list[tuple[str, float]] = field(default_factory=list)  # (part, GiB): what the published reading counts beyond ours

    @property
    def model(self) -> list[tuple[str, float]]:
        if not hasattr(self, "_model"):
            self._model = self.parts() if self.parts else []
        return self._model


def command(row: Row) -> list[str]:
    return ["config", "validate", "configs/examples/pi05_config.json", "--policy.pretrained_path=null",
            "--policy.tokenizer_path=null", *row.run]


def plan_figure(output: str) -> tuple[float, bool]:
    """(the plan's peak per GPU in GiB, whether it fits the card) from `config validate`'s output."""
    fits = re.search(r"memory plan\s+([\d.]+) GiB peak per GPU", output)
    refused = re.search(r"The run needs about ([\d.]+) GiB per GPU", output)
    if not (fits or refused):
        raise SystemExit(f"config validate printed no memory plan:\n{output[-2000:]}")
    return float((fits or refused).group(1)), bool(fits)


def batch(n: int) -> list[str]:
    return [f"--batch_size={n}", f"--per_device_batch_size={n}", "--gradient_accumulation_steps=1"]


FULL = ["--policy.freeze_vision_encoder=false", "--policy.train_expert_only=false", "--ema.decay=0"]
# The upstream guide's run: 2 cameras, chunk 10, a 926-token prefix (512 image tokens, a 256-token prompt, 3 + 52
# response tokens, 3 + 100 discrete-action tokens): our prompt of 414 tokens gives the same prefix.
GUIDE = [*FULL, "--dataset.num_cameras=2", "--policy.chunk_size=10", "--policy.n_action_steps=10",
         "--policy.tokenizer_max_length=414"]
GUIDE_PREFIX = 512 + 414
# Issue #177's run (reproduce_pi05_libero.json then): 256-token prompt, 3 + 60 discrete-action tokens, no response.
ISSUE = [*FULL, "--dataset.num_cameras=2", "--policy.chunk_size=10", "--policy.n_action_steps=10",
         "--policy.tokenizer_max_length=319"]
ISSUE_PREFIX = 512 + 319
ZERO2, ZERO3, DDP = ("configs/examples/accelerate_deepspeed_config.yaml", "configs/examples/accelerate_deepspeed_zero3_config.yaml",
                     "configs/examples/accelerate_ddp_config.yaml")
DDP4, ZERO2_4, SINGLE = ("docs/published_memory/accelerate_ddp_4gpu.yaml", "docs/published_memory/accelerate_deepspeed_4gpu.yaml",
                         "docs/published_memory/accelerate_single_gpu.yaml")


def gib(n: float) -> float:
    return n / GIB


def guide_model(n: int, world: int) -> list[tuple[str, float]]:
    """What the upstream guide's pi05 (predict_response, discrete actions) holds beyond ours at `n` per device."""
    return [("response head: logits over 257,152 tokens for 51 positions, fp32 cross-entropy", gib(ce_logits(n, 51, VOCAB))),
            ("its lm_head gradient (the 257,152 x 2,048 embedding, bf16) as the backward starts", gib(2 * EMBEDDING)),
            ("the last VLM layer, computed for the heads (ours skips it: nothing reads it)",
             gib(n * last_layer_per_sample(GUIDE_PREFIX) + 12 * LAST_LAYER // world)),
            ("discrete-action head: logits over 2,048 FAST tokens for 100 positions", gib(ce_logits(n, 100, FAST_VOCAB)))]


def issue_model(n: int, world: int, regime: str, run: list[str]) -> list[tuple[str, float]]:
    """What issue #177's pi05 (eager attention, bf16 weights and moments outside DeepSpeed, discrete actions) holds
    beyond ours at `n` per device."""
    parts = [("eager attention: fp32 probabilities, their bf16 copy and fp32 queries / keys kept for the backward",
              gib(eager_attention(n, ISSUE_PREFIX + 10))),
             ("the last VLM layer, computed for the discrete head (ours skips it)",
              gib(n * last_layer_per_sample(ISSUE_PREFIX) + 12 * LAST_LAYER // world)),
             ("discrete-action head: logits over 2,048 FAST tokens for 60 positions", gib(ce_logits(n, 60, FAST_VOCAB)))]
    if regime == "ddp":  # bf16 weights, bf16 gradients beside DDP's bf16 buckets, bf16 AdamW moments: 10 B vs our 16
        parts.append(("bf16 weights, gradients, DDP buckets and AdamW moments: 10 B per parameter against our 16 B",
                      -gib(2 * TOTAL + 4 * TRAINABLE)))
    if regime == "single":  # bf16 weights, gradients and moments: 8 B per parameter
        parts.append(("bf16 weights, gradients and AdamW moments: 8 B per parameter against our 16 B",
                      -gib(2 * TOTAL + 6 * TRAINABLE)))
    if regime in ("ddp", "single"):
        parts.append(("bf16 weights instead of fp32 under autocast: the step keeps less (measured)", gib(bf16_activations(run, n))))
    return parts


TORCH_RESERVED = [("CUDA context and NCCL buffers, which torch's reserved counter leaves out", -1.3)]
TORCH_RESERVED_1 = [("CUDA context, which torch's reserved counter leaves out", -0.8)]
XLA = [("JAX/XLA plans its buffers ahead: none of the caching allocator's fragmentation", None)]


def card_run(yaml: str, gpus: int, card: str, *overrides: str) -> list[str]:
    return ["--accelerate-config", yaml, "--gpus", str(gpus), "--gpu-memory", card, *overrides]


def rows() -> list[Row]:
    """Every published pi05 training memory figure we know, each with the run closest to it."""
    guide, issue4, issue8 = "guide", "#177, 4 GPUs", "#177, 8 GPUs"
    table = []

    def guide_row(key, figure, yaml, n, published=None, claim="peak", allocator=0.10, measure=()):
        run = card_run(yaml, 8, "80GB", *GUIDE, *batch(n))
        table.append(Row(key, figure, guide, run, published, claim, allocator, parts=lambda: guide_model(n, 8),
                         measure=[*TORCH_RESERVED, *measure] if claim == "peak" else []))

    # The same 8 more samples per GPU raise ZeRO-2's published peak by 78.7 - 53.3 GiB and ZeRO-3's by only
    # 79.2 - 62.8: at 8 per GPU ZeRO-3's reading held at least the difference in cache it gave back at 16.
    cache = [("cache ZeRO-3's allocator held at 8 per GPU and gave back at 16 (its published rise from 8 to 16 per "
              "GPU is this much below ZeRO-2's for the same samples)", round((78.7 - 53.3) - (79.2 - 62.8), 1))]

    def issue_row(key, figure, source, yaml, gpus, n, published, regime):
        run = card_run(yaml, gpus, "80GB", *ISSUE, *batch(n))
        table.append(Row(key, figure, source, run, published, parts=lambda: issue_model(n, gpus, regime, run),
                         measure=TORCH_RESERVED if gpus > 1 else TORCH_RESERVED_1))

    guide_row("G1", "ZeRO-2, 8 per GPU: 53.3 GiB", ZERO2, 8, 53.3)
    guide_row("G2", "ZeRO-2, 16 per GPU: 78.7 GiB", ZERO2, 16, 78.7)
    guide_row("G3", "ZeRO-3, 8 per GPU: 62.8 GiB", ZERO3, 8, 62.8, allocator=0.20, measure=cache)
    guide_row("G4", "ZeRO-3, 16 per GPU: 79.2 GiB", ZERO3, 16, 79.2, allocator=0.20)
    guide_row("G5", "ZeRO-2, 18 per GPU: out of memory", ZERO2, 18, claim="oom")
    guide_row("G6", "ZeRO-3, 18 per GPU: out of memory", ZERO3, 18, claim="oom", allocator=0.20)
    issue_row("I1", "DDP, 6 per GPU: 78.45 GiB", issue4, DDP4, 4, 6, 78.45, "ddp")
    issue_row("I2", "ZeRO-2, 14 per GPU: 78.75 GiB", issue4, ZERO2_4, 4, 14, 78.75, "zero")
    issue_row("I3", "ZeRO-2, 14 per GPU: 79.7 GB", issue8, ZERO2, 8, 14, round(79.7 * GB / GIB, 2), "zero")
    issue_row("I4", "DDP, 12 per GPU (expert lm_head dropped, fused AdamW): 79.2 GB", issue8, DDP, 8, 12,
              round(79.2 * GB / GIB, 2), "ddp")
    issue_row("I5", "one GPU, 13 per GPU: 78.2 GB", issue8, SINGLE, 1, 13, round(78.2 * GB / GIB, 2), "single")
    table.append(Row("O1", "full fine-tune: more than 70 GB (A100 80GB / H100)",
                     "openpi",
                     card_run(SINGLE, 1, "80GB", "--policy.freeze_vision_encoder=false", "--policy.gradient_checkpointing=true",
                              "--ema.decay=0.99", *batch(32)), round(70 * GB / GIB, 2), "above"))
    lora = card_run(SINGLE, 1, "24GB", "--policy.lora.rank=16", "--policy.gradient_checkpointing=true", "--ema.decay=0", *batch(32))
    table.append(Row("O2", "LoRA: more than 22.5 GB (RTX 4090 24 GB)", "openpi", lora, round(22.5 * GB / GIB, 2), "above",
                     parts=lambda: [("frozen weights held in bf16: 2 B per parameter against our 4 B", -gib(2 * TOTAL)),
                                    ("bf16 weights instead of fp32 under autocast: the step keeps less (measured)",
                                     gib(bf16_activations(lora, 32)))]))
    lerobot = card_run(SINGLE, 1, "80GB", *FULL, "--policy.gradient_checkpointing=true", *batch(64))
    table.append(Row("L1", "full fine-tune, batch 64: sized for a single 80 GB GPU",
                     "LeRobot", lerobot,
                     claim="fits",
                     parts=lambda: [("bf16 weights, gradients and AdamW moments: 8 B per parameter against our 16 B",
                                     -gib(2 * TOTAL + 6 * TRAINABLE)),
                                    ("bf16 weights instead of fp32 under autocast: the step keeps less (measured)",
                                     gib(bf16_activations(lerobot, 64)))]))
    return table


@dataclass
class Result:
    row: Row
    plan: float  # GiB, as config validate prints it
    fits: bool  # the plan fits the card

    @property
    def model(self) -> float:
        """The model differences with the plan's allocator allowance on them (they are allocated bytes)."""
        return sum(part for _, part in self.row.model) * (1 + self.row.allocator)

    @property
    def measure(self) -> float:
        if self.row.key == "O1":  # XLA: no caching allocator
            return -self.fragmentation
        return sum(part for _, part in self.row.measure)

    @property
    def fragmentation(self) -> float:
        """GiB: the plan's allocator allowance, from its figure (a refused run prints no parts)."""
        context = 0.8 + (0.5 if self.row.run[3] != "1" else 0.0)
        return (self.plan - context) / (1 + self.row.allocator) * self.row.allocator

    @property
    def explained(self) -> float:
        """The plan with the published model's extra and the published reading's differences: the plan's figure for
        the published run."""
        return self.plan + self.model + self.measure

    @property
    def rest(self) -> float | None:
        return self.row.published - self.explained if self.row.claim == "peak" else None


def validate(row: Row) -> Result:
    """Run `opentau config validate` for the row, in this process (the step measurements share one cache)."""
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app

    result = CliRunner().invoke(app, command(row))
    output = result.output + (result.stderr if result.stderr_bytes is not None else "")
    plan, fits = plan_figure(output)
    return Result(row=row, plan=plan, fits=fits)


def verdict(r: Result) -> str:
    """The unexplained rest of a peak, or how a bound or a fit / out-of-memory claim compares."""
    card = 24.0 if "24GB" in r.row.run else 80.0
    if r.row.claim == "peak":
        return f"{r.rest:+.1f}"
    if r.row.claim == "oom":
        return ("agrees: the plan does not fit the card" if not r.fits and r.explained > card
                else f"DISAGREES: the plan fits ({r.explained:.1f} GiB)")
    if r.row.claim == "fits":
        return f"agrees: {r.explained:.1f} GiB fits" if r.explained <= card else f"DISAGREES: {r.explained:.1f} GiB"
    low = r.row.published
    return (f"agrees: {r.explained:.1f} GiB is above {low:.1f} and within the card" if low < r.explained <= card
            else f"{r.explained - low:+.1f} against the bound {low:.1f} GiB" if r.explained <= low
            else f"{r.explained - card:+.1f} over the {card:.0f} GiB card")


def table(results: list[Result]) -> str:
    lines = ["| | published figure (source) | our plan | model differences, GiB | measure, GiB | plan for the published run | unexplained rest, GiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        row = r.row
        model = "; ".join(f"{part:+.2f} {name}" for name, part in row.model) or "none"
        if row.model:
            model += f" (x{1 + row.allocator:.2f} with the plan's allocator allowance: {r.model:+.1f})"
        measure = ("; ".join(f"{part:+.1f} {name}" for name, part in row.measure) if row.key != "O1" else
                   f"{-r.fragmentation:+.1f} JAX/XLA plans its buffers ahead: none of the caching allocator's fragmentation") or "none"
        plan = f"{r.plan:.1f} GiB" + ("" if r.fits else " (refused)")
        lines.append(f"| {row.key} | {row.figure} ({row.source}) | {plan} | {model} | {measure} | {r.explained:.1f} GiB | {verdict(r)} |")
    return "\n".join(lines)


def runs(results: list[Result]) -> str:
    return "\n".join(f"- {r.row.key}: `opentau {' '.join(command(r.row))}`" for r in results)


def main() -> None:
    import argparse
    import os

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    os.chdir(REPO)
    results = [validate(row) for row in rows()]
    print(table(results))
    print()
    print(runs(results))


if __name__ == "__main__":
    main()
