"""No output overlaps a run (issue #34): `checkpoint export --output`, `eval --output`, `checkpoint consolidate
--output` and `dataset synth OUT` refuse, with or without --force, a target that is, lies inside or contains a run,
its checkpoints/ folder, a checkpoint or the `last` link, and leave every byte of the run as it was; --force replaces
only an earlier output of the same command.

The runs are copies of the committed format-2 fixtures (tests/fixtures/checkpoints/v2: a single-process run and a
ZeRO-2 run, as `opentau train` wrote them): every refusal comes before anything is loaded, so the commands run
in-process and no training is launched. docs/ARCHITECTURE.md, "Outputs".
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import run_cli_in_process, refused, tree
from opentau_cli.store.layout import CHECKPOINTS, LAST, MODEL_WEIGHTS

pytestmark = pytest.mark.full

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints" / "v2"
STEP = "000002"
MARKER = ".opentau-output.json"  # what opentau_cli/store/outputs.py puts into each directory it publishes
OVERLAP = "an output never"  # every overlap refusal says why in these words






@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """projects/single/run and projects/zero2/run: copies of the fixtures' runs (checkpoints/000002 and `last`)."""
    root = tmp_path_factory.mktemp("overlap") / "projects"
    for kind in ("single", "zero2"):
        shutil.copytree(FIXTURES / kind / "run", root / kind / "run", symlinks=True)
    return root


def _targets(run: Path) -> dict[str, tuple[Path, str]]:
    """Each place a user could name that overlaps `run`, and the words its refusal uses."""
    return {
        "the run": (run, f"is the run {run}"),
        "a checkpoint": (run / CHECKPOINTS / STEP, f"is the checkpoint {run / CHECKPOINTS / STEP}"),
        "the last link": (run / CHECKPOINTS / LAST, "is the checkpoint"),
        "checkpoints/": (run / CHECKPOINTS, f"is the checkpoints folder {run / CHECKPOINTS}"),
        "a new folder inside the run": (run / "exports" / "model", f"lies inside the run {run}"),
        "the run's parent": (run.parent, f"contains the run {run}"),
    }


def _commands(runs: Path) -> dict[str, tuple[Path, callable]]:
    """command -> (the run it reads, its arguments for an output path)."""
    single, zero = runs / "single" / "run", runs / "zero2" / "run"
    return {
        "export": (single, lambda out: ["checkpoint", "export", str(single), "--output", str(out)]),
        "eval": (single, lambda out: ["eval", str(single), "--output", str(out), "--device", "cpu"]),
        "consolidate": (zero, lambda out: ["checkpoint", "consolidate", str(zero / CHECKPOINTS / STEP), "--output", str(out)]),
        "synth": (single, lambda out: ["dataset", "synth", str(out), "--episodes", "1", "--steps-per-episode", "4"]),
    }


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("command", ["export", "eval", "consolidate", "synth"])
def test_an_output_that_is_inside_or_contains_a_run_is_refused_and_the_run_is_unchanged(runs, command, force):
    run, args = _commands(runs)[command]
    before = tree(runs)
    for name, (target, words) in _targets(run).items():
        result = run_cli_in_process(args(target) + (["--force"] if force else []))
        refused(result, f"{target} {words}", OVERLAP)
        assert "--force" not in result.stderr, result.stderr  # never taught as the way through
        assert tree(runs) == before, f"{command} to {name} changed the runs"
    assert os.readlink(run / CHECKPOINTS / LAST) == STEP


def test_consolidate_into_a_file_inside_a_checkpoint_is_refused_but_its_own_default_place_stays_allowed(runs, tmp_path):
    zero = tmp_path / "zero2"
    shutil.copytree(runs / "zero2" / "run", zero, symlinks=True)
    ckpt = zero / CHECKPOINTS / STEP
    before = tree(zero)
    for out in (ckpt / "x.safetensors", zero / "model.safetensors", ckpt / MODEL_WEIGHTS):
        for force in ([], ["--force"]):
            refused(run_cli_in_process(["checkpoint", "consolidate", str(ckpt), "--output", str(out), *force]), OVERLAP)
    assert tree(zero) == before
    # Without --output the weights go into the checkpoint itself, listed in its manifest: the documented place.
    done = run_cli_in_process(["checkpoint", "consolidate", str(ckpt)])
    assert done.returncode == 0, done.stderr
    assert (ckpt / MODEL_WEIGHTS).is_file() and MODEL_WEIGHTS in json.loads((ckpt / "manifest.json").read_text())["files"]


def test_a_symlink_to_a_run_is_refused_as_the_run(runs, tmp_path):
    link = tmp_path / "looks_new"
    os.symlink(runs / "single" / "run", link)
    before = tree(runs)
    _, args = _commands(runs)["export"]
    refused(run_cli_in_process(args(link) + ["--force"]), f"{link} is the run", OVERLAP)
    refused(run_cli_in_process(args(link / "sub") + ["--force"]), f"{link / 'sub'} lies inside the run", OVERLAP)
    assert tree(runs) == before and link.is_symlink()


def test_a_used_target_is_refused_without_teaching_force_and_force_does_not_replace_what_opentau_did_not_write(runs, tmp_path):
    used = tmp_path / "mine"
    used.mkdir()
    (used / "notes.txt").write_text("keep me")
    for command, (_, args) in _commands(runs).items():
        plain = run_cli_in_process(args(used))
        refused(plain, f"{used} already exists and is not empty: choose a new path.")
        assert "--force" not in plain.stderr
        refused(run_cli_in_process(args(used) + ["--force"]), f"{used} already exists and was not written by",
                "--force replaces only an earlier output of the same command")
        assert [p.name for p in used.iterdir()] == ["notes.txt"] and (used / "notes.txt").read_text() == "keep me", command


def test_force_replaces_an_earlier_output_of_the_same_command_only(runs, tmp_path):
    """dataset synth and consolidate write their outputs with the marker; each --force replaces its own, not the
    other's, and a plain second run names --force as the way to replace that earlier output."""
    zero_ckpt = runs / "zero2" / "run" / CHECKPOINTS / STEP
    data, weights = tmp_path / "data", tmp_path / "weights"
    synth = ["dataset", "synth", str(data), "--episodes", "1", "--steps-per-episode", "4"]
    consolidate = ["checkpoint", "consolidate", str(zero_ckpt), "--output", str(weights)]
    assert run_cli_in_process(synth).returncode == 0
    assert run_cli_in_process(consolidate).returncode == 0
    assert json.loads((data / MARKER).read_text())["command"] == "dataset synth"
    assert json.loads((weights / MARKER).read_text())["command"] == "checkpoint consolidate"
    before = tree(tmp_path)

    refused(run_cli_in_process(synth), f"{data} already exists and is not empty: choose a new path, or pass --force to "
                                       f"replace this earlier output of `opentau dataset synth`.")
    refused(run_cli_in_process(["dataset", "synth", str(weights), "--force"]),
            f"{weights} already exists and was not written by `opentau dataset synth`")
    refused(run_cli_in_process(["checkpoint", "consolidate", str(zero_ckpt), "--output", str(data), "--force"]),
            f"{data} already exists and was not written by `opentau checkpoint consolidate`")
    assert tree(tmp_path) == before

    again = run_cli_in_process([*synth[:3], "--episodes", "2", "--steps-per-episode", "4", "--force"])
    assert again.returncode == 0, again.stderr
    assert json.loads((data / "meta" / "info.json").read_text())["total_episodes"] == 2
    assert run_cli_in_process([*consolidate, "--dtype", "bf16", "--force"]).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "weights"]  # no temp sibling left


def test_force_replaces_a_single_safetensors_file_only_when_opentau_consolidate_wrote_it(runs, tmp_path):
    from safetensors.torch import save_file
    import torch

    zero_ckpt = runs / "zero2" / "run" / CHECKPOINTS / STEP
    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": torch.ones(2)}, theirs, metadata={"format": "pt"})
    kept = theirs.read_bytes()
    refused(run_cli_in_process(["checkpoint", "consolidate", str(zero_ckpt), "--output", str(theirs), "--force"]),
            f"{theirs} already exists and was not written by `opentau checkpoint consolidate`")
    assert theirs.read_bytes() == kept

    ours = tmp_path / "ours.safetensors"
    args = ["checkpoint", "consolidate", str(zero_ckpt), "--output", str(ours)]
    assert run_cli_in_process(args).returncode == 0
    refused(run_cli_in_process(args), "or pass --force to replace this earlier output of `opentau checkpoint consolidate`")
    assert run_cli_in_process([*args, "--dtype", "bf16", "--force"]).returncode == 0


def test_export_and_eval_replace_only_their_own_earlier_output_and_never_the_model_they_read(runs, tmp_path):
    single = runs / "single" / "run"
    model, report = tmp_path / "model", tmp_path / "report"
    export = ["checkpoint", "export", str(single), "--output"]
    evaluate = ["eval", str(single), "--episodes", "0", "--stride", "25", "--plot-episodes", "0", "--device", "cpu", "--output"]
    assert run_cli_in_process([*export, str(model)]).returncode == 0
    assert run_cli_in_process([*evaluate, str(report)]).returncode == 0
    assert json.loads((model / MARKER).read_text())["command"] == "checkpoint export"
    assert json.loads((report / MARKER).read_text())["command"] == "eval"
    before = tree(tmp_path)

    refused(run_cli_in_process([*export, str(report), "--force"]),
            f"{report} already exists and was not written by `opentau checkpoint export`")
    refused(run_cli_in_process([*evaluate, str(model), "--force"]), f"{model} already exists and was not written by `opentau eval`")
    refused(run_cli_in_process([*export, str(model)]), "or pass --force to replace this earlier output of `opentau checkpoint export`")
    # eval of the exported model: its output must not be, hold or lie inside the model it reads
    of_model = ["eval", str(model), "--episodes", "0", "--stride", "25", "--plot-episodes", "0", "--device", "cpu", "--output"]
    for out in (model, model / "eval", tmp_path):
        for force in ([], ["--force"]):
            refused(run_cli_in_process([*of_model, str(out), *force]), f"{out} overlaps {model}, which this command reads")
    assert tree(tmp_path) == before

    forced = run_cli_in_process([*export, str(model), "--layout", "openpi", "--force"])
    assert forced.returncode == 0, forced.stderr
    assert list(model.glob("assets/*/norm_stats.json")) and sorted(p.name for p in tmp_path.iterdir()) == ["model", "report"]


def test_folders_merely_named_like_a_runs_are_no_runs_and_take_outputs(tmp_path):
    """A user's own `checkpoints/` folder of exports (no step directories, no `last`) is no run's: outputs go there."""
    mine = tmp_path / CHECKPOINTS
    (mine / "older_export").mkdir(parents=True)
    made = run_cli_in_process(["dataset", "synth", str(mine / "reach"), "--episodes", "1", "--steps-per-episode", "4"])
    assert made.returncode == 0, made.stderr
    assert (mine / "reach" / "meta" / "info.json").is_file()
