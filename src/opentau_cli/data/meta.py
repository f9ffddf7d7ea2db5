"""Reading a LeRobot dataset's meta files (v2.1 and v3.0 layouts) into one plain description."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from opentau_cli.errors import UserError

IMAGE_DTYPES = ("image", "video")


@dataclass
class EpisodeMeta:
    index: int
    length: int
    tasks: list[str] = field(default_factory=list)
    # v3.0 only: where the episode lives inside the shared files.
    data_file: tuple[int, int] | None = None  # (chunk_index, file_index)
    video_files: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # key -> (chunk, file, from_timestamp)
    video_ends: dict[str, float] = field(default_factory=dict)  # key -> to_timestamp, when given
    rows: tuple[int, int] | None = None  # (dataset_from_index, dataset_to_index), when given
    stats: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # per-episode stats when the dataset has them


@dataclass
class DatasetMeta:
    """Everything the reader needs from `meta/`; no data file is opened."""

    root: Path
    info: dict
    version: str  # "v2.1" or "v3.0" (v2.0 reads as v2.1)
    episodes: dict[int, EpisodeMeta]
    tasks: dict[int, str]
    stats: dict[str, dict[str, np.ndarray]] | None  # meta/stats.json, when present

    @property
    def features(self) -> dict[str, dict]:
        return self.info.get("features", {})

    @property
    def fps(self) -> float:
        return float(self.info.get("fps", 30))

    @property
    def camera_features(self) -> list[str]:
        """Image and video features, in info.json order."""
        return [k for k, f in self.features.items() if f.get("dtype") in IMAGE_DTYPES]

    @property
    def video_features(self) -> list[str]:
        return [k for k, f in self.features.items() if f.get("dtype") == "video"]

    def width(self, key: str) -> int:
        """Flat width of a vector feature from its declared shape."""
        return int(np.prod(self.features[key].get("shape", [1])))

    def data_path(self, ep: EpisodeMeta) -> Path:
        tmpl = self.info["data_path"]
        if self.version == "v3.0":
            chunk, file = ep.data_file if ep.data_file else (0, 0)
            return self.root / tmpl.format(chunk_index=chunk, file_index=file)
        chunk = ep.index // int(self.info.get("chunks_size", 1000))
        return self.root / tmpl.format(episode_chunk=chunk, episode_index=ep.index)

    def video_path(self, ep: EpisodeMeta, key: str) -> tuple[Path, float]:
        """The mp4 holding this episode's frames of `key`, and the episode's start time inside it."""
        tmpl = self.info.get("video_path")
        if not tmpl:
            raise UserError(f"{self.root / 'meta/info.json'} has video feature '{key}' but no 'video_path'.")
        if self.version == "v3.0":
            if key not in ep.video_files:
                raise UserError(f"{self.root / 'meta/episodes'} does not say which file holds episode {ep.index} of video '{key}'.")
            chunk, file, start = ep.video_files[key]
            return self.root / tmpl.format(video_key=key, chunk_index=chunk, file_index=file), start
        chunk = ep.index // int(self.info.get("chunks_size", 1000))
        return self.root / tmpl.format(episode_chunk=chunk, video_key=key, episode_index=ep.index), 0.0


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is missing.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}.") from None


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path} is missing.") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path} line {n} is not valid JSON: {e}.") from None
    return rows


def read_info(root: Path) -> dict:
    """meta/info.json, with a message that says what a LeRobot dataset looks like when it is missing."""
    path = Path(root) / "meta" / "info.json"
    if not path.is_file():
        raise UserError(f"{path} is missing: '{root}' is not a LeRobot dataset (expected meta/info.json, meta/episodes, data/).")
    info = read_json(path)
    for key in ("features", "data_path"):
        if key not in info:
            raise UserError(f"{path} has no '{key}'.")
    return info


def layout_version(info: dict, root: Path) -> str:
    version = str(info.get("codebase_version", "v2.1"))
    if version.startswith("v3"):
        return "v3.0"
    if version.startswith("v2"):
        return "v2.1"
    raise UserError(f"{Path(root) / 'meta/info.json'} has codebase_version '{version}'; opentau reads LeRobot v2.x and v3.0.")


def _stats_arrays(stats: dict) -> dict[str, dict[str, np.ndarray]]:
    return {
        feat: {name: np.asarray(val, dtype=np.float64) for name, val in s.items() if name in ("mean", "std", "min", "max", "q01", "q99", "count")}
        for feat, s in stats.items()
        if isinstance(s, dict)
    }


def read_meta(root: str | Path) -> DatasetMeta:
    root = Path(root)
    info = read_info(root)
    version = layout_version(info, root)
    meta_dir = root / "meta"
    stats_path = meta_dir / "stats.json"
    stats = _stats_arrays(read_json(stats_path)) if stats_path.is_file() else None
    if version == "v3.0":
        episodes, tasks = _read_v3_episodes(root), _read_v3_tasks(root)
    else:
        episodes, tasks = _read_v2_episodes(root), _read_v2_tasks(root)
    if not episodes:
        raise UserError(f"{root / 'meta'} lists no episodes.")
    return DatasetMeta(root=root, info=info, version=version, episodes=episodes, tasks=tasks, stats=stats)


def _read_v2_episodes(root: Path) -> dict[int, EpisodeMeta]:
    episodes = {}
    for row in read_jsonl(root / "meta" / "episodes.jsonl"):
        ep = int(row["episode_index"])
        episodes[ep] = EpisodeMeta(index=ep, length=int(row["length"]), tasks=list(row.get("tasks", [])))
    stats_path = root / "meta" / "episodes_stats.jsonl"
    if stats_path.is_file():
        for row in read_jsonl(stats_path):
            ep = int(row["episode_index"])
            if ep in episodes:
                episodes[ep].stats = _stats_arrays(row.get("stats", {}))
    return episodes


def _read_v2_tasks(root: Path) -> dict[int, str]:
    path = root / "meta" / "tasks.jsonl"
    if not path.is_file():
        return {}
    return {int(r["task_index"]): str(r["task"]) for r in read_jsonl(path)}


def _read_parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except FileNotFoundError:
        raise UserError(f"{path} is missing.") from None
    except Exception as e:  # pyarrow raises ArrowInvalid & co. for damaged files
        raise UserError(f"{path} is not a readable parquet file: {e}.") from None


def _read_v3_episodes(root: Path) -> dict[int, EpisodeMeta]:
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise UserError(f"{root / 'meta/episodes'} has no chunk-XXX/file-XXX.parquet (LeRobot v3.0 layout).")
    episodes = {}
    for path in files:
        for row in _read_parquet(path).to_pylist():
            ep = int(row["episode_index"])
            data_file = (int(row.get("data/chunk_index", 0)), int(row.get("data/file_index", 0)))
            videos, ends, stats = {}, {}, {}
            for col, val in row.items():
                parts = col.split("/")
                if parts[0] == "videos" and len(parts) == 3 and parts[2] == "chunk_index":
                    key = parts[1]
                    videos[key] = (int(val), int(row[f"videos/{key}/file_index"]), float(row.get(f"videos/{key}/from_timestamp", 0.0)))
                    if row.get(f"videos/{key}/to_timestamp") is not None:
                        ends[key] = float(row[f"videos/{key}/to_timestamp"])
                elif parts[0] == "stats" and len(parts) == 3 and val is not None:
                    stats.setdefault(parts[1], {})[parts[2]] = val
            has_rows = row.get("dataset_from_index") is not None and row.get("dataset_to_index") is not None
            episodes[ep] = EpisodeMeta(
                index=ep, length=int(row["length"]), tasks=list(row.get("tasks") or []), data_file=data_file,
                video_files=videos, video_ends=ends, stats=_stats_arrays(stats),
                rows=(int(row["dataset_from_index"]), int(row["dataset_to_index"])) if has_rows else None,
            )
    return episodes


def _read_v3_tasks(root: Path) -> dict[int, str]:
    path = root / "meta" / "tasks.parquet"
    if not path.is_file():
        return {}
    table = _read_parquet(path)
    # LeRobot writes it from pandas with the task text as the index: the column is then '__index_level_0__' or 'task'.
    text_col = next((c for c in ("task", "__index_level_0__") if c in table.column_names), None)
    if text_col is None or "task_index" not in table.column_names:
        raise UserError(f"{path} needs columns 'task_index' and 'task'.")
    return {int(i): str(t) for i, t in zip(table.column("task_index").to_pylist(), table.column(text_col).to_pylist())}


SLOT_RE = re.compile(r"^camera(\d+)$")


def camera_slots(meta: DatasetMeta, camera_keys: dict[str, str], num_cameras: int, what: str = "dataset.camera_keys") -> list[str | None]:
    """Dataset feature feeding each camera slot (None = slot padded). Raises UserError on a bad mapping (`what` is
    the config key of the mapping, for the message)."""
    slots: list[str | None] = [None] * num_cameras
    if not camera_keys:
        cams = meta.camera_features
        if len(cams) > num_cameras:
            raise UserError(
                f"the dataset has {len(cams)} cameras ({', '.join(cams)}) but dataset.num_cameras is {num_cameras}: "
                f"raise dataset.num_cameras or choose cameras with {what}."
            )
        slots[: len(cams)] = cams
        return slots
    for feature, slot in camera_keys.items():
        m = SLOT_RE.match(slot)
        if not m or int(m.group(1)) >= num_cameras:
            raise UserError(f"{what} maps '{feature}' to '{slot}'; slots are camera0..camera{num_cameras - 1}.")
        if feature not in meta.features:
            raise UserError(f"{what} names '{feature}', which is not a feature in {meta.root / 'meta/info.json'}.")
        if meta.features[feature].get("dtype") not in ("image", "video"):
            raise UserError(f"{what} names '{feature}', which is not an image or video feature.")
        slots[int(m.group(1))] = feature
    return slots
