"""The policy builds inside DeepSpeed's zero.Init (how TRAIN builds it for ZeRO-3) with correct initial values, and trains
a step with every parameter released between uses (the discrete-action loss reads the tied embedding's rows outside
the embedding's own forward: DeepSpeed gathers them as an external parameter)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.full, pytest.mark.slow]  # a minute or more: starts first (tests/conftest.py)

SCRIPT = r"""
import json
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1)
import deepspeed
from opentau_cli.config.model import PolicyConfig
from opentau_cli.policies import build_policy

cfg = PolicyConfig(preset="pi05_tiny", chunk_size=10, n_action_steps=10, max_state_dim=8, max_action_dim=8,
                   image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False,
                   discrete_action_loss=True)
stats = {"state": {"mean": [0.5] * 4, "std": [2.0] * 4, "q01": [-1.0] * 4, "q99": [2.0] * 4},
         "action": {"mean": [0.1] * 2, "std": [3.0] * 2, "q01": [-3.0] * 2, "q99": [3.0] * 2}}
# persistence threshold 0: no parameter stays gathered for being small, as pi05's embedding would not
ds_config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}}
with deepspeed.zero.Init(config_dict_or_path=ds_config):
    policy = build_policy(cfg, stats)
params = dict(policy.named_parameters())
gate = params["expert.layers.0.input_layernorm.bias"]
embed = params["vlm.language_model.embed_tokens.weight"]
with deepspeed.zero.GatheredParameters([gate, embed]):
    out = {
        "partitioned": all(hasattr(p, "ds_id") for p in params.values()),
        "numel": sum(p.ds_numel for p in params.values()),
        "gate_tail": gate[-64:].float().mean().item(),   # adaRMS gate starts at 1
        "embed_std": embed.float().std().item(),           # transformers' gathered init (0.02), not garbage
    }
out["rope_dtype"] = str(policy.vlm.language_model.rotary_emb.inv_freq.dtype)
out["stats_dtype"] = str(policy.action_q99.dtype)
out["action_std"] = policy.action_std[:2].tolist()
out["action_q99"] = policy.action_q99[:2].tolist()
# torch's AdamW handed to DeepSpeed, as the trainer does (DeepSpeed's own would compile its fused_adam op first).
optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, config=ds_config)
# DeepSpeed bf16 casts every weight to bf16; openpi's fp32 set still computes in fp32 (from the bf16-stored weights).
dtypes = {}
def note_dtype(name):
    def hook(module, args, output):
        dtypes.setdefault(name, str((output[0] if isinstance(output, tuple) else output).dtype))
    return hook
for name, module in {"time_mlp_out": policy.embed_suffix.time_mlp_out, "final_norm": policy.expert.norm,
                     "patch_embedding": policy.vlm.vision_tower.embeddings.patch_embedding, "expert_mlp": policy.expert.layers[0].mlp}.items():
    module.register_forward_hook(note_dtype(name))
batch = dict(images=torch.rand(4, 1, 3, 32, 32), image_masks=torch.ones(4, 1, dtype=torch.bool), state=torch.randn(4, 4),
             actions=torch.randn(4, 10, 2), action_is_pad=torch.zeros(4, 10, dtype=torch.bool), task=["reach"] * 4)
losses = engine(batch)
loss = losses["loss"]
out["ce_loss"] = losses["ce_loss"].item()
engine.backward(loss)
engine.step()
out["loss"] = loss.item()
out["output_dtypes"] = dtypes
out["weight_dtype"] = str(policy.action_out_proj.weight.dtype)
out["sample_shape"] = list(engine.module.sample_actions(batch).shape)
print("RESULT" + json.dumps(out), flush=True)
from opentau_cli.process.runtime import exit_rank

exit_rank(0)  # as opentau's workers leave: native teardown can abort after the work is done
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pi05_builds_inside_zero_init_with_its_initial_values_and_trains_a_step(tmp_path):
    from opentau_cli.config.model import PolicyConfig
    from opentau_cli.policies import count_parameters

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT"):])
    expected = count_parameters(PolicyConfig(preset="pi05_tiny", chunk_size=10, n_action_steps=10, max_state_dim=8, max_action_dim=8,
                                             image_resolution=(32, 32), tokenizer_max_length=48))["total"]
    assert out["partitioned"] and out["numel"] == expected
    assert out["gate_tail"] == 1.0
    assert 0.015 < out["embed_std"] < 0.025
    assert out["rope_dtype"] == "torch.float32" and out["stats_dtype"] == "torch.float32"
    assert out["action_std"] == [3.0, 3.0] and out["action_q99"] == [3.0, 3.0]
    assert out["loss"] == out["loss"] and out["sample_shape"] == [4, 10, 2]  # finite loss (not NaN), real action dims
    assert 0 < out["ce_loss"] < out["loss"]  # the discrete-action term ran on the gathered embedding rows
    assert out["weight_dtype"] == "torch.bfloat16"
    assert out["output_dtypes"] == {"patch_embedding": "torch.float32", "time_mlp_out": "torch.float32",
                                    "final_norm": "torch.bfloat16", "expert_mlp": "torch.bfloat16"}
