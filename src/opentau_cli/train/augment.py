"""openpi's training image augmentation, on the device inside the step, per sample and reproducible.

docs/ARCHITECTURE.md, "Image augmentation". With `dataset.augment: openpi` every training image gets openpi's
transforms with openpi's parameters, on images in [0, 1]:
- cameras that are not wrist cameras (a dataset feature whose name contains "wrist", openpi's rule): a random crop
  of 95% of the height and width, resized back (bilinear), then a rotation by -5..5 degrees (grid_sample, bilinear,
  zero padding; skipped below 0.1 degree);
- every camera: brightness x 0.7..1.3, contrast x 0.6..1.4 around the image's mean, saturation x 0.5..1.5 around
  the per-pixel channel mean, then a clamp to [0, 1].
Unlike openpi's PyTorch path, which draws once per batch and camera, the draws are per sample and camera and are a
function of (seed, epoch, the sample's position in the epoch's global order, camera slot) only: the same sample gets
the same draws on any number of processes, so exact and elastic resume keep holding. The draws are a few numbers
per sample computed on the host (`draws`); the image work runs where the batch is (`apply`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from opentau_cli.data.images import to_unit_float

# What one sample's camera draws, in this order (each uniform in [0, 1)).
DRAWS = ("crop_y", "crop_x", "angle", "brightness", "contrast", "saturation")
CROP = 0.95
MAX_DEGREES = 5.0
MIN_DEGREES = 0.1  # openpi leaves smaller rotations out
BRIGHTNESS = (0.7, 1.3)
CONTRAST = (0.6, 1.4)
SATURATION = (0.5, 1.5)
_STREAM = 0x0A06  # keeps these draws apart from any other use of the same seed


def draws(seed: int, sample_keys: np.ndarray, num_cameras: int) -> np.ndarray:
    """Uniform draws [B, num_cameras, len(DRAWS)] for samples keyed by (epoch, global position) rows."""
    out = np.empty((len(sample_keys), num_cameras, len(DRAWS)), dtype=np.float64)
    for i, (epoch, position) in enumerate(np.asarray(sample_keys, dtype=np.int64).tolist()):
        for camera in range(num_cameras):
            out[i, camera] = np.random.default_rng([seed, _STREAM, epoch, position, camera]).random(len(DRAWS))
    return out


def _between(u: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    low, high = bounds
    return low + u * (high - low)


def crop_and_resize(images: torch.Tensor, u_y: np.ndarray, u_x: np.ndarray) -> torch.Tensor:
    """[N, C, H, W]: a crop of int(0.95 H) x int(0.95 W) at offsets floor(u * (room + 1)), resized back. The offsets
    come from host draws, so cropping never waits on the device."""
    n, _, height, width = images.shape
    crop_h, crop_w = int(height * CROP), int(width * CROP)
    room_h, room_w = height - crop_h, width - crop_w
    if room_h <= 0 or room_w <= 0:  # openpi crops only when both dimensions leave room
        return images
    top = np.minimum(np.floor(u_y * (room_h + 1)).astype(np.int64), room_h).tolist()
    left = np.minimum(np.floor(u_x * (room_w + 1)).astype(np.int64), room_w).tolist()
    crops = torch.stack([images[i, :, top[i]:top[i] + crop_h, left[i]:left[i] + crop_w] for i in range(n)])
    return F.interpolate(crops, size=(height, width), mode="bilinear", align_corners=False)


def rotate(images: torch.Tensor, degrees: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] rotated by `degrees` [N] about the centre, as openpi samples it (a grid over linspace(-1, 1))."""
    n, _, height, width = images.shape
    radians = degrees.to(images.dtype) * math.pi / 180.0
    cos, sin = torch.cos(radians).view(n, 1, 1), torch.sin(radians).view(n, 1, 1)
    ys = torch.linspace(-1, 1, height, device=images.device, dtype=images.dtype)
    xs = torch.linspace(-1, 1, width, device=images.device, dtype=images.dtype)
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    grid = torch.stack([grid_x * cos - grid_y * sin, grid_x * sin + grid_y * cos], dim=-1)
    rotated = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    significant = (degrees.abs() > MIN_DEGREES).view(n, 1, 1, 1)
    return torch.where(significant, rotated, images)


def color(images: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] with brightness, contrast and saturation from u [N, 3], clamped to [0, 1]."""
    n = images.shape[0]
    brightness, contrast, saturation = (_between(u[:, k], b).to(images.dtype).view(n, 1, 1, 1)
                                        for k, b in enumerate((BRIGHTNESS, CONTRAST, SATURATION)))
    images = images * brightness
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    images = (images - mean) * contrast + mean
    gray = images.mean(dim=1, keepdim=True)
    images = gray + (images - gray) * saturation
    return images.clamp(0, 1)


def apply(images: torch.Tensor, u: np.ndarray, wrist: torch.Tensor) -> torch.Tensor:
    """Augment a batch of images [B, cameras, C, H, W] in [0, 1] with host draws u [B, cameras, 6]; `wrist`
    [B, cameras] marks wrist cameras, which get only the colour transforms."""
    batch, cameras = images.shape[:2]
    flat = images.flatten(0, 1).float()
    u = np.asarray(u, dtype=np.float64).reshape(batch * cameras, len(DRAWS))
    # non_blocking: a blocking copy to a CUDA device waits for the work queued there (the previous step's).
    on_device = torch.as_tensor(u).to(flat.device, non_blocking=True)
    geometric = ~wrist.flatten(0, 1).to(device=flat.device, dtype=torch.bool)
    moved = crop_and_resize(flat, u[:, 0], u[:, 1])
    moved = rotate(moved, on_device[:, 2] * (2 * MAX_DEGREES) - MAX_DEGREES)
    flat = torch.where(geometric.view(-1, 1, 1, 1), moved, flat)
    flat = color(flat, on_device[:, 3:6])
    return flat.view(batch, cameras, *flat.shape[1:])


class ImageAugment:
    """The training step's augmentation component: `prepare(batch)` on the host batch adds the draws,
    `__call__(batch)` on the device batch replaces its images. Disabled, both return the batch as it is."""

    def __init__(self, kind: str, seed: int):
        self.enabled, self.seed = kind == "openpi", seed

    def prepare(self, batch: dict) -> dict:
        if not self.enabled:
            return batch
        keys = batch["sample_key"].numpy()
        # numpy, not a tensor: it stays on the host when the batch moves to the device.
        return {**batch, "augment_draws": draws(self.seed, keys, batch["images"].shape[1])}

    def __call__(self, batch: dict) -> dict:
        if not self.enabled:
            return batch
        # The batch's uint8 images scaled as the policy scales them (data/images.py): the [0, 1] floats openpi augments.
        images = to_unit_float(batch["images"])
        augmented = apply(images, batch.pop("augment_draws"), batch["wrist_cameras"])
        return {**batch, "images": augmented}
