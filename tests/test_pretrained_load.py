"""What a load of pretrained weights tells the user and refuses: the report (loaded, missing, unexpected, mis-shaped,
ignored), strict and non-strict loads, wrong policy types and presets, where the statistics come from, the ZeRO-3
load, and the report on the console and in the run's log of a real `opentau train`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import EXAMPLES, run_cli
from opentau_cli.config.model import PolicyConfig
from opentau_cli.errors import UserError
from opentau_cli.policies import build_policy, check_pretrained, load_pretrained
from opentau_cli.policies.layouts import LEROBOT, OPENPI, OPENTAU
from published import stats_of, write_header_only, write_published

pytestmark = pytest.mark.full

STATS = {
    "state": {"mean": [0.5, -1.0, 2.0, 0.0], "std": [2.0, 0.5, 1.0, 3.0], "q01": [-1.5, -2.0, 0.0, -6.0], "q99": [2.5, 0.0, 4.0, 6.0]},
    "action": {"mean": [1.0, 0.0, -2.0], "std": [0.5, 2.0, 1.0], "q01": [0.0, -4.0, -4.0], "q99": [2.0, 4.0, 0.0]},
}
DATASET_STATS = {f: {k: [v + 7.0 for v in vals] for k, vals in s.items()} for f, s in STATS.items()}


def tiny_cfg(**overrides) -> PolicyConfig:
    base = dict(preset="pi05_tiny", chunk_size=10, n_action_steps=8, max_state_dim=8, max_action_dim=8,
                image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False)
    return PolicyConfig(**{**base, **overrides})


def published(tmp_path: Path, layout: str = LEROBOT, *, policy_type: str = "pi05", seed: int = 0, stats=STATS) -> Path:
    torch.manual_seed(seed)
    return write_published(build_policy(tiny_cfg(type=policy_type), stats=stats), tmp_path / f"{layout}-{policy_type}", layout)


def edit_weights(directory: Path, edit) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def snapshot(policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.state_dict().items()}


LM_NORM = "model.paligemma_with_expert.paligemma.model.language_model.norm.weight"
OUT_BIAS = "model.action_out_proj.bias"


def broken_checkpoint(tmp_path: Path) -> Path:
    """A LeRobot checkpoint with one tensor dropped, one of its own added and one of another shape."""
    ckpt = published(tmp_path)

    def edit(t):
        del t[LM_NORM]
        t["model.old_value_head.weight"] = torch.zeros(2)
        t[OUT_BIAS] = torch.zeros(5)

    edit_weights(ckpt, edit)
    return ckpt


def test_strict_load_names_every_missing_unexpected_and_mis_shaped_tensor_in_one_line_and_loads_nothing(tmp_path):
    ckpt = broken_checkpoint(tmp_path)
    policy = build_policy(tiny_cfg())
    before = snapshot(policy)
    with pytest.raises(UserError) as err:
        load_pretrained(policy, ckpt)
    message = str(err.value)
    assert "\n" not in message
    assert "1 missing keys: vlm.language_model.norm.weight" in message
    assert "1 unexpected keys: model.old_value_head.weight" in message
    assert "1 shape-mismatched keys: action_out_proj.bias (checkpoint [5], policy [8])" in message
    assert "policy.pretrained_strict=false" in message
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())  # refused before loading anything
    with pytest.raises(UserError, match="1 missing keys"):
        check_pretrained(tiny_cfg(pretrained_path=ckpt))  # the same refusal from the headers alone


def test_non_strict_load_loads_what_matches_and_reports_the_rest(tmp_path):
    ckpt = broken_checkpoint(tmp_path)
    source = build_policy(tiny_cfg())  # not used for values: the file holds the values
    policy = build_policy(tiny_cfg())
    before = snapshot(policy)
    report = load_pretrained(policy, ckpt, strict=False)
    weights = load_file(str(ckpt / "model.safetensors"))

    assert report.missing == ["vlm.language_model.norm.weight"] and report.mismatched == ["action_out_proj.bias"]
    assert report.unexpected == ["model.old_value_head.weight"]
    params = {n for n, _ in source.named_parameters()}
    assert set(report.loaded) == params - {"vlm.language_model.norm.weight", "action_out_proj.bias"}
    state = policy.state_dict()
    for name, key in report.loaded.items():
        assert torch.equal(state[name], weights[key].to(state[name].dtype)), name
    assert torch.equal(state["vlm.language_model.norm.weight"], before["vlm.language_model.norm.weight"])
    assert torch.equal(state["action_out_proj.bias"], before["action_out_proj.bias"])

    summary, full = report.summary(), report.full()
    assert f"loaded {len(params) - 2} of {len(params)} tensors" in summary
    assert "layout: LeRobot pi05" in summary and "1 missing: vlm.language_model.norm.weight" in summary
    assert len(summary.splitlines()) < 15  # short lists on the console
    for name, key in report.loaded.items():  # every name in the run's log
        assert f"{name} <- {key}" in full


def test_short_lists_end_with_a_count_of_the_rest(tmp_path):
    ckpt = published(tmp_path)
    edit_weights(ckpt, lambda t: [t.pop(k) for k in [k for k in t if ".gemma_expert." in k]])
    report = load_pretrained(build_policy(tiny_cfg()), ckpt, strict=False)
    assert len(report.missing) > 20
    assert f"... ({len(report.missing) - 8} more)" in report.describe()
    assert all(k in report.full() for k in report.missing)


def test_a_pi0_checkpoint_is_refused_by_a_pi05_policy_even_when_not_strict(tmp_path):
    ckpt = published(tmp_path, policy_type="pi0")
    with pytest.raises(UserError, match=r"is a LeRobot pi0 checkpoint but policy.type=pi05: set --policy.type=pi0"):
        load_pretrained(build_policy(tiny_cfg()), ckpt, strict=False)
    with pytest.raises(UserError, match=r"is a LeRobot pi0 checkpoint but policy.type=pi05"):
        check_pretrained(tiny_cfg(pretrained_path=ckpt, pretrained_strict=False))


def test_a_checkpoint_of_another_preset_is_refused_naming_its_preset(tmp_path):
    with torch.device("meta"):
        small = build_policy(tiny_cfg(preset="pi05_small", image_resolution=(32, 32)))
    write_header_only(tmp_path / "model.safetensors", {k: tuple(v.shape) for k, v in small.state_dict().items()})
    with pytest.raises(UserError) as err:
        check_pretrained(tiny_cfg(pretrained_path=tmp_path))
    assert "\n" not in str(err.value)
    assert "It looks like a pi05_small checkpoint: set --policy.preset=pi05_small." in str(err.value)


def test_bad_sources_are_one_line_user_errors(tmp_path):
    policy = build_policy(tiny_cfg())
    (tmp_path / "empty").mkdir()
    save_file({"encoder.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    for source, expected in ((tmp_path / "nope.safetensors", "no such file or directory"),
                             (tmp_path / "empty", "holds neither model.safetensors nor model.safetensors.index.json"),
                             (tmp_path / "other.safetensors", "not a pi05 or pi0 checkpoint"),
                             (tmp_path / "garbage.safetensors", "not a readable safetensors file")):
        with pytest.raises(UserError, match=expected) as err:
            load_pretrained(policy, source)
        assert "\n" not in str(err.value)


def test_opentau_checkpoints_keep_embed_tokens_and_ignore_the_tied_lm_head_and_their_own_heads(tmp_path):
    ckpt = published(tmp_path, OPENTAU)
    report = load_pretrained(build_policy(tiny_cfg()), ckpt)
    assert report.loaded["vlm.language_model.embed_tokens.weight"].endswith("language_model.embed_tokens.weight")
    ignored = {reason.split(" (")[0]: keys for reason, keys in report.ignored.items()}
    assert ignored["tied copy of vlm.language_model.embed_tokens.weight"] == ["model.paligemma_with_expert.paligemma.lm_head.weight"]
    assert ignored["OpenTau's discrete-action head"] == ["model.paligemma_with_expert.discrete_action_embedding.weight"]
    statistics = build_policy(tiny_cfg(), stats=STATS)
    written = len(stats_of(statistics, "state")) + 2 * len(stats_of(statistics, "action"))  # actions: two modules
    assert len(ignored["normalization statistics"]) == written


# ------------------------------------------------------------------------------------------ statistics
@pytest.mark.parametrize("layout,where", [(LEROBOT, "policy_preprocessor_step_2_normalizer_processor.safetensors"),
                                          (OPENPI, "assets/my_robot/norm_stats.json"),
                                          (OPENTAU, "its normalize_* / unnormalize_* buffers")])
def test_statistics_come_from_the_checkpoint_when_it_has_them_and_the_report_says_where(tmp_path, layout, where):
    policy = build_policy(tiny_cfg(), stats=DATASET_STATS)
    report = load_pretrained(policy, published(tmp_path, layout), dataset_stats=DATASET_STATS)
    assert policy.state_q01[:4].tolist() == STATS["state"]["q01"] and policy.action_q99[:3].tolist() == STATS["action"]["q99"]
    assert report.stats_source == f"from the checkpoint ({where}): state mean/q01/q99/std, action mean/q01/q99/std"


def test_statistics_come_from_the_dataset_when_the_checkpoint_has_none(tmp_path):
    ckpt = published(tmp_path, LEROBOT)
    for name in ("policy_preprocessor.json", "policy_preprocessor_step_2_normalizer_processor.safetensors"):
        (ckpt / name).unlink()  # a base model: no robot's statistics
    policy = build_policy(tiny_cfg(), stats=DATASET_STATS)
    report = load_pretrained(policy, ckpt, dataset_stats=DATASET_STATS)
    assert policy.state_q01[:4].tolist() == DATASET_STATS["state"]["q01"]
    assert report.stats_source == "from the dataset (it has no LeRobot normalizer files: policy_preprocessor.json)"


def test_statistics_of_another_robot_are_refused_strict_and_replaced_by_the_dataset_s_otherwise(tmp_path):
    ckpt = published(tmp_path, OPENPI)
    wide = {**DATASET_STATS, "state": {k: v + [0.0] for k, v in DATASET_STATS["state"].items()}}  # one more state dim
    with pytest.raises(UserError, match=r"the checkpoint's state statistics \(assets/my_robot/norm_stats.json\) have 4 dims "
                                        r"but the dataset's state has 5: it was trained on another robot"):
        load_pretrained(build_policy(tiny_cfg(), stats=wide), ckpt, dataset_stats=wide)
    policy = build_policy(tiny_cfg(), stats=wide)
    report = load_pretrained(policy, ckpt, strict=False, dataset_stats=wide)
    assert policy.state_q01[:5].tolist() == wide["state"]["q01"] and "from the dataset: state (the checkpoint's state" in report.stats_source
    assert policy.action_q01[:3].tolist() == STATS["action"]["q01"]  # the action statistics fit: the checkpoint's


# ------------------------------------------------------------------------------------------ ZeRO-3
ZERO3_LOAD = r"""
import json, os, sys
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
import deepspeed
from safetensors.torch import load_file
from opentau_cli.config.model import PolicyConfig
from opentau_cli.policies import build_policy, load_pretrained
from opentau_cli.policies import pretrained

cfg = PolicyConfig(preset="pi05_tiny", chunk_size=10, n_action_steps=8, max_state_dim=8, max_action_dim=8,
                   image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False)
ds_config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False}}
with deepspeed.zero.Init(config_dict_or_path=ds_config):
    policy = build_policy(cfg)
params = dict(policy.named_parameters())
largest = max(p.ds_numel for p in params.values())
gathered, peak, reads = [0], [0], []
Gathered = deepspeed.zero.GatheredParameters

class Counting(Gathered):  # how many parameter elements are gathered at once, at most
    def __init__(self, ps, *a, **k):
        self.n = sum(p.ds_numel for p in ps)
        super().__init__(ps, *a, **k)
    def __enter__(self):
        gathered[0] += self.n
        peak[0] = max(peak[0], gathered[0])
        return super().__enter__()
    def __exit__(self, *exc):
        gathered[0] -= self.n
        return super().__exit__(*exc)

deepspeed.zero.GatheredParameters = Counting
read = pretrained.Checkpoint.tensor
pretrained.Checkpoint.tensor = lambda self, key: reads.append(key) or read(self, key)
report = load_pretrained(policy, sys.argv[1], partitioned=True)
deepspeed.zero.GatheredParameters = Gathered
weights = load_file(os.path.join(sys.argv[1], "model.safetensors"))
equal = True
for name, key in report.loaded.items():
    if name in params:
        with deepspeed.zero.GatheredParameters([params[name]]):
            equal &= torch.equal(params[name].data, weights[key])
param_reads = [k for k in reads if any(k == report.loaded.get(n) for n in params)]
print("RESULT" + json.dumps({"rank": dist.get_rank(), "equal": bool(equal), "peak": peak[0], "largest": largest,
      "total": sum(p.ds_numel for p in params.values()), "param_reads": len(param_reads), "params": len(params),
      "q99": policy.action_q99[:3].tolist()}), flush=True)
from opentau_cli.process.runtime import exit_rank
exit_rank(0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zero3_loads_into_the_partitioned_policy_one_gathered_parameter_at_a_time(tmp_path):
    ckpt = published(tmp_path, LEROBOT)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", ZERO3_LOAD, str(ckpt)], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("RESULT")]
        assert proc.returncode == 0 and lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT"):]))
    for result in results:
        assert result["equal"]  # every parameter holds the checkpoint's values once gathered
        assert result["peak"] == result["largest"] < result["total"]  # never more than one full parameter at once
        assert result["q99"] == STATS["action"]["q99"]  # statistics (not partitioned) set on every rank
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[0]["param_reads"] == by_rank[0]["params"] and by_rank[1]["param_reads"] == 0  # only rank 0 reads weights


# ------------------------------------------------------------------------------------------ the CLI
@pytest.mark.e2e
def test_train_prints_the_load_report_on_the_console_and_every_name_in_the_run_log(tmp_path):
    ckpt = published(tmp_path, LEROBOT)
    edit_weights(ckpt, lambda t: t.pop(LM_NORM))
    out = tmp_path / "run"
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    r = run_cli(["train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={out}", "--steps=1",
                 "--save_freq=1", "--validation.val_freq=0", "--logging.tensorboard=false",
                 f"--policy.pretrained_path={ckpt}", "--policy.pretrained_strict=false"], env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    console = r.stdout + r.stderr
    assert "Pretrained weights:" in console and "layout: LeRobot pi05" in console
    assert "1 missing: vlm.language_model.norm.weight" in console
    assert "every missing:" not in console  # the whole lists go to the log only
    log = next(out.glob("logs/*/rank0.log")).read_text()
    assert "layout: LeRobot pi05" in log and "every missing:\n    vlm.language_model.norm.weight" in log
    assert "    vlm.language_model.embed_tokens.weight <- model.paligemma_with_expert.paligemma.lm_head.weight" in log
    # The state statistics come from LeRobot's normalizer file; its action statistics are of another width than the
    # demo data's, so (not strict) the dataset's are used, and the report says so.
    assert "normalization statistics: from the checkpoint (policy_preprocessor_step_2_normalizer_processor.safetensors): state" in log
    assert "from the dataset: action (the checkpoint's action statistics" in log


def test_config_validate_refuses_a_missing_pretrained_path_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    r = run_cli(["config", "validate", str(EXAMPLES / "pi05_tiny_config.json"), f"--output_dir={out}",
                 f"--policy.pretrained_path={tmp_path / 'missing.safetensors'}"], env={"HF_HOME": str(tmp_path / "hf_home")})
    assert r.returncode == 2 and "missing.safetensors" in r.stderr and "does not exist" in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1 and not out.exists()
