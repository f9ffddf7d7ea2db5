"""Streaming `opentau checkpoint consolidate` vs DeepSpeed's own paths, on a ZeRO-3 and a ZeRO-2 2-rank checkpoint.

For each checkpoint, three ways to get a model.safetensors, side by side in one run:
- upstream two-step (what convert_checkpoint.sh used to do): DeepSpeed's `zero_to_fp32.py` writes a pickled
  `pytorch_model.bin`, a second process loads it and writes `model.safetensors`, the intermediate is deleted;
- direct: `zero_to_fp32.py --safe_serialization` then `sync` of the file and its directory (the same durability as
  ours, which fsyncs both). DeepSpeed's own call refuses a tied weight (safetensors: "Some tensors share memory"), so
  the tied copy is cloned before its save_file, exactly as the upstream conversion step does;
- opentau: one streaming command.
Each command runs in its own process; its wall time and peak RSS (ru_maxrss from wait4) are measured, a path's RSS
being the largest of its processes and its wall time their sum. All outputs are checked to be equal. Every path
reads the checkpoint from the page cache (it is read once first), and dirty pages are flushed before each command so
that no path pays for another's writes.

The checkpoints are real DeepSpeed saves (accelerate launch, 2 CPU ranks, bf16) of a ~275M-parameter model: a stack
of 64 2048x2048 layers plus a tied embedding, a frozen layer and buffers (tests/ds_ckpt_helper.py).
Targets: vs upstream, peak RSS <= 0.3x and wall time <= 0.7x; vs direct, peak RSS <= 0.3x and wall time <= 1.0x.

    python benchmarks/bench_consolidate.py            # full size (needs ~12 GB of disk, several minutes)
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

from _common import append_result, base_parser, env, opentau_bin, print_rows, verdict  # noqa: E402
import ds_ckpt_helper  # noqa: E402
from opentau_cli.checkpoint.layout import DS_LATEST, MODEL_WEIGHTS, ZERO_TO_FP32  # noqa: E402

# safetensors needs separate tensors where the state dict names one storage twice (the tied weight).
UNTIE = """
def untie(sd):
    seen = set()
    for k, v in sd.items():
        if v.data_ptr() in seen:
            sd[k] = v.clone()
        seen.add(v.data_ptr())
    return sd
"""

CONVERT_BIN_TO_SAFETENSORS = UNTIE + """
import sys, torch
from safetensors.torch import save_file
save_file(untie(torch.load(sys.argv[1], weights_only=True)), sys.argv[2], metadata={"format": "pt"})
"""

# zero_to_fp32.py CKPT OUT --safe_serialization, run as DeepSpeed ships it, its save_file given untied tensors.
ZERO_TO_SAFETENSORS = UNTIE + """
import runpy, sys
import safetensors.torch
save_file = safetensors.torch.save_file
safetensors.torch.save_file = lambda sd, *args, **kwargs: save_file(untie(sd), *args, **kwargs)
script, ckpt, out = sys.argv[1:]
sys.argv = [script, ckpt, out, "--safe_serialization"]
runpy.run_path(script, run_name="__main__")
"""

# Equal names, dtypes, shapes and values, one tensor at a time (three 1 GB files need not fit in memory at once).
COMPARE = """
import sys, torch
from safetensors import safe_open
first, *others = [safe_open(p, "pt") for p in sys.argv[1:]]
names = sorted(first.keys())
for i, other in enumerate(others, 2):
    assert sorted(other.keys()) == names, f"file {i}: different tensor names"
for k in names:
    a = first.get_tensor(k)
    for other in others:
        b = other.get_tensor(k)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k
print(len(names))
"""


def measured(cmd: list[str]) -> tuple[float, int]:
    """Run cmd in a fresh process; returns (wall seconds, peak RSS bytes of that process)."""
    os.sync()  # the previous command's dirty pages are written back now, not during this one's fsync
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


def read_into_page_cache(ckpt: Path) -> None:
    for p in ckpt.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                while f.read(1 << 24):
                    pass


def ratio_row(name: str, value: float, target: float) -> tuple[str, str]:
    return f"{name} (target <= {target})", f"{value:.2f}x {verdict(value, target, higher_is_better=False)}"


def compare_paths(ckpt: Path, work: Path, model: str) -> list[tuple[str, str]]:
    """Run the three paths on one checkpoint; the result rows (outputs are deleted afterwards)."""
    python = sys.executable
    up_dir, direct_dir, ours_dir = work / "upstream", work / "direct", work / "ours"
    for d in (up_dir, direct_dir, ours_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    read_into_page_cache(ckpt)
    try:
        d1, rss_direct = measured([python, "-c", ZERO_TO_SAFETENSORS, str(ckpt / ZERO_TO_FP32), str(ckpt), str(direct_dir)])
        d2, _ = measured(["sync", str(direct_dir / MODEL_WEIGHTS), str(direct_dir)])
        w1, r1 = measured([python, str(ckpt / ZERO_TO_FP32), str(ckpt), str(up_dir / "tmp")])
        w2, r2 = measured([python, "-c", CONVERT_BIN_TO_SAFETENSORS, str(up_dir / "tmp" / ds_ckpt_helper.ZERO_TO_FP32_OUTPUT),
                           str(up_dir / MODEL_WEIGHTS)])
        shutil.rmtree(up_dir / "tmp")
        ours_wall, ours_rss = measured([opentau_bin(), "checkpoint", "consolidate", str(ckpt), "--output",
                                        str(ours_dir / MODEL_WEIGHTS)])
        outputs = [str(d / MODEL_WEIGHTS) for d in (ours_dir, up_dir, direct_dir)]
        check = subprocess.run([python, "-c", COMPARE, *outputs], capture_output=True, text=True, env=env())
        if check.returncode != 0:
            raise SystemExit(f"outputs differ: {check.stderr[-2000:]}")
        size = (ours_dir / MODEL_WEIGHTS).stat().st_size
    finally:
        for d in (up_dir, direct_dir, ours_dir):
            shutil.rmtree(d, ignore_errors=True)
    up_wall, up_rss, direct_wall = w1 + w2, max(r1, r2), d1 + d2
    ckpt_size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    mib = 2**20
    return [
        ("model", f"{model}: {int(check.stdout)} tensors, {size / 1e6:.1f} MB fp32 (checkpoint {ckpt_size / 1e6:.0f} MB)"),
        ("upstream wall (zero_to_fp32 + convert)", f"{up_wall:.2f} s ({w1:.2f} + {w2:.2f})"),
        ("upstream peak RSS", f"{up_rss / mib:.0f} MiB (zero_to_fp32 {r1 / mib:.0f}, convert {r2 / mib:.0f})"),
        ("direct wall (zero_to_fp32 --safe_serialization + sync)", f"{direct_wall:.2f} s ({d1:.2f} + {d2:.2f})"),
        ("direct peak RSS", f"{rss_direct / mib:.0f} MiB"),
        ("opentau consolidate wall", f"{ours_wall:.2f} s"),
        ("opentau consolidate peak RSS", f"{ours_rss / mib:.0f} MiB"),
        ratio_row("RSS ratio vs upstream", ours_rss / up_rss, 0.3),
        ratio_row("wall ratio vs upstream", ours_wall / up_wall, 0.7),
        ratio_row("RSS ratio vs direct", ours_rss / rss_direct, 0.3),
        ratio_row("wall ratio vs direct", ours_wall / direct_wall, 1.0),
        ("outputs", "identical (names, dtypes, shapes, values)"),
    ]


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="Where the checkpoints are built (default: a temp dir); zero3/ and zero2/ there are reused.")
    parser.add_argument("--keep", action="store_true", help="Keep the checkpoints.")
    args = parser.parse_args()
    width, stack, vocab = (64, 4, 37) if args.smoke else (2048, 64, 1024)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_consolidate_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for stage in (3, 2):
            ckpt = work / f"zero{stage}"
            model = f"ZeRO-{stage}, 2 ranks, bf16, "
            if (ckpt / DS_LATEST).exists():
                model += f"reused from {ckpt}"
            else:
                t = time.perf_counter()
                ds_ckpt_helper.launch(ckpt, zero_stage=stage, num_processes=2, mixed_precision="bf16", width=width,
                                      vocab=vocab, stack=stack, steps=1, timeout=3600)
                print(f"built the ZeRO-{stage} 2-rank checkpoint in {time.perf_counter() - t:.0f}s: {ckpt}")
                model += f"{'smoke ' if args.smoke else ''}stack {stack}x{width}x{width} + tied embedding {vocab}x{width}"
            rows = compare_paths(ckpt, work, model)
            title = f"Streaming consolidation vs zero_to_fp32 (two-step and direct), ZeRO-{stage}"
            print_rows(title, rows)
            if not args.no_append:
                notes = ["Every path reads the checkpoint from the page cache (read once first); dirty pages are "
                         "flushed before each command. Peak RSS is ru_maxrss of each process (the baseline of a "
                         "Python process with torch imported is included in all).",
                         "The upstream path writes without fsync; the direct path's `sync` and opentau fsync the "
                         "output file and its directory."]
                if args.smoke:
                    notes.append("Smoke run: tiny model, ratios are not meaningful.")
                path = append_result(title, rows, notes, path=args.results)
                print(f"appended to {path}")
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
