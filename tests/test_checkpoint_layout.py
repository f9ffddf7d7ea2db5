"""The checkpoint layout: names that are Accelerate's are Accelerate's, and every name opentau writes reads back."""

from __future__ import annotations

import os
from pathlib import Path

from accelerate.utils import constants

import pytest

from opentau_cli.store import layout

pytestmark = pytest.mark.quick


def test_the_names_of_save_state_files_are_accelerates_own():
    assert layout.MODEL_WEIGHTS == constants.SAFE_WEIGHTS_NAME
    assert layout.WEIGHTS_INDEX == constants.SAFE_WEIGHTS_INDEX_NAME
    assert layout.OPTIMIZER == f"{constants.OPTIMIZER_NAME}.bin"
    assert layout.SCHEDULER == f"{constants.SCHEDULER_NAME}.bin"
    assert layout.rank_state_file(3) == f"{constants.RNG_STATE_NAME}_3.pkl"
    assert layout.DS_TAG == constants.MODEL_NAME  # the tag Accelerate gives DeepSpeed's save_checkpoint


def test_step_dir_names_read_back_as_their_step_and_nothing_else_does():
    for step, total in ((40, 100), (7, 12_345_678)):
        assert layout.step_of(layout.step_dir_name(step, total)) == step
    for other in (layout.LAST, layout.tmp_dir(Path(), "000040", "r1").name, "notes"):
        assert layout.step_of(other) is None


def test_temp_dirs_of_saves_and_deletions_are_recognised_as_leftovers_of_their_step(tmp_path):
    saving = layout.tmp_dir(tmp_path, "000040", "20260101-120000-1")
    deleting = layout.old_dir(tmp_path, "000040", "20260101-120000-1")
    assert saving.parent == deleting.parent == tmp_path and saving.name.startswith(".") and deleting.name.startswith(".")
    assert layout.leftover_of(saving.name) == ("save", "000040")
    assert layout.leftover_of(deleting.name) == ("deletion", "000040")
    assert layout.leftover_of("000040") is None and layout.leftover_of(layout.LAST) is None


def test_last_reads_back_what_point_last_wrote_as_link_or_pointer_file(tmp_path):
    layout.point_last(tmp_path, "000010")
    layout.point_last(tmp_path, "000020")
    assert os.readlink(tmp_path / layout.LAST) == "000020" and layout.read_last(tmp_path) == "000020"
    assert sorted(p.name for p in tmp_path.iterdir()) == [layout.LAST]  # no temp link left behind
    (tmp_path / layout.LAST).unlink()
    (tmp_path / layout.LAST).write_text("000030\n")  # where symlinks are not possible
    assert layout.read_last(tmp_path) == "000030"
    (tmp_path / layout.LAST).unlink()
    assert layout.read_last(tmp_path) is None


def test_sharded_weights_are_named_like_hugging_face_shards(tmp_path):
    weights = tmp_path / layout.MODEL_WEIGHTS
    assert layout.weights_index_path(weights).name == layout.WEIGHTS_INDEX
    shard = constants.SAFE_WEIGHTS_PATTERN_NAME.format(suffix="-00002-of-00003")
    assert layout.weights_shard_path(weights, 2, 3).name == shard
