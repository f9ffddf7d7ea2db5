"""Archives stay archives (issue #34): a checkpoint a rollback moved into `rolled_back/<time>/checkpoints/` (or any
checkpoint outside its run's checkpoints/) is exported, evaluated and consolidated elsewhere, but never resumed
(`opentau resume PATH`, `--config_path=PATH/train_config.json --resume=true`) and never written. docs/ARCHITECTURE.md,
"Run history".

One real single-process tiny run (4 steps, saves at 2 and 4), rolled back to 000002 in-process as the launcher does
it (lineage.roll_back), so 000004 lies in the archive; every command after that runs in-process. The ZeRO-2
consolidation uses the committed format-2 fixture, archived the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import EXAMPLES, run_cli, run_cli_in_process, refused, tree
from opentau_cli.store.layout import CHECKPOINTS, LAST, MANIFEST, METRICS, MODEL_WEIGHTS, ROLLED_BACK, TRAIN_CONFIG
from opentau_cli.store.lineage import roll_back

pytestmark = pytest.mark.full

TINY = str(EXAMPLES / "pi05_tiny_config.json")
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints" / "v2"
STAMP = "20261203-090000"
ARCHIVED = "was moved aside by a rollback"






@pytest.fixture(scope="module")
def rolled(tmp_path_factory) -> Path:
    """A tiny run trained to step 4 and rolled back to 000002: 000004 and its metrics lie in rolled_back/STAMP/."""
    root = tmp_path_factory.mktemp("archives")
    run = root / "run"
    trained = run_cli(["train", f"--config_path={TINY}", f"--output_dir={run}", "--steps=4", "--save_freq=2",
                       "--log_freq=1", "--validation.val_freq=0"], env={"HF_HOME": str(root / "hf_home")})
    assert trained.returncode == 0, trained.stderr[-3000:]
    roll_back(run, run / CHECKPOINTS / "000002", stamp=STAMP)
    assert (run / ROLLED_BACK / STAMP / CHECKPOINTS / "000004" / MANIFEST).is_file()
    assert os.readlink(run / CHECKPOINTS / LAST) == "000002"
    return run


def test_resuming_an_archived_checkpoint_is_refused_in_one_line_and_nothing_in_the_run_changes(rolled):
    archive = rolled / ROLLED_BACK / STAMP
    ckpt = archive / CHECKPOINTS / "000004"
    before = tree(rolled)
    for args in (["resume", str(ckpt)],
                 ["resume", str(ckpt), "--rollback=true", "--steps=6"],
                 ["resume", str(archive)],  # the archive's folder, as if it were a run
                 ["resume", str(archive / CHECKPOINTS)],
                 ["train", f"--config_path={ckpt / TRAIN_CONFIG}", "--resume=true"],
                 ["config", "validate", str(ckpt / TRAIN_CONFIG), "--resume=true"]):
        refused(run_cli_in_process(args), f"{ckpt} {ARCHIVED} of {rolled}", "an archive is never resumed or written",
                f"cp -r {ckpt} NEW_RUN/{CHECKPOINTS}/ && opentau resume NEW_RUN")
    assert tree(rolled) == before
    assert (archive / METRICS).is_file()  # the rolled-back records stay there, nothing appended


def test_the_way_back_the_refusal_names_gives_a_run_that_resumes(rolled, tmp_path):
    """What the refusal says to do: copy the checkpoint into a new run's checkpoints/ and resume that run; every
    check of `opentau resume` passes (config validate runs them without launching)."""
    ckpt = rolled / ROLLED_BACK / STAMP / CHECKPOINTS / "000004"
    new = tmp_path / "NEW_RUN"
    (new / CHECKPOINTS).mkdir(parents=True)
    shutil.copytree(ckpt, new / CHECKPOINTS / ckpt.name, symlinks=True)
    checked = run_cli_in_process(["config", "validate", str(new / CHECKPOINTS / "000004" / TRAIN_CONFIG),
                                  "--resume=true", "--steps=6"])
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_checkpoint_outside_any_checkpoints_folder_is_not_resumed(rolled, tmp_path):
    loose = tmp_path / "loose"
    shutil.copytree(rolled / CHECKPOINTS / "000002", loose)
    before = tree(tmp_path)
    refused(run_cli_in_process(["resume", str(loose)]), f"{loose} is not in a run's {CHECKPOINTS}/ folder",
            f"cp -r {loose} NEW_RUN/{CHECKPOINTS}/")
    assert tree(tmp_path) == before


def test_an_archived_checkpoint_still_exports_and_evaluates_and_nothing_is_written_into_the_archive(rolled, tmp_path):
    ckpt = rolled / ROLLED_BACK / STAMP / CHECKPOINTS / "000004"
    before = tree(rolled)
    exported = run_cli_in_process(["checkpoint", "export", str(ckpt), "--output", str(tmp_path / "model")])
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "model" / MODEL_WEIGHTS).is_file()
    evaluated = run_cli_in_process(["eval", str(ckpt), "--output", str(tmp_path / "eval"), "--episodes", "0",
                                    "--stride", "25", "--plot-episodes", "0", "--device", "cpu"])
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["samples"] > 0
    for out in (ckpt / "model", rolled / ROLLED_BACK / STAMP / "model", rolled / ROLLED_BACK):
        for force in ([], ["--force"]):
            refused(run_cli_in_process(["checkpoint", "export", str(ckpt), "--output", str(out), *force]),
                    "an output never")
    assert tree(rolled) == before


def test_an_archived_deepspeed_checkpoint_consolidates_only_elsewhere(tmp_path):
    run = tmp_path / "zero2"
    shutil.copytree(FIXTURES / "zero2" / "run", run, symlinks=True)
    ckpt = run / ROLLED_BACK / STAMP / CHECKPOINTS / "000002"
    ckpt.parent.mkdir(parents=True)
    os.replace(run / CHECKPOINTS / "000002", ckpt)  # as a rollback moves it (lineage.roll_back renames)
    before = tree(run)
    refused(run_cli_in_process(["checkpoint", "consolidate", str(ckpt)]), f"{ckpt} {ARCHIVED}", "--output")
    refused(run_cli_in_process(["checkpoint", "consolidate", str(ckpt), "--force"]), f"{ckpt} {ARCHIVED}")
    assert tree(run) == before
    done = run_cli_in_process(["checkpoint", "consolidate", str(ckpt), "--output", str(tmp_path / "weights")])
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "weights" / MODEL_WEIGHTS).is_file() and tree(run) == before
