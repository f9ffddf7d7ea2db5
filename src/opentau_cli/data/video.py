"""mp4 frames via PyAV: seek to the keyframe before the wanted frame, decode forward, keep what was decoded.

LeRobot encodes with a keyframe every 2 frames, so a seek decodes 1-2 frames; every frame decoded on the way is
converted and resized in one swscale pass and kept in a bounded per-process LRU (`video_cache_mb`, at the target
resolution, so ~150 KB per 224x224 frame), so neighbours of a sample and the next epoch come from memory.
Measured on the g1 data (AV1 480x640 -> 224x224, shuffled, batch 8, a busy 2-core machine): first epoch 137
samples/s in-process, later epochs 1677 samples/s from the cache; decoding a whole episode per sample would cost
~0.5 s per sample instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from opentau_cli.data.images import fit_size, pad_center
from opentau_cli.data.files import LOCAL, register_holder
from opentau_cli.errors import UserError

INSTALL_HINT = "install PyAV with `pip install 'opentau-cli[video]'` (or `pip install av`)"


REPAIR = "restore it from the dataset's source, or train without its episodes (dataset.episodes)"


def _reason(e: Exception) -> str:
    """PyAV's own words without the path it repeats ("Invalid data found when processing input")."""
    return getattr(e, "strerror", None) or str(e)


def pyav_available() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def import_av():
    try:
        import av
    except ImportError:
        raise UserError(f"this dataset stores cameras as mp4 video, which needs PyAV: {INSTALL_HINT}.") from None
    return av


def write_mp4(path: Path, frames, fps: int, crf: int = 10, keyframe_every: int = 2) -> None:
    """Frames (uint8 (H, W, 3), even sides) as an H.264 mp4, frame i at t = i / fps; a keyframe every
    `keyframe_every` frames as LeRobot encodes. One encoder thread. The same frames usually give the same bytes,
    but not always: x264 with one thread and the same settings was seen to choose differently now and then on a
    heavily loaded 2-CPU machine, so reproducibility is promised for the frames, not the bitstream."""
    av = import_av()
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": str(crf), "g": str(keyframe_every), "bf": "0"})
        stream.thread_count = 1
        for i, pixels in enumerate(frames):
            if i == 0:
                stream.height, stream.width = pixels.shape[:2]
                stream.pix_fmt = "yuv420p"
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


class VideoFrames:
    """Per-process frame source. `get(path, t, fps, (h, w), files)` -> uint8 (h, w, 3) of the frame shown at time t;
    `files` reaches the file (data/remote.py: where it lies, or a cached copy of a dataset in object storage, held
    while its container is open)."""

    def __init__(self, cache_mb: int = 256, max_open: int = 4):
        self.budget = cache_mb * 1024 * 1024
        self.max_open = max_open
        self._frames: OrderedDict[tuple, np.ndarray] = OrderedDict()  # (path, frame_no, h, w) -> pixels
        self._bytes = 0
        self._open: OrderedDict[Path, tuple] = OrderedDict()  # path -> (av container, the file's lease)
        self._registered = False
        self._lock = threading.RLock()  # data/files.py's watcher thread may close the containers (`close`)

    def __getstate__(self):  # DataLoader workers start with an empty cache and no open files
        return {"budget": self.budget, "max_open": self.max_open}

    def __setstate__(self, state):
        self.__init__(state["budget"] // (1024 * 1024), state["max_open"])

    def get(self, path: Path, timestamp: float, fps: float, size: tuple[int, int], files=LOCAL) -> np.ndarray:
        with self._lock:
            return self._get(path, timestamp, fps, size, files)

    def _get(self, path: Path, timestamp: float, fps: float, size: tuple[int, int], files) -> np.ndarray:
        want = round(timestamp * fps)
        key = (path, want, *size)
        if key in self._frames:
            self._frames.move_to_end(key)
            return self._frames[key]
        self._decode_until(path, want, fps, size, files)
        if key not in self._frames:
            raise UserError(f"{path} has no frame at t={timestamp:.3f}s (frame {want}): the video is shorter than its episode; {REPAIR}.")
        return self._frames[key]

    def close(self, blocking: bool = True) -> None:
        """Close every open container and let go of its file (the cache of a dataset in object storage may then
        evict it); not blocking: only if no frame is being read now."""
        if not self._lock.acquire(blocking):
            return
        try:
            while self._open:
                _, (container, lease) = self._open.popitem(last=False)
                container.close()
                lease.close()
        finally:
            self._lock.release()

    def _container(self, path: Path, files):
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path][0]
        av = import_av()
        lease = files.lease(path)
        if files is not LOCAL and not self._registered:  # a full cache may ask for the files held open here
            register_holder(self.close, files)
            self._registered = True
        if not lease.path.is_file():
            lease.close()
            raise UserError(f"video file {path} is missing; {REPAIR}.")
        try:
            container = av.open(str(lease.path))
        except Exception as e:
            lease.close()
            raise UserError(f"cannot open video {path} ({_reason(e)}): the file is damaged; {REPAIR}.") from None
        # One decoder thread: parallelism comes from DataLoader workers, and a decoder that owns threads deadlocks
        # when a forked worker frees an inherited container (seen with dav1d); single-threaded was as fast here.
        codec = container.streams.video[0].codec_context
        codec.thread_count = 1
        codec.thread_type = "NONE"
        self._open[path] = (container, lease)
        while len(self._open) > self.max_open:
            _, (old, held) = self._open.popitem(last=False)
            old.close()
            held.close()
        return container

    def _decode_until(self, path: Path, want: int, fps: float, size: tuple[int, int], files) -> None:
        container = self._container(path, files)
        stream = container.streams.video[0]
        try:
            # backward=True lands on the keyframe at or before the target.
            container.seek(max(0, int((want - 0.5) / fps / stream.time_base)), stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                no = round(float(frame.pts * stream.time_base) * fps)
                h, w = fit_size(frame.height, frame.width, *size)
                # swscale converts YUV->RGB and resizes in one pass: ~5x cheaper than to_image() + PIL resize.
                rgb = frame.reformat(width=w, height=h, format="rgb24", interpolation="BILINEAR", threads=1).to_ndarray()
                self._put((path, no, *size), pad_center(rgb, *size))
                if no >= want:
                    return
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"cannot decode video {path} near frame {want} ({_reason(e)}): the file is damaged; {REPAIR}.") from None

    def _put(self, key: tuple, pixels: np.ndarray) -> None:
        if key in self._frames:
            return
        self._frames[key] = pixels
        self._bytes += pixels.nbytes
        while self._bytes > self.budget and len(self._frames) > 1:
            _, old = self._frames.popitem(last=False)
            self._bytes -= old.nbytes
