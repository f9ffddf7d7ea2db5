"""Image decoding and resize-with-padding, shared by parquet images and video frames, and the one uint8 -> [0, 1]
scaling that the device applies to the batch's images (docs/ARCHITECTURE.md, "Batch format")."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# 1/255 as a float32: a uint8 pixel x becomes the float32 product x * UNIT_SCALE (a Python float that float32 holds exactly).
UNIT_SCALE = float(np.float32(1 / 255))


def to_unit_float(images):
    """A tensor of images as the data pipeline sends them (uint8, 0-255) -> float32 in [0, 1], where the tensor is (on
    the device in training): x.float() * float32(1/255), bit for bit the values the host made when images travelled as
    float32. Float images (already in [0, 1], as clients may send them) only become float32. torch is imported here,
    not above: `config validate` reads datasets through this package without loading torch."""
    import torch

    if images.dtype == torch.uint8:
        return images.to(torch.float32) * UNIT_SCALE
    return images.to(torch.float32)


def fit_size(src_h: int, src_w: int, height: int, width: int) -> tuple[int, int]:
    """Largest (h, w) with the source's aspect ratio that fits inside (height, width).

    Rounded down, as openpi's resize_with_pad does (480x848 into 224x224 gives 126x224, not 127): the published pi05 saw
    images laid out exactly so.
    """
    ratio = max(src_w / width, src_h / height)
    return max(1, int(src_h / ratio)), max(1, int(src_w / ratio))


def pad_center(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    out = np.zeros((height, width, 3), dtype=np.uint8)
    h, w = pixels.shape[:2]
    top, left = (height - h) // 2, (width - w) // 2
    out[top : top + h, left : left + w] = pixels
    return out


def resize_with_pad(img: Image.Image, height: int, width: int) -> np.ndarray:
    """Fit `img` inside (height, width) keeping its aspect ratio, centred on black: uint8 (H, W, 3).

    Padding instead of stretching keeps geometry (a target's position) comparable across cameras of different shapes.
    """
    img = img.convert("RGB")
    new_h, new_w = fit_size(img.height, img.width, height, width)
    if (new_h, new_w) != (img.height, img.width):
        img = img.resize((new_w, new_h), Image.BILINEAR)
    return pad_center(np.asarray(img), height, width)


def decode_image(data: bytes) -> Image.Image:
    """PNG/JPEG bytes -> PIL image; raises whatever PIL raises on damaged bytes (the caller names the file)."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def encode_png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
