"""FSDP2 vs DeepSpeed ZeRO-3 vs DDP on 2 CPU processes, side by side in one run (issue #33).

Training: `opentau profile --compare` of the three Accelerate configs (samples/s, step time, peak RSS per rank, the
speedup vs DDP). Checkpoints, per backend: one `opentau train` that saves at its last step, then an `opentau resume` of
that checkpoint: the save's and the load's seconds (the slowest rank's, timed around the product's calls by
tests/hooks' BENCH_TIMING_RECORD) and the checkpoint's size.

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
from _common import EXAMPLES, REPO, SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, opentau_bin, print_rows, report, run  # noqa: E402
from opentau_cli.store.layout import CHECKPOINTS  # noqa: E402

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


HOOKS = REPO / "tests" / "hooks"  # the fault-injection helper: BENCH_TIMING_RECORD times saves and restores


def timed_launch(cmd: list[str], record: Path) -> dict:
    """Run `cmd` with tests/hooks' BENCH_TIMING_RECORD; the slowest rank's seconds in each checkpoint save and
    restore (every rank waits for the slowest: the save and the load end in collectives)."""
    import subprocess

    from _common import env

    record.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env={**env(), "PYTHONPATH": str(HOOKS), "BENCH_TIMING_RECORD": str(record)},
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    ranks = [json.loads(f.read_text()) for f in sorted(record.glob("rank*.json"))]
    if not ranks:
        raise SystemExit(f"no rank recorded its checkpoint times: {' '.join(cmd)}")
    return {key: max(sum(r[key]) for r in ranks) for key in ("save_s", "load_s")}


def checkpoint_times(config: Path, yaml: Path, workdir: Path, steps: int) -> dict:
    """One `opentau train` that saves at its last step, then an `opentau resume` of that checkpoint: seconds the
    save took as training waits for it (CheckpointManager.save, synchronous), seconds the resume took to read it
    into the model, optimizer, scheduler and RNG (Trainer.restore), the checkpoint's size."""
    ot = opentau_bin()
    run_dir = workdir / f"run-{yaml.stem}"
    common = ["--log_freq=1", f"--save_freq={steps}", "--validation.val_freq=0", "--logging.tensorboard=false",
              "--logging.progress_bar=plain"]
    saved = timed_launch([ot, "train", f"--config_path={config}", f"--accelerate-config={yaml}", f"--output_dir={run_dir}",
                          f"--steps={steps}", *common], workdir / f"timing-train-{yaml.stem}")
    ckpt = run_dir / CHECKPOINTS / f"{steps:06d}"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    loaded = timed_launch([ot, "resume", str(run_dir), f"--steps={steps + 1}", "--log_freq=1"],
                          workdir / f"timing-resume-{yaml.stem}")
    return {"save_s": saved["save_s"], "load_s": loaded["load_s"], "bytes": size}


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
        compared = json.loads(out.read_text())
        saves = {name: checkpoint_times(config, yaml, workdir, 2) for name, yaml in yamls.items()}
    print(proc.stdout)
    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), fp32, 2 CPU processes, {args.warmup} "
                       f"warm-up + {args.steps} measured steps per backend, batch {compared['reports'][0]['global_batch_size']} global")]
    for name, r in zip(BACKENDS, compared["rows"]):
        s = saves[name]
        rows.append((name, f"{r['samples_per_s']:.2f} samples/s, {r['step_time_s'] * 1000:.0f} ms/step, peak RSS/rank "
                           f"{r['peak_memory_bytes'] / (1 << 20):.0f} MiB, {r['speedup']:.2f}x vs DDP; checkpoint "
                           f"{s['bytes'] / (1 << 20):.1f} MiB, saved in {s['save_s']:.2f} s, loaded in "
                           f"{s['load_s']:.2f} s"))
    print_rows("FSDP2 vs ZeRO-3 vs DDP (2 CPU processes)", rows)
    speedups = ", ".join(f"{name} {r['speedup']:.2f}x" for name, r in zip(BACKENDS, compared["rows"]) if name != "DDP")
    report(args, "FSDP2 vs ZeRO-3 vs DDP on 2 CPU processes", rows, [
        f"profile comparison took {wall:.0f} s", "peak RSS is each worker process's own peak",
        "save: the slowest rank's seconds in the synchronous checkpoint save after the last step (training waits for "
        "it); load: the slowest rank's seconds restoring that checkpoint in `opentau resume` (model, optimizer, "
        "scheduler, RNG), both timed around the product's calls by tests/hooks' BENCH_TIMING_RECORD"],
        Headline(f"samples/s vs DDP: {speedups}"))


if __name__ == "__main__":
    main()
