"""Streaming `opentau checkpoint consolidate` vs DeepSpeed's own paths, on 2-rank ZeRO-3 checkpoints of two sizes.

For each checkpoint, three ways to get a model.safetensors, side by side in one run:
- direct (the target's anchor): `zero_to_fp32.py --safe_serialization` then `sync` of the file and its directory
  (the same durability as ours, which fsyncs both). DeepSpeed's own call refuses a tied weight (safetensors: "Some
  tensors share memory"), so the tied copy is cloned before its save_file, exactly as the upstream conversion does;
- upstream two-step (what convert_checkpoint.sh used to do): `zero_to_fp32.py` writes a pickled `pytorch_model.bin`,
  a second process loads it and writes `model.safetensors`, the intermediate is deleted;
- opentau: one streaming command.
Each command runs in its own process; its wall time and peak RSS (ru_maxrss from wait4) are measured, a path's RSS
being the largest of its processes and its wall time their sum. Every round runs every path on every size (direct
and opentau in alternating order); the table gives the medians over the rounds. Every output is checked to hold
the same tensors (names, dtypes, shapes, and an xxh3 of each tensor's bytes read back with safetensors' own reader).
Every path reads the checkpoint from the page cache (it is read before each command), and dirty pages are flushed
before each command so that no path pays for another's writes.

The checkpoints are real DeepSpeed saves (accelerate launch, 2 CPU ranks, bf16) of a stack of 2048x2048 layers plus
a tied embedding, a frozen layer and buffers (tests/ds_ckpt_helper.py): 64 layers (268M parameters in the stack,
1.1 GB consolidated) and 128 layers (537M, 2.2 GB).
Targets: vs direct, wall time <= 1.0x and peak RSS <= 0.3x; vs upstream, wall time <= 0.7x and peak RSS <= 0.3x.

    python benchmarks/bench_consolidate.py            # full size (~14 GB of disk; building both checkpoints: minutes)
    python benchmarks/bench_consolidate.py --smoke    # tiny models, seconds (CI runs this)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
TESTS = Path(__file__).resolve().parents[1] / "tests"  # ds_ckpt_helper builds the checkpoints

from _common import Headline, base_parser, env, opentau_bin, print_rows, report, verdict  # noqa: E402
from opentau_cli.store.layout import DS_LATEST, MODEL_WEIGHTS, ZERO_TO_FP32  # noqa: E402

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

# name -> [dtype, shape, xxh3 of the bytes] of a safetensors file, one tensor in memory at a time (safetensors' own
# reader), printed as JSON.
DIGEST = """
import json, sys, torch, xxhash
from safetensors import safe_open
out = {}
with safe_open(sys.argv[1], "pt") as f:
    for k in f.keys():
        t = f.get_tensor(k)
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        out[k] = [str(t.dtype), list(t.shape), xxhash.xxh3_128_hexdigest(memoryview(raw))]
print(json.dumps(out))
"""

SIZES = {False: (2048, 1024, (64, 128)), True: (64, 37, (4, 8))}  # smoke -> (width, vocab, stacks)
PATHS = ("direct", "upstream", "opentau")
ZERO_TO_FP32_OUTPUT = "pytorch_model.bin"  # what zero_to_fp32.py writes without --safe_serialization


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


def digest(path: Path) -> dict:
    """DIGEST of a safetensors file, in another process: reading it here would grow this process, and a child
    started from a large process starts with its peak RSS (ru_maxrss is carried over to the spawned command)."""
    proc = subprocess.run([sys.executable, "-c", DIGEST, str(path)], capture_output=True, text=True, env=env())
    if proc.returncode != 0:
        raise SystemExit(f"reading {path} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def run_path(path: str, ckpt: Path, out: Path) -> tuple[float, int, Path]:
    """One path on one checkpoint into the fresh directory `out`: (wall s, peak RSS bytes, the safetensors file)."""
    python = sys.executable
    if path == "direct":
        w1, rss = measured([python, "-c", ZERO_TO_SAFETENSORS, str(ckpt / ZERO_TO_FP32), str(ckpt), str(out)])
        w2, _ = measured(["sync", str(out / MODEL_WEIGHTS), str(out)])
        return w1 + w2, rss, out / MODEL_WEIGHTS
    if path == "upstream":
        w1, r1 = measured([python, str(ckpt / ZERO_TO_FP32), str(ckpt), str(out / "tmp")])
        w2, r2 = measured([python, "-c", CONVERT_BIN_TO_SAFETENSORS, str(out / "tmp" / ZERO_TO_FP32_OUTPUT),
                           str(out / MODEL_WEIGHTS)])
        shutil.rmtree(out / "tmp")
        return w1 + w2, max(r1, r2), out / MODEL_WEIGHTS
    wall, rss = measured([opentau_bin(), "checkpoint", "consolidate", str(ckpt), "--output", str(out / MODEL_WEIGHTS)])
    return wall, rss, out / MODEL_WEIGHTS


def one_round(ckpt: Path, work: Path, order: tuple[str, ...]) -> tuple[dict, dict]:
    """Every path once on ckpt, in `order`: ({path: (wall, rss)}, {path: digest of its output}); outputs deleted."""
    times, digests = {}, {}
    for path in order:
        out = work / f"out_{path}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        read_into_page_cache(ckpt)
        try:
            wall, rss, file = run_path(path, ckpt, out)
            times[path] = (wall, rss)
            digests[path] = (digest(file), file.stat().st_size)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return times, digests


def describe(ckpt: Path, size: int, built: str | None) -> str:
    """What was consolidated, from the files themselves (and the shape asked for, when this run built it)."""
    ckpt_size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    return (f"{built or f'reused {ckpt.name}'}: {size / 4e6:.0f}M fp32 values = {size / 1e9:.2f} GB consolidated "
            f"(checkpoint {ckpt_size / 1e9:.2f} GB)")


def ratio_row(name: str, ratios: list[float], target: float) -> tuple[str, str]:
    """A table row of opentau's ratios at each size against a target it must not exceed."""
    ok = all(verdict(x, target, higher_is_better=False) == "meets target" for x in ratios)
    return (f"{name} (target <= {target})", " / ".join(f"{x:.2f}x" for x in ratios) + (" meets target" if ok else " ABOVE target"))


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="Where the checkpoints are built (default: a temp dir); zero3_stack<N>/ there are reused.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of every path on every size (medians reported).")
    parser.add_argument("--keep", action="store_true", help="Keep the checkpoints.")
    args = parser.parse_args()
    width, vocab, stacks = SIZES[args.smoke]
    rounds = 1 if args.smoke else args.rounds

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_consolidate_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        ckpts, built = {}, {}
        for stack in stacks:
            ckpt = ckpts[stack] = work / f"zero3_stack{stack}"
            built[stack] = None
            if not (ckpt / DS_LATEST).exists():
                built[stack] = f"stack {stack}x{width}x{width} + tied embedding {vocab}x{width}"
                t = time.perf_counter()
                # In another process: the helper imports torch, and this one stays small (see digest).
                launch = (f"import ds_ckpt_helper; ds_ckpt_helper.launch({str(ckpt)!r}, zero_stage=3, num_processes=2, "
                          f"mixed_precision='bf16', width={width}, vocab={vocab}, stack={stack}, steps=1, timeout=3600)")
                subprocess.run([sys.executable, "-c", launch], check=True, env={**env(), "PYTHONPATH": str(TESTS)})
                print(f"built the {stack}-layer ZeRO-3 2-rank checkpoint in {time.perf_counter() - t:.0f}s: {ckpt}")

        walls = {(s, p): [] for s in stacks for p in PATHS}
        rss = {(s, p): [] for s in stacks for p in PATHS}
        sizes = {}
        start = time.perf_counter()
        for r in range(rounds):
            # direct and opentau swap places every round: neither always runs on the other's leftovers
            order = ("direct", "opentau", "upstream") if r % 2 == 0 else ("opentau", "direct", "upstream")
            for stack in stacks:
                times, digests = one_round(ckpts[stack], work, order)
                if not digests["opentau"][0] == digests["direct"][0] == digests["upstream"][0]:
                    raise SystemExit(f"outputs differ on {ckpts[stack]}")
                sizes[stack] = digests["opentau"][1]
                for p, (w, m) in times.items():
                    walls[stack, p].append(w)
                    rss[stack, p].append(m)
                print(f"round {r + 1}/{rounds}, {stack} layers: "
                      + ", ".join(f"{p} {w:.2f} s {m / 2**20:.0f} MiB" for p, (w, m) in times.items()), flush=True)
        took = time.perf_counter() - start

        med = {k: statistics.median(v) for k, v in walls.items()}
        peak = {k: statistics.median(v) for k, v in rss.items()}
        label = " / ".join(f"{s} layers" for s in stacks)

        def per_size(fmt) -> str:
            return " / ".join(fmt(s) for s in stacks)

        def ratio(name: str, values: dict, other: str, target: float) -> tuple[str, str]:
            return ratio_row(f"{name} vs {other}, {label}", [values[s, "opentau"] / values[s, other] for s in stacks], target)

        mib = 2**20
        rows = [(f"model, {s} layers", describe(ckpts[s], sizes[s], built[s])) for s in stacks]
        rows += [
            (f"direct wall (zero_to_fp32 --safe_serialization + sync), {label}", per_size(lambda s: f"{med[s, 'direct']:.2f} s")),
            (f"opentau consolidate wall, {label}", per_size(lambda s: f"{med[s, 'opentau']:.2f} s")),
            ratio("wall ratio", med, "direct", 1.0),
            (f"direct peak RSS, {label}", per_size(lambda s: f"{peak[s, 'direct'] / mib:.0f} MiB")),
            (f"opentau consolidate peak RSS, {label}", per_size(lambda s: f"{peak[s, 'opentau'] / mib:.0f} MiB")),
            ratio("RSS ratio", peak, "direct", 0.3),
            (f"upstream wall (zero_to_fp32 + convert), {label}", per_size(lambda s: f"{med[s, 'upstream']:.2f} s")),
            (f"upstream peak RSS, {label}", per_size(lambda s: f"{peak[s, 'upstream'] / mib:.0f} MiB")),
            ratio("wall ratio", med, "upstream", 0.7),
            ratio("RSS ratio", peak, "upstream", 0.3),
            (f"opentau wall in each round, {label}",
             per_size(lambda s: ", ".join(f"{w:.2f}" for w in walls[s, "opentau"]))),
            (f"direct wall in each round, {label}",
             per_size(lambda s: ", ".join(f"{w:.2f}" for w in walls[s, "direct"]))),
            ("outputs", "identical (names, dtypes, shapes, bytes) on every path, size and round"),
        ]
        title = "Streaming consolidation vs zero_to_fp32 (direct and two-step), ZeRO-3 at two sizes"
        print_rows(title, rows)
        wall, memory = ([values[s, "opentau"] / values[s, "direct"] for s in stacks] for values in (med, peak))
        headline = Headline(f"vs direct, {label}: wall {' / '.join(f'{x:.2f}x' for x in wall)}, RSS "
                            f"{' / '.join(f'{x:.2f}x' for x in memory)}", "wall <= 1.0x, RSS <= 0.3x",
                            max(wall) <= 1.0 and max(memory) <= 0.3)
        report(args, title, rows, [
            f"medians of {rounds} round(s); each round runs every path on every size (direct and opentau alternate "
            f"which goes first); {took:.0f} s in all",
            "Every path reads the checkpoint from the page cache (read before each command); dirty pages are "
            "flushed before each command. Peak RSS is ru_maxrss of each process (the baseline of a Python "
            "process with torch imported is included in all).",
            "The upstream path writes without fsync; the direct path's `sync` and opentau fsync the output "
            "file and its directory."], headline)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
