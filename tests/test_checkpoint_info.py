"""`opentau checkpoint inspect | verify | list` on a run directory laid out as opentau train writes it."""

from __future__ import annotations

import json
import os

from safetensors.torch import save_file
import pytest

import torch
from typer.testing import CliRunner

from opentau_cli.cli.main import app
from opentau_cli.store.layout import (
    BEST, CHECKPOINTS, LAST, MANIFEST, MODEL_WEIGHTS, OPTIMIZER, TRAIN_CONFIG, TRAINING_STATE, rank_state_file, tmp_dir,
)
from opentau_cli.store.manifest import write_manifest

pytestmark = pytest.mark.quick

runner = CliRunner()


def cli(args):
    return runner.invoke(app, [str(a) for a in args])


def _ddp_checkpoint(d, step: int):
    d.mkdir(parents=True)
    save_file({"w": torch.ones(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16), "n": torch.arange(2)}, d / MODEL_WEIGHTS)
    (d / OPTIMIZER).write_bytes(b"\0" * 64)
    for rank in (0, 1):  # each rank's RNG state: a checkpoint of 2 ranks without them would not verify
        (d / rank_state_file(rank)).write_bytes(b"\0" * 8)
    (d / TRAIN_CONFIG).write_text(json.dumps({"policy": {"type": "pi05", "preset": "pi05_tiny"}}))
    (d / TRAINING_STATE).write_text(json.dumps({
        "step": step, "backend": "ddp", "world_size": 2, "zero_stage": None, "mixed_precision": "bf16",
        "preset": "pi05_tiny", "time": f"2026-11-30T12:00:{step:02d}",
    }))
    write_manifest(d)
    return d


def _run(tmp_path):
    run = tmp_path / "run"
    root = run / CHECKPOINTS
    for step in (10, 20, 30):
        _ddp_checkpoint(root / f"{step:06d}", step)
    os.symlink("000030", root / LAST)
    interrupted = tmp_dir(root, "000040", "abc")  # an interrupted save
    interrupted.mkdir()
    (interrupted / MODEL_WEIGHTS).write_bytes(b"partial")
    return run, root, interrupted


def test_list_shows_every_checkpoint_with_step_size_completeness_and_last(tmp_path):
    run, root, interrupted = _run(tmp_path)
    (root / "000020" / OPTIMIZER).write_bytes(b"\0" * 10)  # truncated after the save
    res = cli(["checkpoint", "list", run, "--json"])
    assert res.exit_code == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert list(rows) == ["000010", "000020", "000030", interrupted.name]
    assert [rows[n]["step"] for n in ("000010", "000020", "000030")] == [10, 20, 30]
    assert rows["000010"]["complete"] and rows["000030"]["complete"]
    assert not rows["000020"]["complete"] and not rows[interrupted.name]["complete"]
    assert [n for n, r in rows.items() if r["last"]] == ["000030"]
    assert rows["000030"]["bytes"] > 100 and rows["000030"]["time"] == "2026-11-30T12:00:30"
    text = cli(["checkpoint", "list", run]).stdout
    assert "->000030" in text.replace(" ", "") and "interrupted save" in text


def test_verify_run_passes_when_sound_and_names_each_bad_file_with_exit_1(tmp_path):
    run, root, _ = _run(tmp_path)
    ok = cli(["checkpoint", "verify", run])
    assert ok.exit_code == 0, ok.stdout + ok.stderr
    assert "interrupted save" in ok.stdout  # reported, not a failure

    opt = root / "000020" / OPTIMIZER
    opt.write_bytes(b"\1" * 64)  # same size, other content
    (root / "000010" / TRAIN_CONFIG).unlink()
    (root / "000030" / "stray.pt").write_bytes(b"x")
    bad = cli(["checkpoint", "verify", run])
    assert bad.exit_code == 1
    assert f"altered: {OPTIMIZER}" in bad.stdout
    assert f"missing: {TRAIN_CONFIG}" in bad.stdout
    assert "extra: stray.pt" in bad.stdout
    assert "points at 000030, which fails verification" in bad.stdout


def test_verify_single_checkpoint_without_manifest_fails(tmp_path):
    d = _ddp_checkpoint(tmp_path / "000010", 10)
    (d / MANIFEST).unlink()
    res = cli(["checkpoint", "verify", d])
    assert res.exit_code == 1 and f"missing: {MANIFEST}" in res.stdout


def test_inspect_ddp_checkpoint_reports_state_and_safetensors_dtypes(tmp_path):
    d = _ddp_checkpoint(tmp_path / "000010", 10)
    info = json.loads(cli(["checkpoint", "inspect", d, "--json"]).stdout)
    assert (info["step"], info["backend"], info["world_size"], info["preset"]) == (10, "ddp", 2, "pi05_tiny")
    assert info["dtypes"] == {"F32": 12, "BF16": 4, "I64": 2} and info["parameters"] == 18
    assert info["consolidated"] is None and info["complete"] is True
    assert set(info["files"]) == {MODEL_WEIGHTS, OPTIMIZER, TRAIN_CONFIG, TRAINING_STATE, MANIFEST, rank_state_file(0), rank_state_file(1)}
    text = cli(["checkpoint", "inspect", d]).stdout
    assert "step:            10" in text and "pi05 pi05_tiny" in text


def test_bad_paths_are_one_clear_line_with_exit_2(tmp_path):
    for cmd in (["list", tmp_path], ["verify", tmp_path / "nope"], ["inspect", tmp_path / "nope"]):
        res = cli(["checkpoint", *cmd])
        assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def _lineage(d, parent: str | None, launch: str):
    """Give a checkpoint the lineage record a launch writes: its parent's name and step, and the launch's id."""
    state = json.loads((d / TRAINING_STATE).read_text())
    state["lineage"] = {"parent": {"step": int(parent), "name": parent, "manifest_xxh3": None} if parent else None,
                        "launch": launch}
    (d / TRAINING_STATE).write_text(json.dumps(state))
    write_manifest(d)


def _rolled_back_run(tmp_path):
    """Launch A saved 10, 20, 30, 40; a rollback to 20 moved 30 and 40 aside; launch B then saved its own 30."""
    run = tmp_path / "run"
    root = run / CHECKPOINTS
    moved = run / "rolled_back" / "20261201-120000" / CHECKPOINTS
    for d, parent, launch in ((root / "000010", None, "A"), (root / "000020", "000010", "A"), (moved / "000030", "000020", "A"),
                              (moved / "000040", "000030", "A"), (root / "000030", "000020", "B")):
        _ddp_checkpoint(d, int(d.name))
        _lineage(d, parent, launch)
    os.symlink("000030", root / LAST)
    return run, root, moved


def test_plain_list_says_hashes_were_not_checked_and_list_verify_catches_a_flipped_byte_with_exit_1(tmp_path):
    run, root, _ = _run(tmp_path)
    opt = root / "000020" / OPTIMIZER
    data = bytearray(opt.read_bytes())
    data[7] ^= 0x01  # one flipped bit: same size, other content
    opt.write_bytes(bytes(data))

    plain = cli(["checkpoint", "list", run])
    assert plain.exit_code == 0, plain.stderr
    assert "verified" not in plain.stdout.splitlines()[0]  # the column says what was checked: sizes
    assert "Hashes not checked (sizes only): `opentau checkpoint list RUN --verify` re-hashes every file." in plain.stdout
    rows = {r["name"]: r for r in json.loads(cli(["checkpoint", "list", run, "--json"]).stdout)}
    assert rows["000020"]["complete"] is True and rows["000020"]["verified"] is None

    verified = cli(["checkpoint", "list", run, "--verify"])
    assert verified.exit_code == 1, verified.stdout + verified.stderr  # as `checkpoint verify`: a failure is no success
    assert verified.stderr.strip() == "Error: 1 checkpoint(s) fail verification: 000020."
    line = next(x for x in verified.stdout.splitlines() if "000020" in x)
    assert " NO " in line and f"fails verification: altered: {OPTIMIZER} (content hash differs)" in line
    assert "Every file re-hashed against its checkpoint's manifest." in verified.stdout
    as_json = cli(["checkpoint", "list", run, "--verify", "--json"])
    assert as_json.exit_code == 1
    rows = {r["name"]: r for r in json.loads(as_json.stdout)}
    assert (rows["000020"]["complete"], rows["000020"]["verified"]) == (False, False)
    assert (rows["000010"]["verified"], rows["000030"]["verified"]) == (True, True)


def test_list_shows_the_current_branch_and_the_rolled_back_checkpoints(tmp_path):
    run, root, moved = _rolled_back_run(tmp_path)
    res = cli(["checkpoint", "list", run, "--json"])
    assert res.exit_code == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [(r["name"], r["branch"], r["last"], r["parent"], r["rolled_back"]) for r in rows] == [
        ("000010", True, False, None, None),
        ("000020", True, False, "000010", None),
        ("000030", True, True, "000020", None),
        ("rolled_back/20261201-120000/checkpoints/000030", False, False, "000020", "20261201-120000"),
        ("rolled_back/20261201-120000/checkpoints/000040", False, False, "000030", "20261201-120000"),
    ]
    text = cli(["checkpoint", "list", run]).stdout.splitlines()
    assert text[1].split()[-2:] == ["current", "-"] and text[3].split()[-2:] == ["current", "000020"]
    assert text[4].split()[0] == "rolled_back/20261201-120000/checkpoints/000030" and text[4].split()[-2:] == ["rolled", "000020"]


def test_inspect_on_a_run_directory_describes_the_run_not_a_missing_manifest(tmp_path):
    run, root, moved = _rolled_back_run(tmp_path)
    res = cli(["checkpoint", "inspect", run])
    assert res.exit_code == 0, res.stderr
    lines = dict(line.split(":", 1) for line in res.stdout.splitlines() if ":" in line and not line.startswith("Hashes"))
    assert {k: v.strip() for k, v in lines.items()} == {
        "run": str(run),
        "checkpoints": "3: 000010, 000020, 000030",
        "last": "000030 (complete at its manifest sizes)",
        "best": "- (none kept: checkpoint.keep_best)",
        "current branch": "000010 -> 000020 -> 000030",
        "resume continues": "000030",
        "launches": "A, B",
        "rolled back": "000030, 000040 (moved to rolled_back/20261201-120000/, kept)",
    }
    assert "manifest missing" not in res.stdout
    as_json = json.loads(cli(["checkpoint", "inspect", run, "--json"]).stdout)
    assert as_json["branch"] == ["000010", "000020", "000030"] and as_json["rolled_back"] == {"20261201-120000": ["000030", "000040"]}
    assert cli(["checkpoint", "inspect", root]).stdout == res.stdout  # checkpoints/ itself names the same run
    one = cli(["checkpoint", "inspect", root / "000030"])
    assert "continues:       000020, written by launch B" in one.stdout


def test_a_sound_run_with_an_interrupted_save_passes_list_verify_with_exit_0(tmp_path):
    run, _, interrupted = _run(tmp_path)
    res = cli(["checkpoint", "list", run, "--verify", "--json"])
    assert res.exit_code == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert [rows[n]["verified"] for n in ("000010", "000020", "000030")] == [True, True, True]
    assert rows[interrupted.name]["verified"] is None  # a leftover is reported, not a failure (as `verify` does)


def test_list_and_inspect_mark_which_checkpoints_last_and_best_point_at(tmp_path):
    run, root, _ = _run(tmp_path)
    os.symlink("000020", root / BEST)
    rows = {r["name"]: r for r in json.loads(cli(["checkpoint", "list", run, "--json"]).stdout)}
    assert {n: (r["last"], r["best"]) for n, r in rows.items() if not n.startswith(".")} == {
        "000010": (False, False), "000020": (False, True), "000030": (True, False)}
    text = {line.split()[0].lstrip("->"): line.split() for line in cli(["checkpoint", "list", run]).stdout.splitlines()[1:4]}
    assert (text["000010"][-3], text["000020"][-3], text["000030"][-3]) == ("-", "best", "last")

    run_view = cli(["checkpoint", "inspect", run])
    assert "last:             000030 (complete at its manifest sizes)" in run_view.stdout
    assert "best:             000020" in run_view.stdout.splitlines()
    run_json = json.loads(cli(["checkpoint", "inspect", run, "--json"]).stdout)
    assert (run_json["last"], run_json["best"]) == ("000030", "000020")
    for path, links in ((root / "000030", ["last"]), (root / LAST, ["last"]), (root / BEST, ["best"]),
                        (root / "000020", ["best"]), (root / "000010", [])):
        assert json.loads(cli(["checkpoint", "inspect", path, "--json"]).stdout)["links"] == links, path
    assert "designated by:   checkpoints/best" in cli(["checkpoint", "inspect", root / "000020"]).stdout.splitlines()

    os.unlink(root / BEST)
    os.symlink("000030", root / BEST)  # both on one checkpoint
    text = [line.split() for line in cli(["checkpoint", "list", run]).stdout.splitlines() if "000030" in line]
    assert text[0][-3] == "last+best"
    assert "designated by:   checkpoints/last, checkpoints/best" in cli(["checkpoint", "inspect", root / "000030"]).stdout


def test_list_inspect_and_verify_of_a_safetensors_run_never_import_torch(tmp_path):
    """Measured from outside: Python's own import log (-X importtime) of the installed CLI. A DDP checkpoint's files are
    JSON and safetensors headers: the tools read them without torch (a second of CPU per command)."""
    import subprocess

    from conftest import opentau_bin

    run, root, _ = _run(tmp_path)
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    for args in (["list", run, "--verify"], ["inspect", run], ["inspect", root / "000030"], ["verify", run]):
        done = subprocess.run([opentau_bin(), "checkpoint", *map(str, args)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
        # torch's modules, not only its own line: a package importlib imports (runtime.import_paused) has none.
        assert "opentau_cli.tools.info" in imported and not {m for m in imported if m.split(".")[0] == "torch"}, args
    assert "000030" in done.stdout
