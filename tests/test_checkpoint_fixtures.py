"""Checkpoints written by earlier releases keep working: every fixture under tests/fixtures/checkpoints/v<N>/ (real
runs of each kind, written by tests/fixtures/make_checkpoints.py with the release of that format) verifies,
inspects, consolidates, exports (every merged tensor compared with a merge computed here), evaluates and resumes
with the current code; a checkpoint of a newer format is refused in one line. The `ema` kind (an EMA of the adapters,
from format 2 on) is exported and evaluated from its EMA, as a new run's would be.

docs/ARCHITECTURE.md, "Checkpoint contract". verify / inspect / consolidate / export / eval run in-process; each
fixture is also resumed by a real launch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import ds_ckpt_helper
from conftest import run_cli
from opentau_cli.cli.main import app
from opentau_cli.config.paths import paths_base
from opentau_cli.errors import UserError
from opentau_cli.store.format import FIRST_VERSION, FORMAT_VERSION, check_readable, migrate_training_state, read_version
from opentau_cli.store.layout import CHECKPOINTS, EMA_WEIGHTS, MANIFEST, MODEL_WEIGHTS, TRAIN_CONFIG, TRAINING_STATE
from opentau_cli.store.manifest import verify_manifest, write_manifest
from opentau_cli.tools.consolidate import consolidate
from opentau_cli.tools.export import export
from opentau_cli.tools.info import verify_path

pytestmark = [pytest.mark.full, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]  # slow: starts first (conftest.py)

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
VERSIONS = sorted(int(p.name[1:]) for p in FIXTURES.glob("v*") if p.is_dir())
KINDS = ("ddp", "zero2", "zero3", "single", "mixture", "ema")
SINCE = {"ema": 2}  # kinds added after the first format: fixtures of the formats from then on
CASES = [(v, k) for v in VERSIONS for k in KINDS if (FIXTURES / f"v{v}" / k).is_dir()]
ZERO = [(v, k) for v, k in CASES if k.startswith("zero")]
STEP = "000002"
# Trained in full next to the LoRA adapters: its name in the checkpoint -> in the exported OpenTau layout.
ACTION_OUT = {"action_out_proj.weight": "model.action_out_proj.weight", "action_out_proj.bias": "model.action_out_proj.bias"}


def _id(case) -> str:
    return f"v{case[0]}-{case[1]}"


def _ckpt(root: Path) -> Path:
    return root / "run" / CHECKPOINTS / STEP


@pytest.fixture(scope="module")
def copies(tmp_path_factory) -> Path:
    """A copy of every fixture (the tests write next to checkpoints; the repository's copies stay as committed)."""
    root = tmp_path_factory.mktemp("fixtures")
    shutil.copytree(FIXTURES, root / "checkpoints", symlinks=True)
    return root / "checkpoints"


def _copy_of(copies: Path, case) -> Path:
    return copies / f"v{case[0]}" / case[1]


def test_every_format_before_this_one_has_fixtures_of_every_kind():
    assert FIRST_VERSION in VERSIONS
    for version in VERSIONS:
        assert version <= FORMAT_VERSION
        kinds = [k for k in KINDS if SINCE.get(k, FIRST_VERSION) <= version]
        assert sorted(p.name for p in (FIXTURES / f"v{version}").iterdir() if p.is_dir()) == sorted(kinds)


def test_fixtures_are_small():
    for version, kind in CASES:
        size = sum(p.stat().st_size for p in (FIXTURES / f"v{version}" / kind).rglob("*") if p.is_file())
        assert size < 2_000_000, f"v{version}/{kind}: {size} bytes"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fixture_states_its_format_version(case):
    version, _ = case
    assert read_version(_ckpt(FIXTURES / f"v{version}" / case[1])) == version
    assert check_readable(_ckpt(FIXTURES / f"v{version}" / case[1])) == version


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fixture_verifies_with_the_current_code(copies, case):
    report = verify_path(_copy_of(copies, case) / "run")
    assert report.checkpoints == {str(_ckpt(_copy_of(copies, case))): []}
    assert not report.problems


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_training_state_migrates_to_the_current_format(case):
    raw = json.loads((_ckpt(FIXTURES / f"v{case[0]}" / case[1]) / TRAINING_STATE).read_text())
    state = migrate_training_state(raw)
    assert state["format_version"] == FORMAT_VERSION
    assert state["step"] == raw["step"] == 2 and state["sampler"] == raw["sampler"]
    if case[0] == 1:
        assert "lineage" not in raw and state["lineage"] is None  # not recorded: one linear branch
    else:
        assert state["lineage"] == raw["lineage"]


@pytest.fixture(scope="module")
def zero_to_fp32(copies, tmp_path_factory) -> dict:
    """DeepSpeed's own zero_to_fp32.py output for every ZeRO fixture (one subprocess): the independent reference."""
    out = tmp_path_factory.mktemp("zero_to_fp32")
    pairs = [(_ckpt(_copy_of(copies, case)), out / _id(case)) for case in ZERO]
    ds_ckpt_helper.run_zero_to_fp32(pairs)
    return {case: ds_ckpt_helper.zero_to_fp32_output(out / _id(case)) for case in ZERO}


@pytest.mark.parametrize("case", ZERO, ids=_id)
def test_zero_fixture_consolidates_to_what_deepspeed_reads(copies, zero_to_fp32, tmp_path, case):
    result = consolidate(_ckpt(_copy_of(copies, case)), output=tmp_path / MODEL_WEIGHTS)
    ours = load_file(result.files[0])
    reference = zero_to_fp32[case]
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


def _stored(case, copies, zero_to_fp32) -> dict[str, torch.Tensor]:
    """The trained tensors as the fixture stores them, read without opentau (ZeRO shards through DeepSpeed's own
    zero_to_fp32), with its EMA's in place of the live ones where it keeps one: what export ships by default."""
    ckpt = _ckpt(_copy_of(copies, case))
    stored = zero_to_fp32[case] if case in zero_to_fp32 else load_file(ckpt / MODEL_WEIGHTS)
    if (ckpt / EMA_WEIGHTS).is_file():
        stored = {**stored, **load_file(ckpt / EMA_WEIGHTS)}
    return stored


def _action_out(case, copies, zero_to_fp32) -> dict[str, torch.Tensor]:
    """The fully trained action projection as the fixture stores it, read without opentau."""
    stored = _stored(case, copies, zero_to_fp32)
    return {name: stored[name] for name in ACTION_OUT}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fixture_exports_with_the_current_code(copies, zero_to_fp32, tmp_path, case):
    export(_copy_of(copies, case) / "run", tmp_path / "exported")
    exported = load_file(tmp_path / "exported" / MODEL_WEIGHTS)
    for name, tensor in _action_out(case, copies, zero_to_fp32).items():
        assert torch.equal(exported[ACTION_OUT[name]], tensor), name


def _moved_data(case) -> list[str]:
    """A format-2 mixture recorded its data by absolute path (outside the run): the data moved with the fixture."""
    if case[1] == "mixture" and case[0] >= 2:
        return [f"--dataset.mixture.{i}.root=data/{name}" for i, name in enumerate(("reach_v21", "reach_v30_video"))]
    return []


def _merged_reference(ckpt: Path, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fixture's adapted weights merged here, by LoRA's definition W = W0 + (alpha / rank) * B @ A, from the
    adapters it stores (`_stored`) and the seeded initial policy the run adapted; keyed by the adapted weight's name."""
    from accelerate.utils import set_seed

    from opentau_cli.config import load_config
    from opentau_cli.policies import build_policy

    cfg = load_config(ckpt / TRAIN_CONFIG, {})
    set_seed(cfg.seed)
    base = build_policy(cfg.policy).state_dict()
    scale = cfg.policy.lora.alpha / cfg.policy.lora.rank
    merged = {}
    for name, a in stored.items():
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0]
            merged[f"{module}.weight"] = base[f"{module}.weight"] + scale * (stored[name.replace(".lora_A.", ".lora_B.")] @ a)
    assert merged, f"{ckpt}: no adapters"
    return merged


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fixture_exports_every_merged_weight_as_lora_defines_it(copies, zero_to_fp32, tmp_path, case):
    """Every adapted weight of the export equals, bit for bit, the merge computed here (found by value: the export's
    names are its layout's)."""
    reference = _merged_reference(_ckpt(_copy_of(copies, case)), _stored(case, copies, zero_to_fp32))
    export(_copy_of(copies, case) / "run", tmp_path / "exported")
    exported = list(load_file(tmp_path / "exported" / MODEL_WEIGHTS).values())
    for name, want in reference.items():
        assert any(t.shape == want.shape and torch.equal(t, want) for t in exported), name


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fixture_inspects_with_the_current_code(copies, case):
    ckpt = _ckpt(_copy_of(copies, case))
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    state = json.loads((ckpt / TRAINING_STATE).read_text())
    assert (report["step"], report["world_size"], report["complete"]) == (2, state["world_size"], True)
    assert report["lora"]["rank"] == 2 and report["parameters"] > 0 and TRAINING_STATE in report["files"]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fixture_evaluates_with_the_current_code(copies, case, tmp_path, monkeypatch):
    work = _copy_of(copies, case)
    monkeypatch.chdir(work)  # version 1 names its data relative to the launch's directory
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", "run", "--output", str(out), "--episodes", "0", "--stride", "5",
                                      "--plot-episodes", "0", "--device", "cpu", *_moved_data(case)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    assert report["step"] == 2 and report["samples"] > 0 and report["policy"]["mse"] > 0


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fixture_resumes_exactly_with_the_current_code(copies, case):
    """Two more steps from the fixture's checkpoint log the losses the release that wrote it logged for those steps
    in an uninterrupted run; the new checkpoint is of the current format."""
    work = _copy_of(copies, case)
    reference = json.loads((work / "reference_losses.json").read_text())
    res = run_cli(["resume", "run", "--steps=4", *_moved_data(case)], cwd=work)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    resumed = {str(r["step"]): r["loss"] for r in records if r.get("kind") == "train" and r["step"] > 2}
    # The reference was computed on the machine that wrote the fixture: another CPU's float kernels (AVX-512 or AVX2
    # in MKL, oneDNN and ATen) round some sums differently, measured up to 1.2e-7 relative here; on one machine a
    # resume is bit-exact (test_train_e2e). A wrong data position, schedule, RNG or weight moves these losses by
    # more than 1e-2.
    assert sorted(resumed) == sorted(reference)
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6, abs=0), (step, resumed[step], loss)
    new = work / "run" / CHECKPOINTS / "000004"
    assert read_version(new) == FORMAT_VERSION
    assert json.loads((new / MANIFEST).read_text())["format_version"] == FORMAT_VERSION


# A checkpoint of a newer format: every reader refuses it in one line naming the release that wrote it.

@pytest.fixture(scope="module")
def from_the_future(copies) -> Path:
    newest = max(VERSIONS)
    root = copies.parent / "future"
    shutil.copytree(FIXTURES / f"v{newest}", root)  # as committed: the other tests write into their copies
    for kind in KINDS:  # sound checkpoints, as that release would write them: the manifest vouches for every file
        ckpt = _ckpt(root / kind)
        state = json.loads((ckpt / TRAINING_STATE).read_text())
        (ckpt / TRAINING_STATE).write_text(json.dumps({**state, "format_version": FORMAT_VERSION + 1}))
        write_manifest(ckpt)
        manifest = json.loads((ckpt / MANIFEST).read_text())
        (ckpt / MANIFEST).write_text(json.dumps({**manifest, "format_version": FORMAT_VERSION + 1,
                                                 "opentau_version": "9.9.0"}))
        assert verify_manifest(ckpt) == []
    return root


def test_check_readable_refuses_a_newer_format_naming_the_release_that_wrote_it(from_the_future):
    with pytest.raises(UserError, match=r"format 3 .* reads formats up to 2: it needs opentau 9\.9\.0 or newer"):
        check_readable(_ckpt(from_the_future / "single"))


def _readers(root: Path, tmp: Path) -> list[list[str]]:
    single, zero = root / "single" / "run", root / "zero2" / "run"
    return [
        ["checkpoint", "verify", single],
        ["checkpoint", "verify", single / CHECKPOINTS / STEP],
        ["checkpoint", "inspect", single / CHECKPOINTS / STEP],
        ["checkpoint", "list", single],
        ["checkpoint", "consolidate", zero / CHECKPOINTS / STEP, "--output", tmp / "consolidated" / MODEL_WEIGHTS],
        ["checkpoint", "export", single, "--output", tmp / "exported"],
        ["eval", single, "--output", tmp / "eval"],
        ["resume", single],
        ["resume", zero, "--reshard=true"],
    ]


def test_every_reader_refuses_a_newer_format_in_one_line(from_the_future, tmp_path, monkeypatch):
    monkeypatch.chdir(from_the_future / "single")
    runner = CliRunner()
    for args in _readers(from_the_future, tmp_path):
        res = runner.invoke(app, [str(a) for a in args])
        assert res.exit_code == 2, (args, res.output)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "needs opentau 9.9.0 or newer" in lines[0], (args, res.stderr)
    assert not (tmp_path / "consolidated").exists() and not (tmp_path / "exported").exists()


# train_config.json's migration: where its relative paths are relative to (config/paths.py).

@pytest.mark.parametrize("case", CASES, ids=_id)
def test_config_paths_of_version_1_mean_the_working_directory_and_of_later_ones_the_run(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = _ckpt(FIXTURES / f"v{case[0]}" / case[1]) / TRAIN_CONFIG
    assert paths_base(config) == (tmp_path if case[0] == 1 else config.parent.parent.parent)


def test_a_migration_refuses_a_record_newer_than_this_opentau():
    with pytest.raises(ValueError):
        migrate_training_state({"step": 1, "format_version": FORMAT_VERSION + 1})
    with pytest.raises(ValueError):
        migrate_training_state({"step": 1, "format_version": "2"})


def test_version_1_config_of_a_fixture_names_its_data_relative_to_the_launch():
    cfg = json.loads((_ckpt(FIXTURES / "v1" / "mixture") / TRAIN_CONFIG).read_text())
    roots = [m["root"] for m in cfg["dataset"]["mixture"]]
    assert roots == ["data/reach_v21", "data/reach_v30_video"]
