"""A small, learnable LeRobot-format dataset written offline: 2-D point reaching with the target drawn in the image.

Each episode: a blue dot (the robot) starts near the centre and moves in a straight line at constant speed toward a
red target dot at one of 4 compass points, covering 80% of the way by the last frame. state = (x, y, vx, vy);
action = the next displacement (dx, dy), the same for the whole episode. The first frame's action is only knowable
from the image (where the target is); after that the velocity in the state agrees with it. Deliberately easy: on the
demo, pi05_tiny (lr 1e-3, batch 8, 250 CPU steps) lowered the flow-matching loss by ~90% and its sampled actions on
held-out episodes had ~5x lower error than the mean action. (Targets anywhere, or 8 directions, or fewer frames per
target, left a tiny policy no better than the mean on held-out episodes in that budget.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from opentau_cli.config.model import DEMO_DATASET
from opentau_cli.data.images import encode_png
from opentau_cli.data.stats import feature_stats
from opentau_cli.errors import UserError
from opentau_cli.store.outputs import check_target, publishing, writable_parent

SYNTH_COMMAND = "dataset synth"  # names its outputs (opentau_cli/store/outputs.py): --force replaces only those
DEMO_VERSION = "v3"  # bump whenever the generated data changes, so old caches are not reused
DEMO_SETTINGS = dict(episodes=40, steps_per_episode=50, cameras=1, fmt="v2.1", seed=0)
CAMERA_NAMES = ["top", "front", "side", "wrist"]
IMAGE_SIZE = 64
FPS = 10
VIDEO_CODEC = "libx264"
COVERED = 0.8  # share of the way to the target travelled by the end of the episode
TARGET_DIRECTIONS, TARGET_RADIUS = 4, 0.4  # targets sit at one of 4 compass points around the centre
TASK = "Move the blue dot to the red target."


def camera_name(k: int) -> str:
    return CAMERA_NAMES[k] if k < len(CAMERA_NAMES) else f"cam{k}"


def _draw(pos: np.ndarray, target: np.ndarray, camera: int) -> np.ndarray:
    """Render the scene for one camera: camera k>0 sees it mirrored/rotated so views differ but agree on the task."""
    n = IMAGE_SIZE
    img = np.full((n, n, 3), 235, dtype=np.uint8)
    yy, xx = np.mgrid[0:n, 0:n]
    for (x, y), color, radius in ((target, (220, 30, 30), 7), (pos, (30, 60, 220), 5)):
        if camera % 2 == 1:
            x = 1.0 - x
        if camera >= 2:
            x, y = y, x
        cx, cy = x * (n - 1), (1.0 - y) * (n - 1)
        img[(xx - cx) ** 2 + (yy - cy) ** 2 <= radius**2] = color
    return img


def _episode(rng: np.random.Generator, steps: int):
    """One episode of states, actions, and the (position, target) drawn at each frame."""
    pos = 0.5 + rng.uniform(-0.08, 0.08, size=2)
    angle = 2 * np.pi * rng.integers(TARGET_DIRECTIONS) / TARGET_DIRECTIONS
    target = 0.5 + TARGET_RADIUS * np.array([np.cos(angle), np.sin(angle)])
    step = COVERED * (target - pos) / steps  # straight at constant speed toward the target
    vel = np.zeros(2)
    states, actions, scenes = [], [], []
    for _ in range(steps):
        states.append(np.concatenate([pos, vel]))
        actions.append(step.copy())
        scenes.append((pos.copy(), target.copy()))
        vel = step
        pos = pos + step
    return np.array(states, np.float32), np.array(actions, np.float32), scenes


def _features(cameras: int, video: bool = False) -> dict:
    camera = {"dtype": "video" if video else "image", "shape": [IMAGE_SIZE, IMAGE_SIZE, 3], "names": ["height", "width", "channel"]}
    if video:
        camera["info"] = {"video.fps": FPS, "video.codec": VIDEO_CODEC, "video.pix_fmt": "yuv420p", "has_audio": False}
    feats = {f"observation.images.{camera_name(k)}": dict(camera) for k in range(cameras)}
    feats["observation.state"] = {"dtype": "float32", "shape": [4], "names": [["x", "y", "vx", "vy"]]}
    feats["action"] = {"dtype": "float32", "shape": [2], "names": [["dx", "dy"]]}
    for name, dtype in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"), ("index", "int64"), ("task_index", "int64")):
        feats[name] = {"dtype": dtype, "shape": [1], "names": None}
    return feats


def synth_info(episodes: int, steps_per_episode: int, cameras: int, fmt: str, video: bool = False) -> dict:
    """meta/info.json of a synth dataset (also what `check_dataset` uses for @demo before it exists)."""
    info = {
        "codebase_version": fmt,
        "robot_type": "opentau_synth_point_reacher",
        "total_episodes": episodes,
        "total_frames": episodes * steps_per_episode,
        "total_tasks": 1,
        "total_videos": cameras * (episodes if fmt == "v2.1" else 1) if video else 0,
        "total_chunks": 1,
        "chunks_size": 1000,
        "fps": FPS,
        "splits": {"train": f"0:{episodes}"},
        "features": _features(cameras, video),
    }
    if fmt == "v3.0":
        info["data_path"] = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
        info["video_path"] = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4" if video else None
        info["data_files_size_in_mb"] = 100
    else:
        info["data_path"] = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
        info["video_path"] = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4" if video else None
    return info


def _episode_table(ep: int, first_index: int, states, actions, scenes, cameras: int, video: bool):
    import pyarrow as pa

    n = len(states)
    cols = {}
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for k in range(0 if video else cameras):
        cols[f"observation.images.{camera_name(k)}"] = pa.array(
            [{"bytes": encode_png(_draw(p, t, k)), "path": None} for p, t in scenes], type=image_type
        )
    cols["observation.state"] = pa.FixedSizeListArray.from_arrays(pa.array(states.reshape(-1)), 4)
    cols["action"] = pa.FixedSizeListArray.from_arrays(pa.array(actions.reshape(-1)), 2)
    cols["timestamp"] = pa.array((np.arange(n) / FPS).astype(np.float32))
    cols["frame_index"] = pa.array(np.arange(n, dtype=np.int64))
    cols["episode_index"] = pa.array(np.full(n, ep, dtype=np.int64))
    cols["index"] = pa.array(np.arange(first_index, first_index + n, dtype=np.int64))
    cols["task_index"] = pa.array(np.zeros(n, dtype=np.int64))
    return pa.table(cols)


def write_synth(
    out_dir: str | Path, *, episodes: int = 30, steps_per_episode: int = 50, cameras: int = 1, fmt: str = "v2.1", seed: int = 0,
    video: bool = False, force: bool = False,
) -> Path:
    """Write the dataset into out_dir (which must not exist or be empty, unless `force`): written whole into a hidden
    sibling and renamed into place (opentau_cli/store/outputs.py). Same arguments -> same data.

    video=True stores the cameras as mp4 (needs PyAV): one file per episode (v2.1) or one per camera holding every
    episode (v3.0, located by from_timestamp), with a keyframe every 2 frames as LeRobot encodes them.
    """
    if fmt not in ("v2.1", "v3.0"):
        raise UserError(f"--format must be v2.1 or v3.0, not '{fmt}'.")
    if episodes < 1 or steps_per_episode < 1 or cameras < 0:
        raise UserError("--episodes and --steps-per-episode must be >= 1 and --cameras >= 0.")
    target = Path(out_dir)
    check_target(target, force=force, command=SYNTH_COMMAND)
    writable_parent(target)
    if video:
        from opentau_cli.data.video import import_av

        import_av()  # fail before writing anything
    with publishing(target, force=force, command=SYNTH_COMMAND) as staging:
        _write_into(staging, episodes, steps_per_episode, cameras, fmt, seed, video)
    return target


def _write_into(out: Path, episodes: int, steps_per_episode: int, cameras: int, fmt: str, seed: int, video: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    info = synth_info(episodes, steps_per_episode, cameras, fmt, video)
    (out / "meta").mkdir(parents=True, exist_ok=True)
    tables, ep_stats, all_states, all_actions, all_scenes = [], [], [], [], []
    for ep in range(episodes):
        states, actions, scenes = _episode(rng, steps_per_episode)
        tables.append(_episode_table(ep, ep * steps_per_episode, states, actions, scenes, cameras, video))
        all_scenes.append(scenes)
        all_states.append(states)
        all_actions.append(actions)
        ep_stats.append({"observation.state": feature_stats(states), "action": feature_stats(actions)})
    stats = {"observation.state": feature_stats(np.concatenate(all_states)), "action": feature_stats(np.concatenate(all_actions))}
    (out / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    (out / "meta" / "stats.json").write_text(json.dumps(stats, indent=4))
    if fmt == "v2.1":
        for ep, table in enumerate(tables):
            path = out / info["data_path"].format(episode_chunk=0, episode_index=ep)
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, path)
        for ep, scenes in enumerate(all_scenes if video else []):
            for k in range(cameras):
                key = f"observation.images.{camera_name(k)}"
                _write_mp4(out / info["video_path"].format(episode_chunk=0, video_key=key, episode_index=ep), [_draw(p, t, k) for p, t in scenes])
        _write_jsonl(out / "meta" / "episodes.jsonl", [{"episode_index": ep, "tasks": [TASK], "length": steps_per_episode} for ep in range(episodes)])
        _write_jsonl(out / "meta" / "tasks.jsonl", [{"task_index": 0, "task": TASK}])
        _write_jsonl(out / "meta" / "episodes_stats.jsonl", [{"episode_index": ep, "stats": s} for ep, s in enumerate(ep_stats)])
    else:
        path = out / info["data_path"].format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(tables), path)
        rows = []
        for ep, s in enumerate(ep_stats):
            row = {
                "episode_index": ep, "tasks": [TASK], "length": steps_per_episode,
                "data/chunk_index": 0, "data/file_index": 0,
                "dataset_from_index": ep * steps_per_episode, "dataset_to_index": (ep + 1) * steps_per_episode,
                "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
            }
            for k in range(cameras if video else 0):
                key = f"observation.images.{camera_name(k)}"
                row.update({
                    f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": 0,
                    f"videos/{key}/from_timestamp": ep * steps_per_episode / FPS, f"videos/{key}/to_timestamp": (ep + 1) * steps_per_episode / FPS,
                })
            for feat, fs in s.items():
                for name, val in fs.items():
                    row[f"stats/{feat}/{name}"] = [float(v) for v in val]
            rows.append(row)
        ep_path = out / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
        ep_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), ep_path)
        pq.write_table(pa.table({"task_index": pa.array([0], pa.int64()), "task": [TASK]}), out / "meta" / "tasks.parquet")
        for k in range(cameras if video else 0):
            key = f"observation.images.{camera_name(k)}"
            frames = [_draw(p, t, k) for scenes in all_scenes for p, t in scenes]
            _write_mp4(out / info["video_path"].format(video_key=key, chunk_index=0, file_index=0), frames)


def _write_mp4(path: Path, frames: list[np.ndarray]) -> None:
    """Frame i at t = i / FPS; near-lossless so tests can tell neighbouring frames apart."""
    from opentau_cli.data.video import write_mp4

    write_mp4(path, frames, FPS)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def cache_dir() -> Path:
    return Path(os.environ.get("OPENTAU_CACHE_DIR") or Path.home() / ".cache" / "opentau")


def demo_root() -> Path:
    return cache_dir() / f"demo-{DEMO_VERSION}"


def ensure_demo() -> Path:
    """The @demo dataset, generated once. Written to a temp sibling and renamed, so racing ranks are safe."""
    final = demo_root()
    if (final / "meta" / "info.json").is_file():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    except OSError as e:
        raise UserError(f"cannot write the demo dataset under {final.parent} ({e.strerror}); set OPENTAU_CACHE_DIR to a writable folder.") from None
    try:
        write_synth(tmp, **DEMO_SETTINGS)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta" / "info.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def demo_info() -> dict:
    s = DEMO_SETTINGS
    return synth_info(s["episodes"], s["steps_per_episode"], s["cameras"], s["fmt"])


def resolve_dataset_root(root: str | Path) -> Path:
    """'@demo' -> the synthetic demo dataset (generated on first use); anything else is a local path."""
    if str(root) == DEMO_DATASET:
        return ensure_demo()
    return Path(root).expanduser()


# ------------------------------------------------------------------------------------------- recorded episodes
def write_v3_episodes(out: Path, episodes: list[dict], *, fps: int, robot_type: str, state_names: list[str],
                      action_names: list[str], extra_info: dict | None = None) -> None:
    """Recorded episodes as a LeRobot v3.0 dataset in `out` (a new directory): one data file, one mp4 per camera
    holding every episode (located by from_timestamp), the tasks in words, statistics; each episode's own fields
    beyond the data (e.g. its seed) go into its row of meta/episodes. An episode: {"task": str, "state": (T, S),
    "action": (T, A), "frames": {camera key: [T uint8 (H, W, 3)]}, "fields": {...}}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opentau_cli.data.video import write_mp4

    tasks = list(dict.fromkeys(ep["task"] for ep in episodes))
    cameras = list(episodes[0]["frames"])
    height, width = episodes[0]["frames"][cameras[0]][0].shape[:2]
    total = sum(len(ep["state"]) for ep in episodes)
    camera = {"dtype": "video", "shape": [height, width, 3], "names": ["height", "width", "channel"],
              "info": {"video.fps": fps, "video.codec": VIDEO_CODEC, "video.pix_fmt": "yuv420p", "has_audio": False}}
    features = {key: dict(camera) for key in cameras}
    features["observation.state"] = {"dtype": "float32", "shape": [len(state_names)], "names": [state_names]}
    features["action"] = {"dtype": "float32", "shape": [len(action_names)], "names": [action_names]}
    for name, dtype in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                        ("index", "int64"), ("task_index", "int64")):
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    info = {
        "codebase_version": "v3.0", "robot_type": robot_type, "total_episodes": len(episodes), "total_frames": total,
        "total_tasks": len(tasks), "total_videos": len(cameras), "total_chunks": 1, "chunks_size": 1000, "fps": fps,
        "splits": {"train": f"0:{len(episodes)}"}, "features": features,
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
        "data_files_size_in_mb": 100, **(extra_info or {}),
    }
    tables, rows, start = [], [], 0
    for ep_index, ep in enumerate(episodes):
        n = len(ep["state"])
        states, actions = np.asarray(ep["state"], np.float32), np.asarray(ep["action"], np.float32)
        tables.append(pa.table({
            "observation.state": pa.FixedSizeListArray.from_arrays(pa.array(states.reshape(-1)), states.shape[1]),
            "action": pa.FixedSizeListArray.from_arrays(pa.array(actions.reshape(-1)), actions.shape[1]),
            "timestamp": pa.array((np.arange(n) / fps).astype(np.float32)),
            "frame_index": pa.array(np.arange(n, dtype=np.int64)),
            "episode_index": pa.array(np.full(n, ep_index, dtype=np.int64)),
            "index": pa.array(np.arange(start, start + n, dtype=np.int64)),
            "task_index": pa.array(np.full(n, tasks.index(ep["task"]), dtype=np.int64)),
        }))
        row = {"episode_index": ep_index, "tasks": [ep["task"]], "length": n, "data/chunk_index": 0,
               "data/file_index": 0, "dataset_from_index": start, "dataset_to_index": start + n,
               "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0, **ep.get("fields", {})}
        for key in cameras:
            row.update({f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": 0,
                        f"videos/{key}/from_timestamp": start / fps, f"videos/{key}/to_timestamp": (start + n) / fps})
        for feat, values in (("observation.state", states), ("action", actions)):
            for name, val in feature_stats(values).items():
                row[f"stats/{feat}/{name}"] = [float(v) for v in val]
        rows.append(row)
        start += n
    all_states = np.concatenate([np.asarray(ep["state"], np.float32) for ep in episodes])
    all_actions = np.concatenate([np.asarray(ep["action"], np.float32) for ep in episodes])
    stats = {"observation.state": feature_stats(all_states), "action": feature_stats(all_actions)}
    (out / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    (out / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    (out / "meta" / "stats.json").write_text(json.dumps(stats, indent=4))
    data_path = out / info["data_path"].format(chunk_index=0, file_index=0)
    data_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.concat_tables(tables), data_path)
    pq.write_table(pa.Table.from_pylist(rows), out / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    pq.write_table(pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": tasks}),
                   out / "meta" / "tasks.parquet")
    for key in cameras:
        write_mp4(out / info["video_path"].format(video_key=key, chunk_index=0, file_index=0),
                  [frame for ep in episodes for frame in ep["frames"][key]], fps)
