"""FSDP settings opentau cannot honour are refused before launch, one line and exit 2 (docs/ARCHITECTURE.md,
"FSDP2"); an FSDP2 YAML with Accelerate's own keys passes and is described as what will run."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import EXAMPLES, REPO, refused, run_cli_in_process, tree

pytestmark = pytest.mark.full

TINY = str(EXAMPLES / "pi05_tiny_config.json")
CPU_FSDP2 = REPO / "configs" / "examples" / "accelerate_cpu_fsdp2_config.yaml"
GPU_FSDP2 = REPO / "configs" / "examples" / "accelerate_fsdp2_config.yaml"
BASE = "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n"


def _yaml(tmp_path: Path, fsdp: str) -> Path:
    path = tmp_path / "fsdp.yaml"
    path.write_text(BASE + "fsdp_config:\n" + "".join(f"  {line}\n" for line in fsdp.splitlines()))
    return path


def _validate(tmp_path: Path, yaml: Path, *extra: str, gpus: int | None = None):
    args = ["config", "validate", TINY, f"--accelerate-config={yaml}", f"--output_dir={tmp_path / 'run'}", *extra]
    return run_cli_in_process(args + ([f"--gpus={gpus}"] if gpus is not None else []))


@pytest.mark.parametrize("fsdp, needles", [
    ("fsdp_version: 1", ["FSDP1", "fsdp_version: 2"]),
    ("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", ["FSDP1", "Accelerate's default when absent"]),
    ("fsdp_version: 2\nfsdp_sharding_strategy: HYBRID_SHARD", ["HYBRID_SHARD", "no equivalent", "fsdp_reshard_after_forward"]),
    ("fsdp_version: 2\nfsdp_reshard_after_forward: NO_SHARD", ["NO_SHARD", "use DDP"]),
    ("fsdp_version: 2\nfsdp_auto_wrap_policy: SIZE_BASED_WRAP", ["SIZE_BASED_WRAP", "per transformer layer"]),
    ("fsdp_version: 2\nfsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer", ["LlamaDecoderLayer", "GemmaDecoderLayer"]),
    ("fsdp_version: 2\nfsdp_state_dict_type: FULL_STATE_DICT", ["FULL_STATE_DICT", "checkpoint consolidate"]),
    ("fsdp_version: 2\nfsdp_offload_params: true", ["fsdp_offload_params: true", "no CUDA GPU"]),
    ("fsdp_version: 2\nfsdp_activation_checkpointing: true", ["fsdp_activation_checkpointing: true",
                                                                "policy.gradient_checkpointing=false"]),
], ids=["fsdp1", "fsdp1_by_default", "hybrid_shard", "no_shard", "size_based_wrap", "unknown_layer_class",
        "full_state_dict", "offload_without_gpu", "activation_checkpointing_disagrees"])
def test_an_fsdp_setting_opentau_cannot_honour_is_refused_in_one_line_and_nothing_is_written(tmp_path, fsdp, needles):
    yaml = _yaml(tmp_path, fsdp)
    before = tree(tmp_path)
    refused(_validate(tmp_path, yaml), *needles)
    assert tree(tmp_path) == before


def test_fsdp_with_one_process_is_refused(tmp_path):
    yaml = tmp_path / "one.yaml"
    yaml.write_text("distributed_type: FSDP\nnum_processes: 1\nfsdp_config:\n  fsdp_version: 2\n")
    refused(_validate(tmp_path, yaml), "2 or more processes")


def test_ema_lora_and_asynchronous_saves_under_fsdp2_pass_validation(tmp_path):
    result = _validate(tmp_path, CPU_FSDP2, "--ema.decay=0.99", "--policy.lora.rank=4", "--checkpoint.async_save=true")
    assert result.returncode == 0, result.stderr


def test_the_shipped_fsdp2_configs_pass_validation_on_this_machine_and_on_eight_gpus(tmp_path):
    assert _validate(tmp_path, CPU_FSDP2).returncode == 0
    assert _validate(tmp_path, GPU_FSDP2, gpus=8).returncode == 0
    # Offloading parameters is honoured where there is a GPU to offload from.
    offload = _yaml(tmp_path, "fsdp_version: 2\nfsdp_offload_params: true\nfsdp_activation_checkpointing: false")
    assert _validate(tmp_path, offload, gpus=2).returncode == 0


def test_fsdp_description_names_the_backend_the_units_and_the_precision():
    from opentau_cli.config.accelerate import fsdp_lines, read_accelerate_config

    lines = fsdp_lines(read_accelerate_config(CPU_FSDP2))
    assert lines == [
        "Backend: FSDP2 (torch fully_shard) over 2 processes; checkpoints sharded with torch.distributed.checkpoint.",
        "Wrapping: each transformer layer (SiglipEncoderLayer, GemmaDecoderLayer) and the root; parameters resharded "
        "after forward.",
        "Precision: bf16 compute, fp32 gradient reduction, fp32 master parameters (MixedPrecisionPolicy).",
    ]


def test_an_fsdp1_strategy_name_maps_to_reshard_after_forward():
    from opentau_cli.config.accelerate import AccelerateSetup, reshard_after_forward

    assert reshard_after_forward(AccelerateSetup(backend="fsdp", fsdp_sharding_strategy="SHARD_GRAD_OP")) is False
    assert reshard_after_forward(AccelerateSetup(backend="fsdp", fsdp_reshard_after_forward="FULL_SHARD")) is True
    assert reshard_after_forward(AccelerateSetup(backend="fsdp", fsdp_reshard_after_forward="false")) is False
    assert reshard_after_forward(AccelerateSetup(backend="fsdp")) is True
    assert reshard_after_forward(AccelerateSetup(backend="fsdp", fsdp_sharding_strategy="3")) is None  # NO_SHARD
