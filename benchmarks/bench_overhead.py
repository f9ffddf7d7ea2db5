"""Benchmark 1, framework overhead: `opentau train` steps/s vs a minimal hand-written Accelerate loop.

Same model (pi05_small), batch and data, one process. opentau's steps/s is timed from outside, between its progress
lines at step `warmup` and `warmup + steps` (it logs every `warmup` steps); the anchor is benchmarks/handwritten_loop.py.
Target: ratio >= 0.95. Each side runs `--repeats` times alternately; the best of each is compared (noise only slows).

    python benchmarks/bench_overhead.py            # pi05_small, 5 warm-up + 20 measured steps
    python benchmarks/bench_overhead.py --smoke    # tiny preset, a few steps (CI)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, SMALL_CONFIG, TINY_CONFIG, append_result, base_parser, env, opentau_bin, print_rows, run, verdict  # noqa: E402

HERE = Path(__file__).resolve().parent


def opentau_steps_per_s(config: Path, warmup: int, steps: int, workdir: Path) -> float:
    """Steps/s of a real `opentau train` run, timed from outside: the arrival times of its progress lines at step
    `warmup` and `warmup + steps` (so the loop's own logging, collectives and progress are all counted)."""
    out = workdir / "run"
    cmd = [opentau_bin(), "train", f"--config_path={config}", f"--output_dir={out}", "--overwrite=true",
           f"--steps={warmup + steps}", f"--log_freq={warmup}", f"--save_freq={10**9}", "--validation.val_freq=0",
           "--logging.tensorboard=false", "--logging.progress_bar=plain", "--scheduler.warmup_steps=0"]
    seen: dict[int, float] = {}
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"step (\d+)/\d+", line)
        if m:
            seen[int(m.group(1))] = time.perf_counter()
    if proc.wait() != 0 or warmup not in seen or warmup + steps not in seen:
        raise SystemExit(f"opentau train failed or logged no progress ({proc.returncode}):\n{''.join(lines[-30:])}")
    return steps / (seen[warmup + steps] - seen[warmup])


def handwritten_steps_per_s(config: Path, warmup: int, steps: int) -> float:
    proc, _ = run([sys.executable, str(HERE / "handwritten_loop.py"), "--config", str(config), "--steps", str(steps),
                   "--warmup", str(warmup), "--validation.val_freq=0"])
    return json.loads(proc.stdout.strip().splitlines()[-1])["steps_per_s"]


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=20, help="Measured steps (a multiple of --warmup).")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    if args.smoke:
        args.steps, args.warmup, args.repeats = 4, 2, 1
    if args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (opentau logs every --warmup steps)")
    ours, anchor = [], []
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        for _ in range(args.repeats):
            ours.append(opentau_steps_per_s(config, args.warmup, args.steps, Path(tmp)))
            anchor.append(handwritten_steps_per_s(config, args.warmup, args.steps))
    ratio = max(ours) / max(anchor)
    rows = [
        ("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), {args.warmup} warm-up + {args.steps} measured steps, 1 process"),
        ("opentau train steps/s (best of runs)", f"{max(ours):.3f} (runs: {', '.join(f'{x:.3f}' for x in ours)})"),
        ("hand-written Accelerate loop steps/s", f"{max(anchor):.3f} (runs: {', '.join(f'{x:.3f}' for x in anchor)})"),
        ("ratio opentau / hand-written", f"{ratio:.3f} (target >= 0.95: {verdict(ratio, 0.95)})"),
    ]
    print_rows("Benchmark 1: framework overhead", rows)
    if not args.no_append:
        append_result("Framework overhead: opentau train vs hand-written Accelerate loop", rows,
                      ["smoke run: numbers only show the script works" if args.smoke else "best of each side's runs"],
                      path=args.results)


if __name__ == "__main__":
    main()
