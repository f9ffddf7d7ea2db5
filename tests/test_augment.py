"""openpi's image augmentation (train/augment.py): each transform against openpi's formula written out here, the
whole against openpi's own function where its source is available, and the draws' reproducibility."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pathlib import Path

from conftest import EXAMPLES
from opentau_cli.data.sampler import BatchStream, ResumableSampler
from opentau_cli.train import augment
from opentau_cli.train.augment import ImageAugment, apply, color, crop_and_resize, draws, rotate

pytestmark = pytest.mark.full

H, W = 40, 48


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, H, W, generator=torch.Generator().manual_seed(seed))


def test_the_crop_is_95_percent_at_the_drawn_offset_resized_back_bilinearly():
    x = images(3)
    u_y, u_x = np.array([0.0, 0.5, 0.999]), np.array([0.999, 0.25, 0.0])
    got = crop_and_resize(x, u_y, u_x)
    ch, cw = int(H * 0.95), int(W * 0.95)  # openpi: int(height * 0.95), a start in randint(0, max + 1)
    for i in range(3):
        top, left = math.floor(u_y[i] * (H - ch + 1)), math.floor(u_x[i] * (W - cw + 1))
        want = F.interpolate(x[i:i + 1, :, top:top + ch, left:left + cw], size=(H, W), mode="bilinear", align_corners=False)
        assert torch.equal(got[i:i + 1], want)


def test_the_rotation_is_openpis_grid_and_skips_angles_under_a_tenth_of_a_degree():
    x = images(3, seed=1)
    degrees = torch.tensor([4.5, -2.0, 0.05], dtype=torch.float64)
    got = rotate(x, degrees)
    for i in range(2):
        a = torch.tensor([degrees[i].item()], dtype=torch.float32) * torch.pi / 180.0
        gy, gx = torch.meshgrid(torch.linspace(-1, 1, H), torch.linspace(-1, 1, W), indexing="ij")
        grid = torch.stack([gx * torch.cos(a) - gy * torch.sin(a), gx * torch.sin(a) + gy * torch.cos(a)], dim=-1)
        want = F.grid_sample(x[i:i + 1], grid[None], mode="bilinear", padding_mode="zeros", align_corners=False)
        assert torch.equal(got[i:i + 1], want)
    assert torch.equal(got[2], x[2])


def test_brightness_contrast_and_saturation_follow_openpis_ranges_and_order():
    x = images(2, seed=2)
    u = torch.tensor([[0.0, 1.0, 0.25], [0.9, 0.1, 0.75]], dtype=torch.float64)
    got = color(x, u)
    for i in range(2):
        b, c, s = 0.7 + u[i, 0] * 0.6, 0.6 + u[i, 1] * 0.8, 0.5 + u[i, 2] * 1.0
        y = x[i] * float(b)
        y = (y - y.mean()) * float(c) + y.mean()
        gray = y.mean(dim=0, keepdim=True)
        y = (gray + (y - gray) * float(s)).clamp(0, 1)
        # The image means are reduced in another order than color()'s batched ones: equal up to fp32 rounding.
        torch.testing.assert_close(got[i], y, rtol=0, atol=1e-6)


def test_wrist_cameras_get_only_the_colour_transforms():
    x = images(2, seed=3).view(1, 2, 3, H, W)
    u = np.random.default_rng(0).random((1, 2, 6))
    got = apply(x, u, torch.tensor([[False, True]]))
    assert torch.equal(got[0, 1], color(x[0, 1:2], torch.as_tensor(u[0, 1:2, 3:6]))[0])
    assert not torch.equal(got[0, 0], color(x[0, 0:1], torch.as_tensor(u[0, 0:1, 3:6]))[0])


def test_draws_depend_only_on_seed_epoch_position_and_camera():
    keys = np.array([[0, 5], [0, 6], [1, 5]])
    first = draws(7, keys, 2)
    assert first.shape == (3, 2, 6) and (first >= 0).all() and (first < 1).all()
    assert np.array_equal(draws(7, keys[::-1], 2), first[::-1])
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[0], first[2])
    assert not np.array_equal(draws(8, keys, 2), first)


class Frames(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, idx):
        return {"state": torch.tensor([float(idx)])}


def test_a_sample_gets_the_same_key_on_any_number_of_processes():
    def keyed(world_size: int) -> dict[int, tuple[int, int]]:
        out = {}
        for rank in range(world_size):
            stream = BatchStream(Frames(), ResumableSampler(24, seed=3, rank=rank, world_size=world_size), 12 // world_size)
            for _ in range(4):  # two epochs of two steps
                batch = next(stream)
                for frame, key in zip(batch["state"][:, 0].long().tolist(), batch["sample_key"].tolist()):
                    out.setdefault(tuple(key), frame)
        return out

    assert keyed(1) == keyed(2) == keyed(3)


def test_disabled_augmentation_returns_the_batch_untouched():
    off = ImageAugment("none", 0)
    batch = {"images": torch.zeros(1, 1, 3, 4, 4), "sample_key": torch.zeros(1, 2, dtype=torch.int64)}
    assert off(off.prepare(batch)) is batch


def test_augmenting_the_uint8_batch_sees_and_gives_exactly_what_the_former_float32_batch_did():
    """Images travel as uint8 and are scaled on the device: augmentation gets the [0, 1] floats the host made when
    they travelled as float32 (x * float32(1/255)), so its output is the same to the bit."""
    on = ImageAugment("openpi", 3)
    pixels = torch.randint(0, 256, (2, 2, 3, H, W), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    batch = {"images": pixels, "wrist_cameras": torch.tensor([[False, True]] * 2),
             "sample_key": torch.tensor([[0, 5], [1, 2]], dtype=torch.int64)}
    former = {**batch, "images": torch.from_numpy(pixels.numpy().astype(np.float32) * np.float32(1 / 255))}
    now, then = on(on.prepare(batch))["images"], on(on.prepare(former))["images"]
    assert now.dtype == then.dtype == torch.float32 and torch.equal(now, then)


def test_the_example_configs_choose_augmentation_as_documented():
    assert json.loads((EXAMPLES / "pi05_config.json").read_text())["dataset"]["augment"] == "openpi"
    for tiny in EXAMPLES.glob("pi05_tiny*.json"):
        assert json.loads(tiny.read_text()).get("dataset", {}).get("augment", "none") == "none"


def _openpi_preprocess():
    """openpi's own preprocess_observation_pytorch, from openpi's source (tests/peer_envs.py openpi_root: OPENPI_SRC or
    the pinned copy); its one JAX-side import, image_tools, is only used to resize, which these images do not need."""
    from peer_envs import openpi_root

    path = openpi_root() / "src" / "openpi" / "models_pytorch" / "preprocessing_pytorch.py"
    shared = types.ModuleType("openpi.shared")
    shared.image_tools = types.ModuleType("openpi.shared.image_tools")
    sys.modules.setdefault("openpi", types.ModuleType("openpi"))
    sys.modules["openpi.shared"], sys.modules["openpi.shared.image_tools"] = shared, shared.image_tools
    spec = importlib.util.spec_from_file_location("openpi_preprocessing_pytorch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.preprocess_observation_pytorch


@pytest.mark.parametrize("camera", ["base_0_rgb", "left_wrist_0_rgb"])
def test_the_whole_augmentation_equals_openpis_own_function_on_the_same_draws(camera, monkeypatch):
    preprocess = _openpi_preprocess()
    x = images(1, seed=4)
    u = np.array([[[0.3, 0.8, 0.9, 0.2, 0.6, 0.4]]])
    # openpi draws with torch.randint (crop) and torch.rand (angle, brightness, contrast, saturation), in that order;
    # a wrist camera draws only the three colour factors.
    rand = iter(torch.tensor([[v] for v in u[0, 0, 3 if "wrist" in camera else 2:]], dtype=torch.float32))
    crop = iter([math.floor(u[0, 0, 0] * (H - int(H * 0.95) + 1)), math.floor(u[0, 0, 1] * (W - int(W * 0.95) + 1))])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: next(rand))
    monkeypatch.setattr(torch, "randint", lambda *a, **k: torch.tensor([next(crop)]))
    obs = types.SimpleNamespace(images={camera: x * 2 - 1}, image_masks={}, state=torch.zeros(1, 2), tokenized_prompt=None,
                                tokenized_prompt_mask=None, token_ar_mask=None, token_loss_mask=None)
    theirs = (preprocess(obs, train=True, image_keys=(camera,), image_resolution=(H, W)).images[camera] + 1) / 2
    monkeypatch.undo()
    ours = apply(x.view(1, 1, 3, H, W), u, torch.tensor([["wrist" in camera]]))[0]
    # openpi draws its factors in fp32, ours are fp64 draws cast late: equal up to fp32 rounding of the factors.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-6)


def _validation_loss(policy, cfg, *, augment=None) -> float:
    """Rank 0's validation loss computed here: the validation batches of a single process, the noise seeded as
    validation seeds it (seed + 1), each batch's images augmented by `augment` first when given."""
    from opentau_cli.data import build_data

    data = build_data(cfg, 0, 1)
    try:
        n = min(len(data.val_loader), cfg.validation.max_batches)
        torch.manual_seed(cfg.seed + 1)
        batches, total = iter(data.val_loader), 0.0
        with torch.no_grad():
            for _ in range(n):
                batch = next(batches)
                if augment:  # validation batches carry no sample key: number their samples for the draws
                    keys = torch.stack([torch.zeros(len(batch["task"]), dtype=torch.int64), torch.arange(len(batch["task"]))], 1)
                    batch = augment(augment.prepare({**batch, "sample_key": keys}))
                total = total + policy(batch)["loss"].float()
    finally:
        data.stream.close()
    return float(total / n)


def test_validation_sees_the_images_unaugmented_when_training_augments_them(isolated_env):
    """A run with dataset.augment=openpi: the trainer's validation loss is the loss of the unaugmented validation
    batches (computed here), not of augmented ones (which differ)."""
    from opentau_cli.config import load_config, resolve_accelerate_config
    from opentau_cli.train.trainer import build_trainer

    cfg = load_config(EXAMPLES / "pi05_tiny_config.json", ["--dataset.augment=openpi", "--validation.max_batches=2",
                                                          "--batch_size=4"])
    trainer = build_trainer(cfg, resolve_accelerate_config(None))
    try:
        reported = trainer.validate()["val_loss"]
        policy = trainer.accelerator.unwrap_model(trainer.model).eval()
        assert _validation_loss(policy, cfg) == reported
        assert _validation_loss(policy, cfg, augment=ImageAugment("openpi", cfg.seed)) != reported
    finally:
        trainer.data.stream.close()


def test_eval_ignores_the_training_augmentation(tmp_path):
    """`opentau eval` of a run samples from the recorded frames as they are: dataset.augment=openpi in its config
    changes nothing of eval.json's numbers."""
    import json
    import shutil

    from opentau_cli.tools.evaluate import evaluate

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "fixtures" / "checkpoints" / "v2" / "single" / "run", run, symlinks=True)
    reports = {}
    for augment in ("none", "openpi"):
        done = evaluate(run, overrides={"dataset.augment": augment}, output=tmp_path / augment, episodes=[0], stride=5,
                        plot_episodes=0, device="cpu", echo=lambda m: None)
        reports[augment] = json.loads(done.json_path.read_text())
    assert reports["openpi"]["policy"] == reports["none"]["policy"] and reports["none"]["samples"] > 0
