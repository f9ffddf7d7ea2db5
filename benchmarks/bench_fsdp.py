"""FSDP2 vs DeepSpeed ZeRO-3 vs DDP on 2 CPU processes, side by side in one run (issue #33).

Training: `opentau profile --compare` of the three Accelerate configs (samples/s, step time, peak RSS per rank, the
speedup vs DDP). Checkpoints, per backend: one `opentau train` that saves at its last step (how long training waited
for the save: from its last step's progress line to its "Saved checkpoint" line; the checkpoint's size), then an
`opentau resume` of it: seconds from the command to its first step, beside the fresh launch's (the difference is
mostly the load).

    python benchmarks/bench_fsdp.py            # pi05_small, 2 warm-up + 6 measured steps per backend
    python benchmarks/bench_fsdp.py --smoke    # tiny preset, 1 + 2 steps (shows the script works)

Run it with the machine to itself (`flock -x /tmp/...`) for numbers worth comparing.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXAMPLES, REPO, SMALL_CONFIG, TINY_CONFIG, append_result, base_parser, opentau_bin, print_rows, run  # noqa: E402
from bench_checkpoint import seconds_to_step  # noqa: E402
from opentau_cli.checkpoint.layout import CHECKPOINTS, METRICS  # noqa: E402

BACKENDS = {
    "DDP": EXAMPLES / "accelerate_cpu_ddp_config.yaml",
    "ZeRO-3": EXAMPLES / "accelerate_cpu_deepspeed_zero3_config.yaml",
    "FSDP2": REPO / "configs" / "examples" / "accelerate_cpu_fsdp2_config.yaml",
}


def fp32_yaml(name: str, yaml: Path, workdir: Path) -> Path:
    """The backend's YAML in fp32 (the comparison holds precision fixed: the CPU DDP example is fp32)."""
    text = yaml.read_text().replace("mixed_precision: bf16", 'mixed_precision: "no"')
    out = workdir / f"{name.lower().replace('-', '')}.yaml"
    out.write_text(text)
    return out


def save_seconds(cmd: list[str], steps: int) -> float:
    """Run a training command that saves after its last step; seconds from its last progress line to its "Saved
    checkpoint" line (the save, as training waits for it)."""
    import subprocess
    import time

    from _common import env

    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last_step = saved = None
    for line in proc.stdout:
        if line.startswith(f"step {steps}/{steps}"):
            last_step = time.perf_counter()
        elif line.startswith("Saved checkpoint") and last_step is not None and saved is None:
            saved = time.perf_counter()
    if proc.wait() != 0 or last_step is None or saved is None:
        raise SystemExit(f"command failed or printed no save ({proc.returncode}): {' '.join(cmd)}")
    return saved - last_step


def checkpoint_times(config: Path, yaml: Path, workdir: Path, steps: int) -> dict:
    ot = opentau_bin()
    run_dir = workdir / f"run-{yaml.stem}"
    common = ["--log_freq=1", f"--save_freq={steps}", "--validation.val_freq=0", "--logging.tensorboard=false",
              "--logging.progress_bar=plain"]
    fresh = seconds_to_step([ot, "train", f"--config_path={config}", f"--accelerate-config={yaml}", f"--output_dir={run_dir}",
                             f"--steps={steps}", *common], run_dir / METRICS, 0)
    saved = run_dir / CHECKPOINTS / f"{steps:06d}"
    size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    resume = seconds_to_step([ot, "resume", str(run_dir), f"--steps={steps + 1}", "--log_freq=1"], run_dir / METRICS, steps)
    # The save alone, timed on a second run's console (the first one above warmed caches and imports).
    again = workdir / f"save-{yaml.stem}"
    save = save_seconds([ot, "train", f"--config_path={config}", f"--accelerate-config={yaml}", f"--output_dir={again}",
                         f"--steps={steps}", *common], steps)
    return {"save_s": save, "bytes": size, "fresh_s": fresh, "resume_s": resume}


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    if args.smoke:
        args.steps, args.warmup = 2, 1
    with tempfile.TemporaryDirectory(prefix="opentau-bench-fsdp-") as tmp:
        workdir = Path(tmp)
        yamls = {name: fp32_yaml(name, yaml, workdir) for name, yaml in BACKENDS.items()}
        out = workdir / "compare.json"
        proc, wall = run([opentau_bin(), "profile", f"--config_path={config}", "--compare", ",".join(map(str, yamls.values())),
                          "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(out)])
        report = json.loads(out.read_text())
        saves = {name: checkpoint_times(config, yaml, workdir, 2) for name, yaml in yamls.items()}
    print(proc.stdout)
    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), fp32, 2 CPU processes, {args.warmup} "
                       f"warm-up + {args.steps} measured steps per backend, batch {report['reports'][0]['global_batch_size']} global")]
    for name, r in zip(BACKENDS, report["rows"]):
        s = saves[name]
        save = f"{s['save_s']:.2f} s"
        rows.append((name, f"{r['samples_per_s']:.2f} samples/s, {r['step_time_s'] * 1000:.0f} ms/step, peak RSS/rank "
                           f"{r['peak_memory_bytes'] / (1 << 20):.0f} MiB, {r['speedup']:.2f}x vs DDP; checkpoint "
                           f"{s['bytes'] / (1 << 20):.1f} MiB saved in {save}; first step {s['fresh_s']:.1f} s fresh, "
                           f"{s['resume_s']:.1f} s resumed"))
    print_rows("FSDP2 vs ZeRO-3 vs DDP (2 CPU processes)", rows)
    if not args.no_append:
        notes = [f"profile comparison took {wall:.0f} s", "peak RSS is each worker process's own peak",
                 "save: from the last step's progress line to the \"Saved checkpoint\" line of a second identical run"]
        if args.smoke:
            notes.insert(0, "smoke run: numbers only show the script works")
        append_result("FSDP2 vs ZeRO-3 vs DDP on 2 CPU processes", rows, notes, path=args.results)


if __name__ == "__main__":
    main()
