"""The LeRobot reader: both layouts, samples in the batch format, stats, and the real g1 video dataset."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from opentau_cli.config.load import load_config
from opentau_cli.data import LeRobotDataset, build_data, write_synth
from opentau_cli.data.meta import read_meta

pytestmark = [pytest.mark.quick, pytest.mark.timeout(300)]  # a hung data worker fails the test instead of stalling CI

KW = dict(chunk_size=6, image_resolution=(32, 48), num_cameras=3)


@pytest.fixture(scope="module")
def synth_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("synth")
    args = dict(episodes=3, steps_per_episode=12, cameras=2, seed=5)
    return write_synth(base / "v21", fmt="v2.1", **args), write_synth(base / "v30", fmt="v3.0", **args)


def test_v21_and_v30_layouts_load_identical_samples(synth_pair):
    a, b = (LeRobotDataset(root, **KW) for root in synth_pair)
    assert (read_meta(synth_pair[0]).version, read_meta(synth_pair[1]).version) == ("v2.1", "v3.0")
    assert len(a) == len(b) == 36 and a.episodes == b.episodes == [0, 1, 2]
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["task"] == y["task"] == "Move the blue dot to the red target."
        for key in ("images", "image_masks", "state", "actions", "action_is_pad"):
            assert torch.equal(x[key], y[key]), (i, key)
    assert a.stats == b.stats


def test_sample_has_batch_format_with_padded_chunk_and_flagged_missing_camera(synth_pair):
    ds = LeRobotDataset(synth_pair[0], [1], **KW)
    last = ds[len(ds) - 2]  # second-to-last frame of episode 1: one real action, then padding
    assert last["images"].shape == (3, 3, 32, 48) and last["images"].dtype == torch.uint8  # the device scales them
    assert last["image_masks"].tolist() == [True, True, False]
    assert torch.count_nonzero(last["images"][2]) == 0
    assert last["action_is_pad"].tolist() == [False, False, True, True, True, True]
    assert torch.equal(last["actions"][2:], last["actions"][1].expand(4, -1))  # past the end: the last action repeats
    assert ds.state_dim == 4 and ds.action_dim == 2 and last["state"].shape == (4,)
    # 64x64 into 32x48 keeps the aspect ratio: 8 black columns each side, picture in the middle.
    img = last["images"][0]
    assert torch.count_nonzero(img[:, :, :8]) == 0 and torch.count_nonzero(img[:, :, -8:]) == 0
    assert img[:, :, 8:40].float().mean() > 0.5 * 255


def test_action_chunk_is_the_next_actions_of_the_same_episode(synth_pair):
    ds = LeRobotDataset(synth_pair[0], **KW)
    table_actions = np.concatenate([ds[i]["actions"][:1].numpy() for i in range(12, 24)])
    assert np.array_equal(ds[12]["actions"].numpy(), table_actions[:6])


def test_stats_pool_episode_stats_of_the_chosen_episodes_and_match_the_data(synth_pair):
    ds = LeRobotDataset(synth_pair[0], [0, 2], **KW)
    states = np.stack([ds[i]["state"].numpy() for i in range(len(ds))]).astype(np.float64)
    assert np.allclose(ds.stats["state"]["mean"], states.mean(0), atol=1e-6)
    assert np.allclose(ds.stats["state"]["std"], states.std(0), atol=1e-6)


def test_stats_are_computed_from_the_data_when_meta_has_none(synth_pair, tmp_path):
    root = shutil.copytree(synth_pair[0], tmp_path / "nostats")
    (root / "meta" / "stats.json").unlink()
    (root / "meta" / "episodes_stats.jsonl").unlink()
    ds, ref = LeRobotDataset(root, [0, 1], **KW), LeRobotDataset(synth_pair[0], [0, 1], **KW)
    assert np.allclose(ds.stats["action"]["mean"], ref.stats["action"]["mean"], atol=1e-6)
    assert np.allclose(ds.stats["action"]["std"], ref.stats["action"]["std"], atol=1e-6)


def test_stats_come_from_stats_json_when_there_are_no_episode_stats(synth_pair, tmp_path):
    root = shutil.copytree(synth_pair[0], tmp_path / "statsjson")
    (root / "meta" / "episodes_stats.jsonl").unlink()
    stats = json.loads((root / "meta" / "stats.json").read_text())
    stats["action"]["mean"] = [5.0, -5.0]  # marked, so the test sees where the numbers came from
    (root / "meta" / "stats.json").write_text(json.dumps(stats))
    assert LeRobotDataset(root, **KW).stats["action"]["mean"] == [5.0, -5.0]


def test_jpeg_bytes_in_parquet_are_decoded(synth_pair, tmp_path):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    root = shutil.copytree(synth_pair[0], tmp_path / "jpeg")
    path, key = root / "data/chunk-000/episode_000000.parquet", "observation.images.top"
    table = pq.read_table(path)
    cells = table.column(key).to_pylist()
    for cell in cells:
        buf = io.BytesIO()
        Image.open(io.BytesIO(cell["bytes"])).save(buf, format="JPEG", quality=95)
        cell["bytes"] = buf.getvalue()
    pq.write_table(table.set_column(table.schema.get_field_index(key), key, pa.array(cells, table.schema.field(key).type)), path)
    jpeg, png = LeRobotDataset(root, [0], **KW)[4]["images"][0], LeRobotDataset(synth_pair[0], [0], **KW)[4]["images"][0]
    assert (jpeg.float() - png.float()).abs().mean() < 0.02 * 255 and not torch.equal(jpeg, png)


def test_camera_keys_map_features_to_slots(synth_pair):
    ds = LeRobotDataset(synth_pair[0], [0], **{**KW, "camera_keys": {"observation.images.front": "camera0"}})
    ref = LeRobotDataset(synth_pair[0], [0], **KW)
    s, r = ds[3], ref[3]
    assert s["image_masks"].tolist() == [True, False, False]
    assert torch.equal(s["images"][0], r["images"][1]) and not torch.equal(s["images"][0], r["images"][0])


def test_g1_video_frames_match_a_sequential_decode(g1):
    import av
    ds = LeRobotDataset(g1, [0], chunk_size=50, image_resolution=(48, 64), num_cameras=1)
    assert (len(ds), ds.state_dim, ds.action_dim, ds.fps) == (393, 26, 26, 30.0)
    with av.open(str(g1 / "videos/chunk-000/observation.images.cam_high/episode_000000.mp4")) as c:
        frames = [f.reformat(width=64, height=48, format="rgb24", interpolation="BILINEAR", threads=1).to_ndarray() for f in c.decode(video=0)]
    for i in (0, 1, 157, 64, 392, 3):  # out of order: every lookup seeks
        got = ds[i]["images"][0].permute(1, 2, 0).numpy()
        assert np.array_equal(got, frames[i]), i
    last = ds[392]
    assert last["action_is_pad"].sum() == 49 and last["task"] == "Pick up the yellow bottle on the table."


def test_g1_batch_through_build_data_with_video_workers(isolated_env, g1):
    import av  # noqa: F401  (a dev dependency: missing, the test fails)
    cfg = load_config(None, [
        f"--dataset.root={g1}", "--policy.max_state_dim=32", "--policy.max_action_dim=32", "--policy.chunk_size=10",
        "--policy.n_action_steps=10", "--policy.image_resolution=[64,64]", "--batch_size=4", "--dataset.num_workers=2",
        "--validation.val_split=0.34",
    ])
    data = build_data(cfg, rank=0, world_size=1)
    try:
        batch = next(data.stream)
        assert batch["images"].shape == (4, 1, 3, 64, 64) and batch["state"].shape == (4, 26)
        assert batch["actions"].shape == (4, 10, 26) and batch["action_is_pad"].shape == (4, 10)
        assert batch["images"].dtype == torch.uint8 and batch["images"].float().mean() > 0.05 * 255 and len(batch["task"]) == 4
        assert len(data.stats["action"]["mean"]) == 26 and data.state_dim == data.action_dim == 26
        assert len(data.train_dataset.episodes) == 2 and len(data.val_dataset.episodes) == 1
        val = next(iter(data.val_loader))
        assert val["actions"].shape == (4, 10, 26)
    finally:
        data.stream.close()


def test_video_layouts_show_the_frame_of_each_sample_including_v30_files_holding_many_episodes(tmp_path):
    import av  # noqa: F401  (a dev dependency: missing, the test fails)
    args = dict(episodes=3, steps_per_episode=8, cameras=1, seed=4)
    png = LeRobotDataset(write_synth(tmp_path / "png", **args), **KW)
    v21 = LeRobotDataset(write_synth(tmp_path / "v21", video=True, **args), **KW)
    v30 = LeRobotDataset(write_synth(tmp_path / "v30", fmt="v3.0", video=True, **args), **KW)
    assert read_meta(v30.root).episodes[2].video_files["observation.images.top"] == (0, 0, 1.6)
    truth = [png[j]["images"] for j in range(len(png))]
    for i in (0, 7, 8, 13, 23, 16, 5):  # out of order; episode starts and ends; v3.0 frames come from one shared mp4
        for ds in (v21, v30):
            got = ds[i]["images"]
            assert ds[i]["image_masks"].tolist() == [True, False, False]
            dist = {j: (got.float() - truth[j].float()).abs().mean().item() for j in range(max(0, i - 1), min(len(png), i + 2))}
            assert min(dist, key=dist.get) == i, (i, dist)  # lossy, but the nearest picture is the right frame


def test_synth_actions_move_the_dot_and_the_velocity_in_the_next_state_is_the_action(synth_pair):
    ds = LeRobotDataset(synth_pair[0], [0], chunk_size=1, image_resolution=(64, 64), num_cameras=2)
    for t in range(len(ds) - 1):
        now, nxt = ds[t], ds[t + 1]
        step = now["actions"][0]
        assert torch.allclose(nxt["state"][:2] - now["state"][:2], step, atol=1e-6)
        assert torch.allclose(nxt["state"][2:], step)
    assert torch.linalg.norm(ds[0]["actions"][0]) > 0.01  # it moves, visibly in a 64 px image


def test_a_camera_is_a_wrist_camera_when_its_feature_name_says_wrist(tmp_path):
    """openpi's rule, from the dataset's feature names: the slot fed by observation.images.wrist is flagged (no
    geometric augmentation), the others and an empty slot are not, wherever camera_keys puts it."""
    root = write_synth(tmp_path / "four", episodes=2, steps_per_episode=4, cameras=4, seed=2)
    assert [k for k in read_meta(root).features if k.startswith("observation.images.")] == [
        "observation.images.top", "observation.images.front", "observation.images.side", "observation.images.wrist"]
    every = LeRobotDataset(root, [0], chunk_size=2, image_resolution=(16, 16), num_cameras=5)[0]
    assert every["wrist_cameras"].tolist() == [False, False, False, True, False]
    moved = LeRobotDataset(root, [0], chunk_size=2, image_resolution=(16, 16), num_cameras=2,
                           camera_keys={"observation.images.wrist": "camera0", "observation.images.top": "camera1"})[0]
    assert moved["wrist_cameras"].tolist() == [True, False]
