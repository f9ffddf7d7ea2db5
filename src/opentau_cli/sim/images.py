"""The env's images held against the images the policy was trained on, before any rollout (docs/ARCHITECTURE.md,
"Closed-loop evaluation"): a camera whose frames are flipped against the training data's, or framed with another
aspect ratio, makes a policy with a low loss fail in the simulator.

What is checkable, and only where the training dataset is on this machine (a run's checkpoint names it; an export
does not): the first frames of its first episodes against the env's first frame as rendered and flipped on each
axis, all resized to 32x32 (cheap, and blind to the few pixels a goal or an object moves between episodes). A flip
is named only when it brings the env's frame much closer to the training frames than the frame as rendered (under
half the difference), so a scene unlike the training data's (another robot, another simulator) is not mistaken for
a flip.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COMPARE_SIZE = (32, 32)
REFERENCE_EPISODES = 8
FLIPS = {"flipped upside down": (0,), "mirrored left to right": (1,), "flipped on both axes": (0, 1)}
CLEARLY_CLOSER = 0.5  # a flip must halve the difference to be named


def training_camera_frames(served, overrides: dict | None, dataset: str | None, camera: str) -> tuple[list, tuple] | None:
    """([uint8 (32, 32, 3) first frame of each of the first episodes], (height, width) recorded) of `camera` in the
    dataset the policy's checkpoint was trained on; None where that dataset is not a local video dataset here."""
    from opentau_cli.config.load import load_config
    from opentau_cli.data.meta import read_meta
    from opentau_cli.data.mixture import select_member
    from opentau_cli.data.video import VideoFrames
    from opentau_cli.store.layout import TRAIN_CONFIG

    where = (served.origin.get("checkpoint") or {}).get("path")  # an export has none
    if not where or not (Path(str(where)) / TRAIN_CONFIG).is_file():
        return None
    checkpoint = Path(str(where))
    member = select_member(load_config(checkpoint / TRAIN_CONFIG, dict(overrides or {})), dataset)
    root = Path(member.root or "")
    if not member.root or not (root / "meta" / "info.json").is_file():
        return None
    meta = read_meta(root)
    if camera not in meta.video_features:
        return None
    frames = VideoFrames(cache_mb=8)
    try:
        out = []
        for ep in sorted(meta.episodes.values(), key=lambda e: e.index)[:REFERENCE_EPISODES]:
            path, start = meta.video_path(ep, camera)
            out.append(frames.get(path, start, meta.fps, COMPARE_SIZE))
    finally:
        frames.close()
    shape = meta.features[camera].get("shape", [0, 0])
    return out, (int(shape[0]), int(shape[1]))


def _small(frame: np.ndarray) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(frame).resize(COMPARE_SIZE[::-1], Image.BILINEAR), np.float32)


def orientation_against(frame: np.ndarray, references: list[np.ndarray]) -> tuple[str | None, float, float]:
    """(the flip that makes `frame` clearly closer to `references`, or None; the mean absolute difference /255 of the
    frame as rendered; that of the best flip). The difference to the closest reference frame counts."""
    refs = [np.asarray(r, np.float32) for r in references]
    small = _small(frame)

    def difference(pixels):
        return min(float(np.abs(pixels - r).mean()) for r in refs)

    as_rendered = difference(small)
    name, best = min(((n, difference(np.flip(small, axes))) for n, axes in FLIPS.items()), key=lambda x: x[1])
    return (name if best < CLEARLY_CLOSER * as_rendered else None), as_rendered, best


def check_images(served, env, mapping: dict[str, str], first, overrides: dict | None, dataset: str | None) -> list[str]:
    """Warnings about the env's images against the training images of each policy camera; a flip is a UserError.
    `first`: the env's Step after a reset."""
    from opentau_cli.errors import UserError

    notes = []
    for camera, source in mapping.items():
        found = training_camera_frames(served, overrides, dataset, camera)
        if found is None:
            continue
        references, (height, width) = found
        rendered = first.pixels[source]
        if height and width and abs(height / width - rendered.shape[0] / rendered.shape[1]) > 0.01:
            notes.append(f"camera '{camera}' was recorded at {height}x{width} but {env.spec.name} renders "
                         f"{rendered.shape[0]}x{rendered.shape[1]}: another aspect ratio, so the policy sees the scene "
                         "framed differently than in training.")
            continue
        flip, as_rendered, flipped = orientation_against(rendered, references)
        if flip is not None:
            raise UserError(f"{env.spec.name}'s '{source}' images look {flip} against the training images of camera "
                            f"'{camera}' (mean difference {flipped:.0f}/255 flipped, {as_rendered:.0f}/255 as rendered): "
                            "the data was recorded with another image convention; record it as this env renders "
                            "(`opentau dataset synth --env`) or evaluate in the env it was recorded in.")
    return notes
