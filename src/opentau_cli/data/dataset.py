"""`LeRobotDataset`: one sample per frame, in the batch format of docs/ARCHITECTURE.md ("Batch format") (without the batch dim)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from PIL import UnidentifiedImageError

from opentau_cli.data.images import decode_image, resize_with_pad
from opentau_cli.data.meta import EpisodeMeta, camera_slots, read_meta
from opentau_cli.data.files import LOCAL
from opentau_cli.data.stats import dataset_stats
from opentau_cli.data.video import VideoFrames
from opentau_cli.errors import UserError

IMAGE_CACHE_BYTES = 512 * 1024 * 1024  # encoded image columns kept per process (whole datasets of PNGs usually fit)


def column_matrix(table, key: str, path: Path) -> np.ndarray:
    """A vector (fixed-size list / list) or scalar column as float32 (rows, width)."""
    if key not in table.column_names:
        raise UserError(f"{path} has no column '{key}' (the dataset config maps it); columns: {', '.join(table.column_names)}.")
    import pyarrow as pa

    col = table.column(key).combine_chunks()
    t = col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        col = col.flatten()
    arr = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float32)
    if arr.size % max(len(table), 1):
        raise UserError(f"{path} column '{key}' has rows of different widths.")
    return arr.reshape(len(table), -1)


class LeRobotDataset(torch.utils.data.Dataset):
    """Frames of a local LeRobot v2.1 / v3.0 dataset.

    Numbers (state, action, indices) are read into memory at construction; images are decoded per sample
    (parquet bytes, or mp4 through a bounded frame cache per worker). Every data, image and video file is reached
    through `files` (data/remote.py): where it lies, or, for a dataset in object storage, a cached copy of the version
    the launch pinned, fetched on first use; its messages then name the file by URL.
    """

    def __init__(
        self,
        root: str | Path,
        episodes: list[int] | None = None,
        *,
        chunk_size: int,
        image_resolution: tuple[int, int],
        num_cameras: int,
        camera_keys: dict[str, str] | None = None,
        state_key: str = "observation.state",
        action_key: str = "action",
        prompt: str | None = None,
        video_cache_mb: int = 256,
        video: VideoFrames | None = None,
        files=LOCAL,
    ):
        self.root = Path(root)
        self.files = files
        self.meta = read_meta(self.root)
        self.chunk_size = chunk_size
        self.resolution = (int(image_resolution[0]), int(image_resolution[1]))
        self.num_cameras = num_cameras
        self.state_key, self.action_key = state_key, action_key
        self.prompt = prompt
        for key, what in ((state_key, "dataset.state_key"), (action_key, "dataset.action_key")):
            if key not in self.meta.features:
                raise UserError(f"{what} '{key}' is not a feature in {self.root / 'meta/info.json'}.")
        self.slots = camera_slots(self.meta, camera_keys or {}, num_cameras)
        # openpi's rule: a camera whose feature name says "wrist" gets no geometric augmentation (train/augment.py).
        self._wrist = torch.tensor([feature is not None and "wrist" in feature for feature in self.slots])
        known = sorted(self.meta.episodes)
        if episodes is None:
            episodes = known
        missing = sorted(set(episodes) - set(known))
        if missing:
            raise UserError(f"episodes {missing} are not in {self.root / 'meta'} (it has {len(known)} episodes).")
        if not episodes:
            raise UserError(f"no episodes of {self.root} selected (check dataset.episodes).")
        self.episodes = sorted(episodes)
        try:
            self._load_numbers()
        except UserError as e:
            raise UserError(files.shown(str(e))) from None
        self.stats = dataset_stats(self.meta, self.episodes, self.state_key, self.action_key, self._state, self._action)
        self._images: OrderedDict[tuple, object] = OrderedDict()  # (data file, column) -> encoded images, LRU by bytes
        self._video = video or VideoFrames(cache_mb=video_cache_mb)  # a mixture's members share one cache

    def map_numbers(self, state_fn, action_fn) -> None:
        """Replace the (frames, width) state and action rows by what the functions make of them (a mixture carries
        its members into the policy's statistics); `stats` stay those of the dataset's own values."""
        self._state, self._action = state_fn(self._state), action_fn(self._action)

    # -- facts -----------------------------------------------------------------------------------------------------
    @property
    def fps(self) -> float:
        return self.meta.fps

    @property
    def state_dim(self) -> int:
        return int(self._state.shape[1])

    @property
    def action_dim(self) -> int:
        return int(self._action.shape[1])

    def __len__(self) -> int:
        return len(self._frame_ep)

    def episode_of(self, idx: int) -> int:
        return int(self._frame_ep[idx])

    # -- loading ---------------------------------------------------------------------------------------------------
    def _load_numbers(self) -> None:
        """Concatenate state/action/indices of the chosen episodes; remember where each frame's episode starts/ends."""
        states, actions, tasks, stamps = [], [], [], []
        self._ep_file: dict[int, tuple[Path, int]] = {}  # episode -> (data file, first row in it)
        files: dict[Path, dict] = {}
        for ep in self.episodes:
            path = self.meta.data_path(self.meta.episodes[ep])
            if path not in files:
                files[path] = self._read_numbers(path)
            cols = files[path]
            first, n = cols["spans"].get(ep, (0, 0)) if "spans" in cols else (0, cols["rows"])
            if n == 0:
                raise UserError(f"{path} holds no rows of episode {ep}.")
            rows = slice(first, first + n)
            self._ep_file[ep] = (path, first)
            states.append(cols["state"][rows])
            actions.append(cols["action"][rows])
            tasks.append(cols["task"][rows])
            stamps.append(cols["time"][rows] if cols["time"] is not None else np.arange(n) / self.fps)
        lengths = [len(x) for x in states]
        self._state = np.concatenate(states)
        self._action = np.concatenate(actions)
        self._task = np.concatenate(tasks)
        self._time = np.concatenate(stamps)
        self._frame_ep = np.repeat(np.array(self.episodes), lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._row = np.arange(len(self._frame_ep)) - np.repeat(starts[:-1], lengths)  # frame position inside its episode
        self._ep_end = {ep: int(starts[i + 1]) for i, ep in enumerate(self.episodes)}

    def _read_numbers(self, path: Path) -> dict:
        """State, action, task and time columns of one data file; for v3.0 files also where each episode's rows are."""
        import pyarrow.parquet as pq

        with self.files.open(path) as local:
            if not local.is_file():
                raise UserError(f"data file {path} is missing.")
            try:
                names = pq.read_schema(local).names
                wanted = [c for c in (self.state_key, self.action_key, "episode_index", "timestamp", "task_index") if c in names]
                table = pq.read_table(local, columns=wanted)
            except Exception as e:
                raise UserError(f"{path} is not a readable parquet file: {_reason(e, local, path)}.") from None
        n = table.num_rows
        cols = {
            "rows": n,
            "state": column_matrix(table, self.state_key, path),
            "action": column_matrix(table, self.action_key, path),
            "task": table.column("task_index").to_numpy().astype(np.int64) if "task_index" in names else np.zeros(n, np.int64),
            "time": table.column("timestamp").to_numpy().astype(np.float64) if "timestamp" in names else None,
        }
        if self.meta.version == "v3.0":
            if "episode_index" not in names:
                raise UserError(f"{path} has no column 'episode_index' (v3.0 data files hold many episodes).")
            # Episodes are stored as contiguous runs of rows.
            eps = table.column("episode_index").to_numpy()
            change = np.flatnonzero(np.diff(eps)) + 1
            starts = np.concatenate([[0], change]).astype(np.int64)
            ends = np.concatenate([change, [n]]).astype(np.int64)
            cols["spans"] = {int(eps[s]): (int(s), int(e - s)) for s, e in zip(starts, ends)} if n else {}
        return cols

    # -- samples ---------------------------------------------------------------------------------------------------
    def __getitem__(self, idx: int) -> dict:
        if torch.utils.data.get_worker_info() is not None:  # threads only where no fork follows (not in a rank)
            self.files.read_ahead()  # a dataset in object storage: its files fetched before they are read
        try:
            return self._item(int(idx))
        except UserError as e:
            raise UserError(self.files.shown(str(e))) from None

    def _item(self, idx: int) -> dict:
        ep = int(self._frame_ep[idx])
        end = self._ep_end[ep]
        # Action chunk: the next chunk_size actions of this episode; past its end repeat the last one and flag it.
        pos = np.arange(idx, idx + self.chunk_size)
        is_pad = pos >= end
        actions = self._action[np.minimum(pos, end - 1)]
        h, w = self.resolution
        images = np.zeros((self.num_cameras, h, w, 3), dtype=np.uint8)
        masks = np.zeros(self.num_cameras, dtype=bool)
        for slot, feature in enumerate(self.slots):
            if feature is not None:
                images[slot] = self._image(feature, ep, idx)
                masks[slot] = True
        return {
            # uint8 (cameras, 3, H, W): a quarter of float32's bytes through the workers' queues and the host-device
            # copy; the device scales them to [0, 1] (data/images.py to_unit_float).
            "images": torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))),
            "image_masks": torch.from_numpy(masks),
            "wrist_cameras": self._wrist,
            "state": torch.from_numpy(self._state[idx].copy()),
            "actions": torch.from_numpy(actions.copy()),
            "action_is_pad": torch.from_numpy(is_pad),
            "task": self._task_text(ep, int(self._task[idx])),
        }

    def _task_text(self, ep: int, task_index: int) -> str:
        if task_index in self.meta.tasks:
            return self.meta.tasks[task_index]
        tasks = self.meta.episodes[ep].tasks
        if tasks:
            return tasks[0]
        return self.prompt or ""

    def _image(self, feature: str, ep: int, idx: int) -> np.ndarray:
        em: EpisodeMeta = self.meta.episodes[ep]
        if self.meta.features[feature].get("dtype") == "video":
            path, start = self.meta.video_path(em, feature)
            return self._video.get(path, start + float(self._time[idx]), self.fps, self.resolution, self.files)
        path, first = self._ep_file[ep]
        row = first + int(self._row[idx])
        cell = self._image_table(path, feature).column(feature)[row].as_py()
        data = cell.get("bytes") if isinstance(cell, dict) else cell
        where = f"{path} column '{feature}', episode {ep} frame {int(self._row[idx])}"
        if data is None and isinstance(cell, dict) and cell.get("path"):
            img_path = self.root / cell["path"]
            try:
                with self.files.open(img_path) as local:
                    data = local.read_bytes()
            except OSError:
                raise UserError(f"image file {img_path} ({where}) is missing.") from None
        if not data:
            raise UserError(f"empty image in {where}.")
        try:
            return resize_with_pad(decode_image(data), *self.resolution)
        except UnidentifiedImageError:
            raise UserError(f"corrupt image in {where}: its {len(data)} bytes are not a readable PNG/JPEG.") from None
        except Exception as e:
            raise UserError(f"corrupt image in {where}: {e}.") from None

    def _image_table(self, path: Path, feature: str):
        """One image column of one data file, kept for the next samples (LRU bounded by IMAGE_CACHE_BYTES per process)."""
        import pyarrow.parquet as pq

        key = (path, feature)
        if key not in self._images:
            with self.files.open(path) as local:
                if feature not in pq.read_schema(local).names:
                    raise UserError(f"{path} has no column '{feature}' (the camera mapping names it).")
                try:
                    table = pq.read_table(local, columns=[feature])
                except Exception as e:
                    raise UserError(f"{path}: cannot read image column '{feature}': {_reason(e, local, path)}.") from None
            self._images[key] = table
            while len(self._images) > 1 and sum(t.nbytes for t in self._images.values()) > IMAGE_CACHE_BYTES:
                self._images.popitem(last=False)
        self._images.move_to_end(key)
        return self._images[key]

    def __getstate__(self):  # workers get the numbers, not the parent's caches
        state = self.__dict__.copy()
        state["_images"] = OrderedDict()
        return state


def _reason(e: Exception, local: Path, path: Path) -> str:
    """pyarrow's words, naming the file by its place in the dataset rather than its cached copy."""
    return str(e).replace(str(local), str(path))
