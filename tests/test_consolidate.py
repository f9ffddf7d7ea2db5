"""`opentau checkpoint consolidate` on real DeepSpeed checkpoints (made with accelerate launch on CPU) equals
DeepSpeed's own zero_to_fp32.py tensor for tensor, bit for bit, and refuses damaged or foreign shards cleanly."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from typer.testing import CliRunner

from conftest import REPO, SESSION_TEMP, opentau_bin, run_cli
from opentau_cli.cli.main import app
from opentau_cli.store.layout import (
    CHECKPOINTS, DS_TAG, LAST, MODEL_WEIGHTS, WEIGHTS_INDEX, ds_shard_glob, weights_shard_path,
)

sys.path.insert(0, str(Path(__file__).parent))
import ds_ckpt_helper  # noqa: E402

pytestmark = [pytest.mark.full, pytest.mark.slow]  # a minute or more: starts first (tests/conftest.py)

# name -> (zero stage, ranks, mixed precision)
CASES = {"z2r1": (2, 1, "no"), "z2r2": (2, 2, "bf16"), "z3r1": (3, 1, "no"), "z3r2": (3, 2, "bf16")}
runner = CliRunner()


@pytest.fixture(scope="session")
def ds_ckpts(tmp_path_factory):
    """Real DeepSpeed checkpoints plus DeepSpeed's own zero_to_fp32.py output for each (run as a subprocess).

    Two launches (1 and 2 ranks) each save a ZeRO-2 run, then a ZeRO-3 run in the same processes. z3r2_step3 is the
    z3r2 run saved one step later: the source of "a shard from another save"."""
    root = tmp_path_factory.mktemp(f"{SESSION_TEMP}ds")

    def make(ranks):
        mp = "bf16" if ranks == 2 else "no"
        extra = root / "z3r2_step3" if ranks == 2 else None
        ds_ckpt_helper.launch(root / f"z2r{ranks}", zero_stage=2, num_processes=ranks, mixed_precision=mp,
                              zero3_out=root / f"z3r{ranks}", extra_out=extra)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(make, (1, 2)))
    ds_ckpt_helper.run_zero_to_fp32([(root / name, root / f"ref_{name}") for name in CASES])
    return root


def cli(args: list[str]):
    """The opentau app in-process (a subprocess per call would spend most of the test budget importing torch)."""
    return runner.invoke(app, [str(a) for a in args])


def _copy(ds_ckpts, name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(ds_ckpts / name, dst)
    return dst


def _reference(ds_ckpts, name) -> dict[str, torch.Tensor]:
    return ds_ckpt_helper.zero_to_fp32_output(ds_ckpts / f"ref_{name}")


def _assert_bit_equal(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    for k, r in ref.items():
        o = ours[k]
        assert (o.dtype, tuple(o.shape)) == (r.dtype, tuple(r.shape)), k
        assert torch.equal(o.contiguous().view(-1).view(torch.uint8), r.contiguous().view(-1).view(torch.uint8)), k


@pytest.mark.parametrize("name", ["z2r1", "z2r2", "z3r1", "z3r2"])
def test_consolidate_equals_deepspeed_zero_to_fp32_bit_for_bit(ds_ckpts, tmp_path, name):
    from opentau_cli.tools.info import inspect_checkpoint

    ckpt = _copy(ds_ckpts, name, tmp_path)
    info = inspect_checkpoint(ckpt)
    stage, ranks, mp = CASES[name]
    assert (info.zero_stage, info.world_size, info.mixed_precision) == (stage, ranks, "bf16" if mp == "bf16" else "no")
    res = cli(["checkpoint", "consolidate", ckpt])
    assert res.exit_code == 0, res.stderr
    ours = load_file(ckpt / MODEL_WEIGHTS)
    ref = _reference(ds_ckpts, name)
    _assert_bit_equal(ours, ref)
    # What the checkpoint must carry: the frozen submodule, both buffers, both names of the tied weight.
    assert {"frozen.weight", "frozen.bias", "state_mean", "seen", "embed.weight", "head.weight"} <= set(ours)
    assert ours["seen"].dtype == torch.int64 and ours["frozen.weight"].dtype == torch.float32
    assert not list(ckpt.glob(".*tmp*")), "no temp file left behind"


def test_output_on_another_filesystem_is_written_not_copied_and_equals_zero_to_fp32_bit_for_bit(ds_ckpts, tmp_path):
    """/dev/shm (tmpfs) is another filesystem than the checkpoint's: the kernel refuses the file-to-file copy (EXDEV)
    and the weights are read and written instead, with the same result."""
    import tempfile

    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        assert os.stat(shm).st_dev != os.stat(ckpt).st_dev
        res = cli(["checkpoint", "consolidate", ckpt, "--output", shm / "out"])
        assert res.exit_code == 0, res.stderr
        _assert_bit_equal(load_file(shm / "out" / MODEL_WEIGHTS), _reference(ds_ckpts, "z3r2"))
    finally:
        shutil.rmtree(shm)


def test_bf16_output_equals_zero_to_fp32_cast_to_bf16(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    out = tmp_path / "out" / "bf16.safetensors"
    out.parent.mkdir()
    res = cli(["checkpoint", "consolidate", ckpt, "--dtype", "bf16", "--output", out])
    assert res.exit_code == 0, res.stderr
    ref = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in _reference(ds_ckpts, "z3r2").items()}
    _assert_bit_equal(load_file(out), ref)
    assert not (ckpt / MODEL_WEIGHTS).exists()


def test_above_max_shard_size_writes_hf_shards_and_index(ds_ckpts, tmp_path):
    import json

    ckpt = _copy(ds_ckpts, "z2r2", tmp_path)
    res = cli(["checkpoint", "consolidate", ckpt, "--max-shard-size", "3KB"])
    assert res.exit_code == 0, res.stderr
    index = json.loads((ckpt / WEIGHTS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == weights_shard_path(ckpt / MODEL_WEIGHTS, 1, len(shards)).name
    merged = {}
    for s in shards:
        part = load_file(ckpt / s)
        assert all(index["weight_map"][k] == s for k in part)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 3000 or len(part) == 1
        merged.update(part)
    _assert_bit_equal(merged, _reference(ds_ckpts, "z2r2"))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert not (ckpt / MODEL_WEIGHTS).exists()


def test_already_consolidated_says_so_exits_0_and_force_redoes_it(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r1", tmp_path)
    assert cli(["checkpoint", "consolidate", ckpt]).exit_code == 0
    out = ckpt / MODEL_WEIGHTS
    out.write_bytes(out.read_bytes())  # same content, new mtime marker below
    os.utime(out, (1, 1))
    again = cli(["checkpoint", "consolidate", ckpt])
    assert again.exit_code == 0 and "already consolidated" in again.stdout
    assert out.stat().st_mtime == 1
    forced = cli(["checkpoint", "consolidate", ckpt, "--force"])
    assert forced.exit_code == 0 and out.stat().st_mtime > 1
    _assert_bit_equal(load_file(out), _reference(ds_ckpts, "z3r1"))


def test_consolidate_of_a_checkpoint_with_manifest_keeps_it_verifiable(ds_ckpts, tmp_path):
    from opentau_cli.store.manifest import verify_manifest, write_manifest

    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    write_manifest(ckpt)
    assert cli(["checkpoint", "consolidate", ckpt]).exit_code == 0
    assert verify_manifest(ckpt) == []
    assert cli(["checkpoint", "verify", ckpt]).exit_code == 0


class _Evil:
    """Unpickling this runs `touch <marker>`: what a poisoned checkpoint would do to a plain torch.load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["optim", "model"])
def test_malicious_pickle_in_a_shard_is_refused_and_never_executed(ds_ckpts, tmp_path, victim):
    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    marker = tmp_path / "pwned"
    shard = next((ckpt / DS_TAG).glob(ds_shard_glob(victim, rank=1)))
    torch.save({"optimizer_state_dict": {"zero_stage": _Evil(marker)}, "module": _Evil(marker)}, shard)
    for cmd in (["checkpoint", "inspect", ckpt], ["checkpoint", "verify", ckpt], ["checkpoint", "list", tmp_path]):
        cli(cmd)
        assert not marker.exists(), f"{cmd[1]} executed the pickle"
    res = run_cli(["checkpoint", "consolidate", str(ckpt)])  # the real installed command, once
    assert not marker.exists()
    assert res.returncode == 2
    assert "refusing to load it" in res.stderr and shard.name in res.stderr and "system" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (ckpt / MODEL_WEIGHTS).exists()
    # And the plain loader would have run it: the test plants a real threat.
    torch.load(shard, weights_only=False)
    assert marker.exists()


def test_output_dir_follows_the_output_convention_parents_made_a_used_target_refused_force_replaces(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    out = tmp_path / "new" / "parents" / "consolidated"
    made = cli(["checkpoint", "consolidate", ckpt, "--output", out])  # in-process: the installed script runs in the pickle test
    assert made.exit_code == 0, made.stderr
    assert sorted(p.name for p in out.iterdir()) == [".opentau-output.json", MODEL_WEIGHTS]  # the marker: see store/outputs.py
    assert sorted(p.name for p in out.parent.iterdir()) == ["consolidated"]
    _assert_bit_equal(load_file(out / MODEL_WEIGHTS), _reference(ds_ckpts, "z3r2"))
    refused = cli(["checkpoint", "consolidate", ckpt, "--output", out, "--dtype", "bf16"])
    assert refused.exit_code == 2 and refused.stderr.strip() == (
        f"Error: {out} already exists and is not empty: choose a new path, or pass --force to replace this earlier "
        "output of `opentau checkpoint consolidate`."), refused.stderr
    assert load_file(out / MODEL_WEIGHTS)["embed.weight"].dtype == torch.float32  # untouched
    forced = cli(["checkpoint", "consolidate", ckpt, "--output", out, "--dtype", "bf16", "--force", "--max-shard-size", "3KB"])
    assert forced.exit_code == 0, forced.stderr
    assert (out / WEIGHTS_INDEX).is_file() and not (out / MODEL_WEIGHTS).exists()  # replaced whole: no stale single file
    assert sorted(p.name for p in out.parent.iterdir()) == ["consolidated"] and not (ckpt / MODEL_WEIGHTS).exists()


def _fails_cleanly(res, *needles):
    code = res.returncode if hasattr(res, "returncode") else res.exit_code
    assert code in (1, 2), res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr


def test_truncated_shard_is_named_and_nothing_is_written(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z2r2", tmp_path)
    shard = next((ckpt / DS_TAG).glob(ds_shard_glob("optim", rank=1)))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _fails_cleanly(cli(["checkpoint", "consolidate", ckpt]), shard.name, "truncated")
    assert not list(ckpt.glob("*.safetensors*")) and not list(ckpt.glob(".*"))


def test_unreadable_zero_stage_in_a_shard_is_one_line_exit_2_and_nothing_is_written(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    shard = next((ckpt / DS_TAG).glob(ds_shard_glob("optim", rank=1)))
    state = torch.load(shard, weights_only=False)
    state["optimizer_state_dict"]["zero_stage"] = "three"
    torch.save(state, shard)
    res = cli(["checkpoint", "consolidate", ckpt])
    assert res.exit_code == 2, res.output
    assert "unreadable zero_stage 'three'" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.output
    assert not list(ckpt.glob("*.safetensors*")) and not list(ckpt.glob(".*"))


def test_a_tensor_shorter_than_its_record_found_while_writing_is_one_line_exit_2_and_nothing_is_written(ds_ckpts, tmp_path):
    """Planning reads only the pickles; a shard whose tensor records were cut is found when its tensors are read."""
    import zipfile

    ckpt = _copy(ds_ckpts, "z2r2", tmp_path)
    shard = next((ckpt / DS_TAG).glob(ds_shard_glob("optim", rank=1)))
    with zipfile.ZipFile(shard) as src:
        records = [(info.filename, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(shard, "w", zipfile.ZIP_STORED) as dst:
        for name, data in records:
            big_tensor = "/data/" in name and len(data) > 64  # the step counter (read while planning) stays whole
            dst.writestr(name, data[: len(data) // 2] if big_tensor else data)
    res = cli(["checkpoint", "consolidate", ckpt])
    assert res.exit_code == 2, res.output
    assert "runs past its storage record" in res.stderr and shard.name in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not list(ckpt.glob("*.safetensors*")) and not list(ckpt.glob(".*"))


def test_missing_rank_shard_is_named(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    next((ckpt / DS_TAG).glob(ds_shard_glob("optim", rank=1))).unlink()
    _fails_cleanly(cli(["checkpoint", "consolidate", ckpt]), "rank(s) 1", "missing")
    assert not (ckpt / MODEL_WEIGHTS).exists()


def test_shard_from_a_run_with_another_world_size_is_refused(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z2r2", tmp_path)
    other = next((ds_ckpts / "z2r1" / DS_TAG).glob(ds_shard_glob("optim")))
    target = next((ckpt / DS_TAG).glob(ds_shard_glob("optim", rank=1)))
    shutil.copyfile(other, target)
    _fails_cleanly(cli(["checkpoint", "consolidate", ckpt]), target.name, "another run")
    assert not (ckpt / MODEL_WEIGHTS).exists()


def test_shard_from_another_save_step_is_refused(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    for kind in ("optim", "model"):
        other = next((ds_ckpts / "z3r2_step3" / DS_TAG).glob(ds_shard_glob(kind, rank=1)))
        shutil.copyfile(other, ckpt / DS_TAG / other.name)
    _fails_cleanly(cli(["checkpoint", "consolidate", ckpt]), "another save", "step")
    assert not (ckpt / MODEL_WEIGHTS).exists()


def test_not_a_deepspeed_checkpoint_is_one_clear_line(tmp_path):
    (tmp_path / MODEL_WEIGHTS).write_bytes(b"")
    res = cli(["checkpoint", "consolidate", tmp_path])
    assert res.exit_code == 2 and f"already in {MODEL_WEIGHTS}" in res.stderr
    res = cli(["checkpoint", "consolidate", tmp_path / "nope"])
    assert res.exit_code == 2 and res.stderr.strip() == f"Error: {tmp_path / 'nope'} is not a directory."
    run = tmp_path / "run"
    (run / CHECKPOINTS).mkdir(parents=True)
    res = cli(["checkpoint", "consolidate", run])
    assert res.exit_code == 2 and "is a run directory" in res.stderr and f"{CHECKPOINTS}/{LAST}" in res.stderr
    for bad in (["--dtype", "int8"], ["--max-shard-size", "lots"]):
        res = cli(["checkpoint", "consolidate", tmp_path, *bad])
        assert res.exit_code == 2 and bad[1] in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_unwritable_output_dir_is_refused_before_writing(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r1", tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    mounted = False
    if os.access(ro, os.W_OK):  # root ignores modes: use a read-only mount instead
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode == 0
        if not mounted:
            pytest.skip("cannot make an unwritable directory here")
    try:
        _fails_cleanly(cli(["checkpoint", "consolidate", ckpt, "--output", ro / "out"]), "not writable")
        assert not list(ro.iterdir())
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)])


def test_disk_full_during_write_leaves_no_partial_file(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)

    def small_file_limit():  # writes past 4 KB fail with EFBIG, like a full disk (no root or mount needed)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    res = subprocess.run([opentau_bin(), "checkpoint", "consolidate", str(ckpt)], capture_output=True, text=True,
                         preexec_fn=small_file_limit, timeout=600)
    _fails_cleanly(res, "Disk full", "nothing was left behind")
    assert res.returncode == 1
    assert not list(ckpt.glob("*.safetensors")) and not list(ckpt.glob(f".{MODEL_WEIGHTS}*"))


def test_not_enough_free_space_is_refused_before_writing(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        _fails_cleanly(cli(["checkpoint", "consolidate", ckpt, "--output", small / "out"]), "Not enough disk space")
        assert not list(small.iterdir())
    finally:
        subprocess.run(["umount", str(small)])


def test_convert_checkpoint_sh_calls_consolidate(ds_ckpts, tmp_path):
    ckpt = _copy(ds_ckpts, "z2r1", tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(REPO / "convert_checkpoint.sh"), str(ckpt)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    _assert_bit_equal(load_file(ckpt / MODEL_WEIGHTS), _reference(ds_ckpts, "z2r1"))


def test_inspect_reads_stage_world_size_step_and_parameter_counts_from_shards(ds_ckpts, tmp_path):
    import json

    ckpt = _copy(ds_ckpts, "z3r2", tmp_path)
    res = cli(["checkpoint", "inspect", ckpt, "--json"])
    assert res.exit_code == 0, res.stderr
    info = json.loads(res.stdout)
    ref = _reference(ds_ckpts, "z3r2")
    params = sum(v.numel() for k, v in ref.items() if k not in ("state_mean", "seen", "head.weight"))  # tied counted once
    frozen = ref["frozen.weight"].numel() + ref["frozen.bias"].numel()
    assert (info["backend"], info["zero_stage"], info["world_size"], info["step"]) == ("deepspeed", 3, 2, 2)
    assert (info["parameters"], info["trainable_parameters"]) == (params, params - frozen)
    assert info["mixed_precision"] == "bf16" and info["dtypes"] == {"bfloat16": params}
    assert info["consolidated"] is False
    rank1_model_states = next((ckpt / DS_TAG).glob(ds_shard_glob("model", rank=1))).relative_to(ckpt).as_posix()
    assert info["files"][rank1_model_states] > 0
    cli(["checkpoint", "consolidate", ckpt])
    text = cli(["checkpoint", "inspect", ckpt]).stdout
    assert "deepspeed ZeRO-3" in text and "consolidated:    yes" in text and MODEL_WEIGHTS in text


def test_bench_consolidate_smoke_compares_three_paths_at_two_sizes_side_by_side(ds_ckpts, tmp_path):
    """The benchmark script end to end (CI): the ZeRO-3 2-rank checkpoint from above stands in for both sizes instead
    of two more launches."""
    work = tmp_path / "bench"
    for stack in (4, 8):
        shutil.copytree(ds_ckpts / "z3r2", work / f"zero3_stack{stack}")
    results = tmp_path / "BENCH.md"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_consolidate.py"), "--smoke", "--workdir", str(work),
                          "--results", str(results)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    for row in ("wall ratio vs direct, 4 layers / 8 layers", "RSS ratio vs direct, 4 layers / 8 layers",
                "wall ratio vs upstream, 4 layers / 8 layers", "RSS ratio vs upstream, 4 layers / 8 layers"):
        assert res.stdout.count(row) == 1, row
    assert "identical (names, dtypes, shapes, bytes)" in res.stdout
    text = results.read_text()
    assert "Streaming consolidation vs zero_to_fp32" in text and "command:" in text and "medians of 1 round" in text
    assert "| model, 4 layers | reused zero3_stack4" in text and "| model, 8 layers | reused zero3_stack8" in text
