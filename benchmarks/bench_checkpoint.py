"""Benchmark 2, checkpoints: publish time vs plain sequential writes + fsync, and launch-to-first-step on resume.

Save: one process builds the real trainer (TRAIN's build_trainer, one step so the optimizer state exists) and times
CheckpointManager.save (save_state, configs, manifest with hashes, atomic rename, `last` link). The anchor writes the
same files with the same sizes as plain sequential writes, each fsync'ed. Target: save bandwidth >= 0.8x the anchor's.

Resume: `opentau train` fresh vs `opentau resume` of the same run: seconds from launching the command until the first
training step is logged (metrics.jsonl). Target: resume <= 1.2x fresh.

    python benchmarks/bench_checkpoint.py            # pi05_small
    python benchmarks/bench_checkpoint.py --smoke    # tiny preset (CI)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, SMALL_CONFIG, TINY_CONFIG, base_parser, combined, env, opentau_bin, print_rows, ratio_headline, report, verdict  # noqa: E402
from opentau_cli.store.layout import METRICS  # noqa: E402

CHUNK = 16 << 20


def files_of(root: Path) -> list[tuple[Path, int]]:
    return sorted((p.relative_to(root), p.stat().st_size) for p in root.rglob("*") if p.is_file())


def plain_write(files: list[tuple[Path, int]], dest: Path) -> float:
    """Seconds to write the same files (same sizes) sequentially, fsync each, then the directories."""
    payload = os.urandom(CHUNK)
    start = time.perf_counter()
    for rel, size in files:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            left = size
            while left > 0:
                n = min(left, CHUNK)
                f.write(payload[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(dest, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - start


def save_times(config: Path, repeats: int, workdir: Path) -> tuple[list[float], list[float], int]:
    from opentau_cli.config import AccelerateSetup, load_config
    from opentau_cli.train.manager import CheckpointManager
    from opentau_cli.train.trainer import build_trainer

    run_dir = workdir / "save"
    cfg = load_config(config, {"output_dir": str(run_dir), "steps": str(repeats + 1), "logging.tensorboard": "false"})
    trainer = build_trainer(cfg, AccelerateSetup())
    trainer.train_step()
    manager = CheckpointManager(trainer.accelerator, run_dir, total_steps=cfg.steps, run_id="bench")
    saves, plains, nbytes = [], [], 0
    for i in range(repeats):
        start = time.perf_counter()
        path = manager.save(i + 1, config=cfg.to_json_dict(), state=trainer.state_dict())
        saves.append(time.perf_counter() - start)
        files = files_of(path)
        nbytes = sum(size for _, size in files)
        plains.append(plain_write(files, workdir / f"plain{i}"))
    trainer.data.stream.close()
    return saves, plains, nbytes


def seconds_to_step(cmd: list[str], metrics: Path, after_step: int, timeout: float = 1800) -> float:
    """Launch cmd; seconds until metrics.jsonl shows a train step > after_step; then let the run finish."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while first is None and time.perf_counter() - start < timeout:
        if metrics.is_file():
            for line in metrics.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("kind") == "train" and record.get("step", 0) > after_step:
                    first = time.perf_counter() - start
                    break
        if first is None and proc.poll() is not None:
            raise SystemExit(f"command failed before its first step: {' '.join(cmd)}\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.02)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    return first


def launch_times(config: Path, workdir: Path, warm_first: bool = True) -> tuple[float, float]:
    ot = opentau_bin()
    common = ["--log_freq=1", "--save_freq=2", "--validation.val_freq=0", "--logging.tensorboard=false", "--overwrite=true"]
    # A first fresh run warms the demo-data cache, page cache and DeepSpeed/torch imports for both timed runs.
    warm = workdir / "warm"
    if warm_first:
        seconds_to_step([ot, "train", f"--config_path={config}", f"--output_dir={warm}", "--steps=1", *common], warm / METRICS, 0)
    run_dir = workdir / "launch"
    fresh = seconds_to_step([ot, "train", f"--config_path={config}", f"--output_dir={run_dir}", "--steps=2", *common],
                            run_dir / METRICS, 0)
    resume = seconds_to_step([ot, "resume", str(run_dir), "--steps=3", "--log_freq=1"], run_dir / METRICS, 2)
    return fresh, resume


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    repeats = 1 if args.smoke else args.repeats
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        saves, plains, nbytes = save_times(config, repeats, Path(tmp))
        fresh, resume = launch_times(config, Path(tmp), warm_first=not args.smoke)
    save, plain = statistics.median(saves), statistics.median(plains)
    bandwidth_ratio = plain / save  # = save bandwidth / plain bandwidth (same bytes)
    launch_ratio = resume / fresh
    mb = nbytes / (1 << 20)
    rows = [
        ("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), 1 process"),
        ("checkpoint size", f"{mb:.1f} MiB"),
        ("publish a checkpoint (median)", f"{save:.3f} s = {mb / save:.0f} MiB/s (runs: {', '.join(f'{s:.3f}' for s in saves)})"),
        ("plain sequential write + fsync (median)", f"{plain:.3f} s = {mb / plain:.0f} MiB/s (runs: {', '.join(f'{s:.3f}' for s in plains)})"),
        ("save bandwidth / plain bandwidth", f"{bandwidth_ratio:.2f}x (target >= 0.8x: {verdict(bandwidth_ratio, 0.8)})"),
        ("launch to first step, fresh", f"{fresh:.1f} s"),
        ("launch to first step, resume", f"{resume:.1f} s"),
        ("resume / fresh", f"{launch_ratio:.2f}x (target <= 1.2x: {verdict(launch_ratio, 1.2, higher_is_better=False)})"),
    ]
    print_rows("Benchmark 2: checkpoint save and resume", rows)
    report(args, "Checkpoint save bandwidth and launch-to-first-step on resume", rows, [
        "the publish includes save_state, both JSON records, the manifest (xxhash of every file, read back) and the atomic rename",
        "the publish fsyncs every file (while hashing it) and every directory before the manifest is written; the kernel "
        "has usually started writing save_state's files back by then, which is why it can beat the write+fsync anchor",
    ], combined(ratio_headline("save bandwidth / plain write + fsync", bandwidth_ratio, 0.8),
                ratio_headline("launch to first step, resume / fresh", launch_ratio, 1.2, higher_is_better=False)))


if __name__ == "__main__":
    main()
