"""Benchmark: LoRA vs full fine-tuning of pi05_small on 2 CPU processes under DDP and ZeRO-2, through `opentau profile`.

For each backend, a full fine-tuning profile and a LoRA one (`--policy.lora.rank`) of the same config, run
alternately (full, LoRA, full, LoRA with --repeats) so machine load falls on both sides. Reports samples/s and each
rank's peak memory per side, and the ratios LoRA / full of both (memory: the larger rank's peak).

    python benchmarks/bench_lora.py                            # pi05_small, DDP and ZeRO-2, 3 warm-up + 10 steps
    python benchmarks/bench_lora.py --warmup 2 --steps 5       # fewer steps on a loaded machine
    python benchmarks/bench_lora.py --smoke                    # tiny preset, DDP only, 1 + 1 steps (CI)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXAMPLES, SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, opentau_bin, print_rows, report, run  # noqa: E402

BACKENDS = {"DDP": EXAMPLES / "accelerate_cpu_ddp_config.yaml", "ZeRO-2": EXAMPLES / "accelerate_cpu_deepspeed_config.yaml"}
MIB = 1 << 20


def profile(config: Path, accelerate: Path, extra: list[str], args, out: Path) -> dict:
    run([opentau_bin(), "profile", f"--config_path={config}", "--accelerate-config", str(accelerate),
         "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(out), *extra])
    return json.loads(out.read_text())


def trainable(config: Path, lora: list[str]) -> int:
    """Trainable parameters of the policy the config builds (on the meta device: no memory)."""
    from opentau_cli.config import load_config
    from opentau_cli.policies import count_parameters

    return count_parameters(load_config(config, lora).policy)["trainable"]


def side(reports: list[dict]) -> dict:
    """One side's medians over its repeats: samples/s and each rank's peak memory."""
    ranks = sorted({m["rank"] for r in reports for m in r["peak_memory"]})
    peaks = [statistics.median(m["bytes"] for r in reports for m in r["peak_memory"] if m["rank"] == rank) for rank in ranks]
    return {"samples_per_s": statistics.median(r["samples_per_s"] for r in reports),
            "runs": [r["samples_per_s"] for r in reports], "peaks_mib": [p / MIB for p in peaks]}


def describe(s: dict) -> str:
    runs = f" (median of {len(s['runs'])}: {', '.join(f'{v:.3f}' for v in s['runs'])})" if len(s["runs"]) > 1 else ""
    peaks = ", ".join(f"rank {i} {p:.0f} MiB" for i, p in enumerate(s["peaks_mib"]))
    return f"{s['samples_per_s']:.3f} samples/s{runs}; peak memory {peaks}"


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16, help="policy.lora.rank of the LoRA side.")
    parser.add_argument("--repeats", type=int, default=1, help="Pairs (full, LoRA) per backend, alternated.")
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    backends = {"DDP": BACKENDS["DDP"]} if args.smoke else BACKENDS
    if args.smoke:  # one warm-up step (it counts the FLOPs) and one measured: every row and ratio is printed
        args.steps, args.warmup, args.repeats = 1, 1, 1
    lora = [f"--policy.lora.rank={args.rank}"]
    reports: dict[tuple[str, str], list[dict]] = {(b, s): [] for b in backends for s in ("full", "lora")}
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        for i in range(args.repeats):
            for backend, accelerate in backends.items():
                for name, extra in (("full", []), ("lora", lora)):
                    out = Path(tmp) / f"{backend}-{name}-{i}.json"
                    reports[backend, name].append(profile(config, accelerate, extra, args, out))
    first = reports[next(iter(backends)), "full"][0]
    full_params, lora_params = trainable(config, []), trainable(config, lora)
    rows = [("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), 2 CPU processes, {args.warmup} warm-up + "
                       f"{args.steps} measured steps per run, batch {first['global_batch_size']} global, "
                       f"{args.repeats} alternated pair(s) per backend"),
            ("trainable parameters", f"full {full_params:,}; LoRA rank {args.rank} {lora_params:,} "
                                     f"({100 * lora_params / full_params:.1f}%)")]
    for backend in backends:
        full, adapted = side(reports[backend, "full"]), side(reports[backend, "lora"])
        memory = max(adapted["peaks_mib"]) / max(full["peaks_mib"])
        speed = adapted["samples_per_s"] / full["samples_per_s"]
        rows += [(f"{backend} full fine-tuning", describe(full)),
                 (f"{backend} LoRA rank {args.rank}", describe(adapted)),
                 (f"{backend} LoRA / full", f"peak memory {memory:.3f}x, samples/s {speed:.3f}x")]
    print_rows(f"LoRA rank {args.rank} vs full fine-tuning (2 CPU processes)", rows)
    report(args, f"LoRA rank {args.rank} vs full fine-tuning on 2 CPU processes (opentau profile)", rows, [
        "peak memory: each worker process's peak RSS (opentau profile; DataLoader workers not included); the "
        "memory ratio compares the larger rank's peak of each side, and RSS includes what both sides share "
        "(the interpreter, torch, the frozen base weights)",
        "ratios of the medians over each side's runs"],
        Headline("LoRA / full: " + "; ".join(f"{backend} {dict(rows)[f'{backend} LoRA / full']}" for backend in backends)))


if __name__ == "__main__":
    main()
