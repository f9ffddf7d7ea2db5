"""A real `opentau train` ZeRO-3 run of pi05_tiny (2 CPU ranks), SIGKILLed in the middle of a save: the previous
checkpoints verify and the run resumes; consolidate equals zero_to_fp32 and the result loads into a fresh pi05_tiny
(`--policy.pretrained_path` warm starts go through that same `load_pretrained`); resume refuses a planted malicious
pickle."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from typer.testing import CliRunner

from conftest import EXAMPLES, SUITE_CACHE, opentau_bin, run_cli
from opentau_cli.cli.main import app
from opentau_cli.store.layout import (
    CHECKPOINTS, LAST, METRICS, MODEL_WEIGHTS, TRAIN_CONFIG, leftover_of, rank_state_file, read_last,
)

sys.path.insert(0, str(Path(__file__).parent))
import ds_ckpt_helper  # noqa: E402

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, isolated_env_module):
    """Train with a save every step; SIGKILL every process of the run while rank 0 writes its optimizer shard in the
    save of step 3 (tests/hooks' TEST_KILL_AT makes the moment exact)."""
    run = tmp_path_factory.mktemp("z3") / "run"
    cmd = [opentau_bin(), "train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}",
           f"--accelerate-config={EXAMPLES / 'accelerate_cpu_deepspeed_zero3_config.yaml'}",
           f"--output_dir={run}", "--steps=4", "--save_freq=1", "--log_freq=1", "--validation.val_freq=1000"]
    env = {k: v for k, v in os.environ.items() if k != "OPENTAU_DEBUG"}
    env.update(isolated_env_module, PYTHONPATH=str(Path(__file__).parent / "hooks"), TEST_KILL_AT="mid_file@3")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed in the save of step 3:\n{proc.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def isolated_env_module(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    return {"HF_HOME": str(home), "OPENTAU_CACHE_DIR": str(SUITE_CACHE)}


def test_pi05_zero3_checkpoint_consolidates_like_zero_to_fp32_and_loads_into_fresh_policy(zero3_run, tmp_path):
    from opentau_cli.config.load import load_config
    from opentau_cli.policies import build_policy, load_pretrained

    ckpt = zero3_run / CHECKPOINTS / "000002"
    res = CliRunner().invoke(app, ["checkpoint", "consolidate", str(zero3_run / CHECKPOINTS / LAST)])
    assert res.exit_code == 0, res.stderr
    ours = load_file(ckpt / MODEL_WEIGHTS)
    ds_ckpt_helper.run_zero_to_fp32([(ckpt, tmp_path / "ref")])
    ref = ds_ckpt_helper.zero_to_fp32_output(tmp_path / "ref")
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape and torch.equal(ours[k], ref[k]), k

    cfg = load_config(ckpt / TRAIN_CONFIG, [])
    policy = build_policy(cfg.policy)
    report = load_pretrained(policy, ckpt)
    assert not report.missing and not report.unexpected
    state = policy.state_dict()
    assert all(torch.equal(state[k], ours[k].to(state[k].dtype)) for k in ours)
    # The consolidated file is vouched for: the checkpoint still verifies (and so still resumes).
    assert CliRunner().invoke(app, ["checkpoint", "verify", str(ckpt)]).exit_code == 0


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("forge_manifest", [False, True], ids=["tampered", "tampered_with_forged_manifest"])
def test_resume_refuses_a_planted_malicious_pickle_and_never_runs_it(zero3_run, isolated_env_module, tmp_path, forge_manifest):
    from opentau_cli.store.manifest import write_manifest

    run = tmp_path / "run"
    shutil.copytree(zero3_run, run, symlinks=True)
    ckpt = run / CHECKPOINTS / "000002"
    marker = tmp_path / "pwned"
    rng = ckpt / rank_state_file(1)  # Accelerate unpickles these with plain pickle in load_state
    torch.save({"step": _Evil(marker)}, rng)
    if forge_manifest:  # an attacker who can also rewrite manifest.json: the pickle scan still refuses
        write_manifest(ckpt)
    res = run_cli(["resume", str(ckpt), "--steps=3"], env=isolated_env_module)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert not marker.exists()
    assert "Traceback" not in res.stderr and rng.name in res.stderr
    assert ("system" in res.stderr) if forge_manifest else ("manifest" in res.stderr)


def test_sigkill_mid_save_leaves_checkpoints_verifiable_and_resume_continues_exactly(zero3_run, isolated_env_module, tmp_path):
    from opentau_cli.store.manifest import is_complete, verify_manifest

    run = tmp_path / "run"
    shutil.copytree(zero3_run, run, symlinks=True)
    ckpts = run / CHECKPOINTS
    assert [leftover_of(p.name) for p in ckpts.iterdir() if leftover_of(p.name)] == [("save", "000003")], \
        "the kill did not land inside the save"
    steps = sorted(d.name for d in ckpts.iterdir() if d.name.isdigit())
    assert steps == ["000001", "000002"] and all(is_complete(ckpts / s) and not verify_manifest(ckpts / s) for s in steps)
    assert os.readlink(ckpts / LAST) == "000002" == read_last(ckpts)
    assert CliRunner().invoke(app, ["checkpoint", "verify", str(run)]).exit_code == 0

    def step3_losses():
        return [r["loss"] for r in map(json.loads, (run / METRICS).read_text().splitlines())
                if r.get("kind") == "train" and r.get("step") == 3]

    before = step3_losses()  # logged by the killed run just before its save of step 3 began
    res = run_cli(["resume", str(run), "--steps=3"], env=isolated_env_module)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "000002" in res.stdout + res.stderr  # resumed from the newest complete checkpoint
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")], "the interrupted save was not cleaned up"
    assert not verify_manifest(ckpts / "000003") and os.readlink(ckpts / LAST) == "000003"
    # The resumed run computes step 3 again from the restored model, optimizer, RNG and data position: same loss.
    assert len(before) == 1 and step3_losses() == before, (before, step3_losses())
