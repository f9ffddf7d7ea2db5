"""Bad datasets and bad mappings: one clear error naming the file or key, exit 2 from the CLI, nothing half-done."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import EXAMPLES, run_cli
from opentau_cli.config.load import load_config
from opentau_cli.data import BatchStream, LeRobotDataset, ResumableSampler, check_dataset, write_synth
from opentau_cli.errors import UserError

pytestmark = [pytest.mark.full, pytest.mark.timeout(300)]  # a hung data worker fails the test instead of stalling CI

KW = dict(chunk_size=4, image_resolution=(16, 16), num_cameras=1)
TINY = str(EXAMPLES / "pi05_tiny_config.json")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("synth") / "ds", episodes=2, steps_per_episode=6, cameras=1, seed=3)


@pytest.fixture
def copy(good, tmp_path):
    return shutil.copytree(good, tmp_path / "ds")


def g1_without_videos(tmp_path, g1):
    """The g1 dataset's meta and data, videos left out (the real files are read-only)."""
    root = tmp_path / "g1"
    shutil.copytree(g1 / "meta", root / "meta")
    shutil.copytree(g1 / "data", root / "data")
    return root


def no_pyav_env(tmp_path) -> dict:
    """A PYTHONPATH entry whose `av` package fails to import, as on a machine without the video extra."""
    shim = tmp_path / "no_av" / "av"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('PyAV is not installed')\n")
    return {"PYTHONPATH": str(shim.parent)}


def validate_cli(root, *extra, cwd):
    return run_cli(["config", "validate", TINY, f"--dataset.root={root}", f"--output_dir={cwd / 'out'}", *extra], cwd=cwd)


def test_missing_info_json_is_named_by_reader_check_and_cli(copy, tmp_path):
    (copy / "meta" / "info.json").unlink()
    with pytest.raises(UserError, match=r"meta/info.json is missing"):
        LeRobotDataset(copy, **KW)
    cfg = load_config(TINY, [f"--dataset.root={copy}"])
    assert any("meta/info.json is missing" in e for e in check_dataset(cfg))
    for args in (["dataset", "info", str(copy)],):
        r = run_cli(args, cwd=tmp_path)
        assert r.returncode == 2 and "meta/info.json is missing" in r.stderr and "Traceback" not in r.stderr
    r = validate_cli(copy, cwd=tmp_path)
    assert r.returncode == 2 and "meta/info.json is missing" in r.stderr and "Traceback" not in r.stderr


def test_action_wider_than_max_action_dim_fails_validation_naming_the_key(tmp_path, g1):
    r = validate_cli(g1, "--policy.max_state_dim=32", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "'action' is 26 wide but policy.max_action_dim is 8" in r.stderr
    assert "observation.state" not in r.stderr  # max_state_dim=32 is wide enough
    assert not (tmp_path / "out").exists()


def test_mapped_feature_missing_from_info_json_fails_validation_with_a_suggestion(good, tmp_path):
    r = validate_cli(good, "--dataset.state_key=observation.stat", cwd=tmp_path)
    assert r.returncode == 2 and "dataset.state_key 'observation.stat' is not a feature" in r.stderr
    assert "did you mean 'observation.state'" in r.stderr
    cfg = load_config(TINY, [f"--dataset.root={good}", '--dataset.camera_keys={"observation.images.side": "camera0"}'])
    assert any("'observation.images.side'" in e for e in check_dataset(cfg))


def test_column_named_by_the_mapping_but_missing_in_the_data_names_file_and_key(copy):
    path = copy / "data" / "chunk-000" / "episode_000001.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["action"]), path)
    with pytest.raises(UserError, match=r"episode_000001.parquet has no column 'action'"):
        LeRobotDataset(copy, **KW)
    r = run_cli(["dataset", "info", str(copy), "--verify"], cwd=copy.parent)
    assert r.returncode == 2 and "episode_000001.parquet has no column 'action'" in r.stderr and "Traceback" not in r.stderr


def test_corrupt_image_bytes_raise_a_user_error_naming_file_episode_and_frame(copy):
    path = copy / "data" / "chunk-000" / "episode_000001.parquet"
    table = pq.read_table(path)
    key = "observation.images.top"
    cells = table.column(key).to_pylist()
    cells[2] = {"bytes": b"\x89PNG\r\n\x1a\nnot really a png", "path": None}
    pq.write_table(table.set_column(table.schema.get_field_index(key), key, pa.array(cells, table.schema.field(key).type)), path)
    ds = LeRobotDataset(copy, **KW)
    ds[7]  # episode 1 frame 1 is fine
    with pytest.raises(UserError, match=r"corrupt image in .*episode_000001.parquet column 'observation.images.top', episode 1 frame 2"):
        ds[8]
    # The same error comes out of a worker process as one plain line.
    stream = BatchStream(ds, ResumableSampler(len(ds), seed=0, shuffle=False), 12, num_workers=1)
    with pytest.raises(UserError) as err:
        next(stream)
    stream.close()
    assert str(err.value).startswith("corrupt image in ") and "Traceback" not in str(err.value)
    r = run_cli(["dataset", "info", str(copy), "--verify"], cwd=copy.parent)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "corrupt image in " in r.stderr and "episode_000001.parquet column 'observation.images.top', episode 1 frame 2" in r.stderr


def test_missing_video_file_names_the_file(tmp_path, g1):
    import av  # noqa: F401  (a dev dependency: missing, the test fails)
    root = g1_without_videos(tmp_path, g1)
    ds = LeRobotDataset(root, [1], chunk_size=4, image_resolution=(16, 16), num_cameras=1)
    with pytest.raises(UserError, match=r"video file .*observation.images.cam_high/episode_000001.mp4 is missing"):
        ds[0]


def test_video_dataset_without_pyav_fails_validation_and_reading(tmp_path, monkeypatch, g1):
    r = run_cli(["config", "validate", TINY, f"--dataset.root={g1}", "--policy.max_state_dim=26", "--policy.max_action_dim=26",
                 f"--output_dir={tmp_path / 'out'}"], cwd=tmp_path, env=no_pyav_env(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "observation.images.cam_high are mp4 video, which needs PyAV" in r.stderr and "opentau-cli[video]" in r.stderr
    import builtins

    real_import = builtins.__import__

    def no_av(name, *a, **kw):
        if name == "av":
            raise ImportError("no av")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_av)
    ds = LeRobotDataset(g1, [0], chunk_size=4, image_resolution=(16, 16), num_cameras=1)
    with pytest.raises(UserError, match=r"needs PyAV"):
        ds[0]


def test_more_cameras_than_slots_without_a_mapping_is_refused(tmp_path):
    root = write_synth(tmp_path / "two", episodes=1, steps_per_episode=3, cameras=2)
    no_val = ["--validation.val_split=0", "--validation.val_freq=0"]  # one episode: nothing to hold out
    cfg = load_config(TINY, [f"--dataset.root={root}", *no_val])
    assert any("has 2 cameras" in e and "dataset.num_cameras is 1" in e for e in check_dataset(cfg))
    cfg = load_config(TINY, [f"--dataset.root={root}", *no_val, '--dataset.camera_keys={"observation.images.front": "camera0"}'])
    assert check_dataset(cfg) == []


def test_synth_refuses_a_non_empty_directory_and_keeps_its_files(good, tmp_path):
    r = run_cli(["dataset", "synth", str(good)], cwd=tmp_path)
    assert r.returncode == 2 and "not empty" in r.stderr
    assert json.loads((good / "meta" / "info.json").read_text())["total_episodes"] == 2


def test_checking_the_demo_before_it_exists_writes_nothing_and_still_checks_widths(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path / "cache"))
    assert check_dataset(load_config(TINY, [])) == []
    errors = check_dataset(load_config(TINY, ["--policy.max_action_dim=1"]))
    assert len(errors) == 1 and "'action' is 2 wide but policy.max_action_dim is 1" in errors[0]
    assert not (tmp_path / "cache").exists()


def test_rows_wider_than_their_declared_shape_are_refused_when_the_data_is_built(copy, tmp_path):
    """The widths against policy.max_*_dim are checked from meta/info.json before launch; the data must then match it."""
    from opentau_cli.data import build_data

    info_path = copy / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.state"]["shape"] = [3]  # the rows hold 4 numbers
    info_path.write_text(json.dumps(info))
    cfg = load_config(TINY, [f"--dataset.root={copy}", "--validation.val_split=0", "--validation.val_freq=0"], environ={})
    assert check_dataset(cfg) == []
    with pytest.raises(UserError, match=r"'observation.state' rows are 4 wide but meta/info.json declares 3"):
        build_data(cfg)


def test_episodes_of_the_demo_are_checked_before_it_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path / "cache"))
    assert check_dataset(load_config(TINY, ["--dataset.episodes=[0,39]"])) == []
    errors = check_dataset(load_config(TINY, ["--dataset.episodes=[0,40]"]))
    assert len(errors) == 1 and "dataset.episodes [40] are not in" in errors[0] and "(it has 40 episodes)" in errors[0]
    assert not (tmp_path / "cache").exists()
