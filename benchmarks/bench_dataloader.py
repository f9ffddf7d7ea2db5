"""Benchmark: the decode ceiling of a video mixture against what pi05_small training consumes.

`opentau profile --dataloader-only` pulls batches of a mixture of mp4 datasets (two episode ranges of the real g1
dataset, AV1 480x640, when it sits next to the checkout; else synthetic H.264 64x64 ones) with no model; `opentau
profile` then trains pi05_small on the same mixture. A ceiling well above the training samples/s means the data does
not starve training; the training profile's data phase says how much of each step still waits for it.

    python benchmarks/bench_dataloader.py            # pi05_small at 112x112, 20 batches of 4, 2 data workers
    python benchmarks/bench_dataloader.py --smoke    # tiny preset, synthetic members only, a few batches (CI)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, opentau_bin, print_rows, report, run  # noqa: E402

G1 = REPO.parent / "shared" / "data" / "g1_pick_bottle_v21"


def mixture(workdir: Path, smoke: bool) -> tuple[list[dict], int]:
    """The members and the camera slots. A mixture has one fps, so the real 30 fps g1 data is mixed with itself
    (two episode ranges); without it, and in --smoke, two synthetic 10 fps ones (v2.1 + v3.0 with 2 cameras)."""
    from opentau_cli.data import write_synth

    if not smoke and (G1 / "meta" / "info.json").is_file():
        return [{"name": "g1_ep0-1", "root": str(G1), "episodes": [0, 1], "weight": 1.0},
                {"name": "g1_ep2", "root": str(G1), "episodes": [2], "weight": 1.0}], 1
    episodes = 2 if smoke else 20  # smoke: 2 x 50 frames per member, more than its 1 + 2 batches of the tiny preset's 8
    v30 = write_synth(workdir / "reach_v30_video", episodes=episodes, steps_per_episode=50, cameras=2, fmt="v3.0", video=True, seed=1)
    v21 = write_synth(workdir / "reach_v21_video", episodes=episodes, steps_per_episode=50, video=True, seed=2)
    return [{"name": "reach_v21_video", "root": str(v21), "weight": 1.0},
            {"name": "reach_v30_video", "root": str(v30), "weight": 1.0,
             "camera_keys": {"observation.images.top": "camera0", "observation.images.front": "camera1"}}], 2


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=20, help="Measured batches (dataloader) and steps (training).")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="dataset.num_workers for both measurements.")
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    if args.smoke:
        args.steps, args.warmup, args.workers = 2, 1, 1
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        work = Path(tmp)
        members, cameras = mixture(work, args.smoke)
        common = [f"--config_path={config}", f"--dataset.mixture={json.dumps(members)}", f"--dataset.num_cameras={cameras}",
                  f"--dataset.num_workers={args.workers}", "--validation.val_split=0", "--validation.val_freq=0",
                  "--policy.max_state_dim=32", "--policy.max_action_dim=32", f"--output_dir={work / 'run'}",
                  "--steps", str(args.steps), "--warmup", str(args.warmup)]
        _, data_wall = run([opentau_bin(), "profile", "--dataloader-only", *common, "--json", str(work / "data.json")])
        data = json.loads((work / "data.json").read_text())
        _, train_wall = run([opentau_bin(), "profile", *common, "--json", str(work / "train.json")])
        train = json.loads((work / "train.json").read_text())
    ceiling, consumed = data["samples_per_s"], train["samples_per_s"]
    waits = train["phases"]["data"]
    names = ", ".join(f"{m['name']} ({Path(m['root']).name})" for m in members)
    rows = [
        ("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), 1 process, batch {data['batch_size']}, "
                   f"{args.workers} data worker(s), {args.warmup} warm-up + {args.steps} measured batches / steps"),
        ("mixture", f"{names}, weights 1:1, {cameras} camera slot(s)"),
        ("decode ceiling (profile --dataloader-only)", f"{ceiling:.1f} samples/s (batch wait median {data['batch_wait']['median_s'] * 1000:.0f} ms)"),
        ("training consumption (profile, pi05_small)" if not args.smoke else "training consumption (profile)",
         f"{consumed:.2f} samples/s ({train['step_time_s'] * 1000:.0f} ms/step)"),
        ("ceiling / consumption", f"{ceiling / consumed:.1f}x"),
        ("data phase of a training step", f"mean {waits['mean_s'] * 1000:.1f} ms ({waits['mean_s'] / train['step_time_s']:.1%} of the step)"),
    ]
    print_rows("Benchmark: video mixture decode ceiling vs pi05_small training", rows)
    report(args, "Video mixture: decode ceiling vs pi05_small training consumption", rows, [
        f"dataloader-only took {data_wall:.0f} s, training profile {train_wall:.0f} s (both include start-up)",
        "the measured batches fall in the first epoch: frames are decoded, not served from the frame cache",
        "the machine is shared with other work: the load average above says how busy it was"],
           Headline(f"{ceiling / consumed:.1f}x decode ceiling / training consumption"))


if __name__ == "__main__":
    main()
