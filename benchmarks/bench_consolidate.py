"""Streaming `opentau checkpoint consolidate` vs the upstream two-step path, on a ZeRO-3 2-rank checkpoint.

Upstream (what convert_checkpoint.sh used to do): DeepSpeed's `zero_to_fp32.py` writes a pickled `pytorch_model.bin`,
a second process loads it and writes `model.safetensors`, the intermediate is deleted. Ours: one streaming command.
Each command runs in its own process; its wall time and peak RSS (ru_maxrss from wait4) are measured, the upstream
path's RSS being the larger of its two processes and its wall time their sum. Both outputs are checked to be equal.

The checkpoint is a real DeepSpeed ZeRO-3 save (accelerate launch, 2 CPU ranks, bf16) of a ~280M-parameter model:
a stack of 64 2048x2048 layers plus a tied embedding, a frozen layer and buffers (tests/ds_ckpt_helper.py).
Targets: peak RSS <= 0.3x, wall time <= 0.7x of upstream.

    python benchmarks/bench_consolidate.py            # full size (needs ~6 GB of disk, a few minutes)
    python benchmarks/bench_consolidate.py --smoke    # tiny model, seconds (CI runs this)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import append_result, base_parser, env, opentau_bin, print_rows  # noqa: E402
import ds_ckpt_helper  # noqa: E402

CONVERT_BIN_TO_SAFETENSORS = """
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], weights_only=True)
seen = set()
for k, v in sd.items():  # tied weights share storage; safetensors needs separate tensors
    if v.data_ptr() in seen:
        sd[k] = v.clone()
    seen.add(v.data_ptr())
save_file(sd, sys.argv[2], metadata={"format": "pt"})
"""

COMPARE = """
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert sorted(a) == sorted(b), "different tensor names"
for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
print(len(a))
"""


def measured(cmd: list[str]) -> tuple[float, int]:
    """Run cmd in a fresh process; returns (wall seconds, peak RSS bytes of that process)."""
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a chatty child can never block on a full pipe
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env={**env(), "DS_ACCELERATOR": "cpu"}, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not the benchmark's
        wall = time.perf_counter() - start
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        if code != 0:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise SystemExit(f"command failed ({code}): {' '.join(cmd)}")
    return wall, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--workdir", type=Path, default=None, help="Where to build the checkpoint (default: a temp dir).")
    parser.add_argument("--keep", action="store_true", help="Keep the checkpoint and outputs.")
    args = parser.parse_args()
    width, stack, vocab = (64, 4, 37) if args.smoke else (2048, 64, 1024)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_consolidate_"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    try:
        if not (ckpt / "latest").exists():
            t = time.perf_counter()
            ds_ckpt_helper.launch(ckpt, zero_stage=3, num_processes=2, mixed_precision="bf16", width=width,
                                  vocab=vocab, stack=stack, steps=1, timeout=3600)
            print(f"built the ZeRO-3 2-rank checkpoint in {time.perf_counter() - t:.0f}s: {ckpt}")
        python = sys.executable

        up_dir, ours_dir = work / "upstream", work / "ours"
        for d in (up_dir, ours_dir):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
        w1, r1 = measured([python, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(up_dir / "tmp")])
        w2, r2 = measured([python, "-c", CONVERT_BIN_TO_SAFETENSORS, str(up_dir / "tmp" / "pytorch_model.bin"),
                           str(up_dir / "model.safetensors")])
        shutil.rmtree(up_dir / "tmp")
        up_wall, up_rss = w1 + w2, max(r1, r2)
        ours_wall, ours_rss = measured([opentau_bin(), "checkpoint", "consolidate", str(ckpt), "--output",
                                        str(ours_dir / "model.safetensors")])

        check = subprocess.run([python, "-c", COMPARE, str(up_dir / "model.safetensors"), str(ours_dir / "model.safetensors")],
                               capture_output=True, text=True, env=env())
        if check.returncode != 0:
            raise SystemExit(f"outputs differ: {check.stderr[-2000:]}")
        n_tensors = int(check.stdout.strip())
        size = (ours_dir / "model.safetensors").stat().st_size
        ckpt_size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        rss_ratio, wall_ratio = ours_rss / up_rss, ours_wall / up_wall
        rows = [
            ("model", f"{'smoke ' if args.smoke else ''}stack {stack}x{width}x{width} + tied embedding {vocab}x{width}: "
                      f"{n_tensors} tensors, {size / 1e9:.3f} GB fp32 (checkpoint {ckpt_size / 1e9:.2f} GB)"),
            ("upstream wall (zero_to_fp32 + convert)", f"{up_wall:.2f} s ({w1:.2f} + {w2:.2f})"),
            ("upstream peak RSS", f"{up_rss / 2**20:.0f} MiB (zero_to_fp32 {r1 / 2**20:.0f}, convert {r2 / 2**20:.0f})"),
            ("opentau consolidate wall", f"{ours_wall:.2f} s"),
            ("opentau consolidate peak RSS", f"{ours_rss / 2**20:.0f} MiB"),
            ("RSS ratio (target <= 0.3)", f"{rss_ratio:.2f}x {'meets target' if rss_ratio <= 0.3 else 'ABOVE target'}"),
            ("wall ratio (target <= 0.7)", f"{wall_ratio:.2f}x {'meets target' if wall_ratio <= 0.7 else 'ABOVE target'}"),
            ("outputs", "identical (names, dtypes, shapes, values)"),
        ]
        print_rows("consolidate: opentau vs upstream two-step", rows)
        if not args.no_append:
            notes = ["Both read the checkpoint from the page cache (it was just written); peak RSS is ru_maxrss of each "
                     "process (the baseline of a Python process with torch imported is included in both)."]
            if args.smoke:
                notes.append("Smoke run: tiny model, ratios are not meaningful.")
            path = append_result("Streaming consolidation vs zero_to_fp32 + conversion", rows, notes, path=args.results)
            print(f"appended to {path}")
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
