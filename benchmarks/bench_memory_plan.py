"""Benchmark: the memory plan of the example pi05 config on 8 GPUs (opentau_cli.memory_plan), the README's table.

The plan is computed without a GPU (the full model's parameter counts on the meta device plus one step of the real
model on fake tensors, cached per shape), for each launch the README lists: DDP at 8 per device (what the example
used to run), DDP, ZeRO-2 and ZeRO-3 at the example's 4 per device x 2 accumulation; with the parts of the DDP plan.
How close the plan comes to a measured peak is tests/test_memory_plan.py's business (pi05_small on CPU, within 10%)
and the GPU self-check's (`torch.cuda.max_memory_allocated`).

    python benchmarks/bench_memory_plan.py            # full pi05 (the first run takes minutes: fake-tensor steps)
    python benchmarks/bench_memory_plan.py --smoke    # pi05_tiny (CI)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXAMPLES, append_result, base_parser, print_rows  # noqa: E402

CARD = 80 * 10**9
LAUNCHES = [  # (row, Accelerate YAML, overrides)
    ("DDP, 8 x 1", "accelerate_ddp_config.yaml", ["--per_device_batch_size=8", "--gradient_accumulation_steps=1"]),
    ("DDP, 4 x 2 (the example)", "accelerate_ddp_config.yaml", []),
    ("ZeRO-2, 4 x 2", "accelerate_deepspeed_config.yaml", []),
    ("ZeRO-3, 4 x 2", "accelerate_deepspeed_zero3_config.yaml", []),
]


def plan_rows(smoke: bool) -> list[tuple[str, str]]:
    from opentau_cli.config import load_config, resolve_accelerate_config
    from opentau_cli.memory_plan import gb, plan_memory

    rows, example_parts = [], None
    for name, yaml, overrides in LAUNCHES:
        extra = ["--policy.preset=pi05_tiny", "--policy.image_resolution=[32,32]"] if smoke else []
        cfg = load_config(EXAMPLES / "pi05_config.json", [*overrides, *extra, "--policy.pretrained_path=null",
                                                          "--policy.tokenizer_path=null"], environ={})
        plan = plan_memory(cfg, resolve_accelerate_config(EXAMPLES / yaml))
        verdict = "fits" if plan.fits(CARD) else "does not fit"
        rows.append((name, f"{gb(plan.total)} peak per GPU; {verdict} 80 GB (margin {gb(CARD - plan.total)})"))
        if name.endswith("(the example)"):
            example_parts = plan.parts
    rows += [(f"DDP example: {part}", gb(n)) for part, n in example_parts.items() if n]
    return rows


def main() -> None:
    args = base_parser(__doc__).parse_args()
    rows = [("config", f"configs/examples/pi05_config.json{' with pi05_tiny (smoke)' if args.smoke else ''}, 8 GPUs")]
    rows += plan_rows(args.smoke)
    print_rows("Memory plan of the example pi05 config, 8 GPUs", rows)
    if not args.no_append:
        notes = ["computed, not measured: opentau_cli.memory_plan (parameter counts + a fake-tensor step per shape)"]
        if args.smoke:
            notes.insert(0, "smoke run: numbers only show the script works")
        append_result("Memory plan of the example pi05 config on 8 GPUs", rows, notes, path=args.results)


if __name__ == "__main__":
    main()
