"""Benchmark: host memory and time to start a policy from pretrained weights, today's way vs without random init.

Both sides load the same pi05_small checkpoint (written here, seeded, as opentau saves weights) in a fresh process:
"build + load" builds the policy with its random initialization and then copies the file into it
(`build_policy` + `load_pretrained`, the path before this change and still the ZeRO-3 one); "no init" is
`build_pretrained` (parameters on the meta device, each read from the file into its own storage; the
initialization's random draws still made on scratch so the RNG ends as before, as train does with LoRA); "no init,
no draws" skips those draws (train without LoRA). Each child reports
its peak resident memory above what it held once imports were done (the kernel's peak counter reset at that point),
and the wall time of build + load. The table puts both next to the size of one copy of the weights, with ratios.

    python benchmarks/bench_startup.py            # pi05_small, 3 rounds per side, alternating
    python benchmarks/bench_startup.py --smoke    # pi05_tiny, 1 round (checks the script works)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Headline, base_parser, env, print_rows, report  # noqa: E402

SIDES = ("build + load", "no init", "no init, no draws")
POLICY = {"small": dict(preset="pi05_small", chunk_size=10, n_action_steps=10, max_state_dim=8, max_action_dim=8,
                        image_resolution=(112, 112), tokenizer_max_length=48, freeze_vision_encoder=False),
          "tiny": dict(preset="pi05_tiny", chunk_size=10, n_action_steps=8, max_state_dim=8, max_action_dim=8,
                       image_resolution=(32, 32), tokenizer_max_length=48, freeze_vision_encoder=False)}
MIB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(side: str, preset: str, checkpoint: str) -> None:
    """One side in this (fresh) process: prints its measurements as one JSON line."""
    import torch

    from opentau_cli.config.model import PolicyConfig
    from opentau_cli.policies import build_policy, build_pretrained, load_pretrained

    cfg = PolicyConfig(**POLICY[preset], pretrained_path=checkpoint)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to what the imports left
    base = _status("VmRSS")
    start = time.perf_counter()
    torch.manual_seed(0)
    if side == SIDES[0]:
        policy = build_policy(cfg)
        load_pretrained(policy, checkpoint)
    else:
        policy, _ = build_pretrained(cfg, rng_draws=side == SIDES[1])
    wall = time.perf_counter() - start
    weights = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    print(json.dumps({"peak_above_base": _status("VmHWM") - base, "wall_s": wall, "weights_bytes": weights}))


def write_checkpoint(preset: str, path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from opentau_cli.config.model import PolicyConfig
    from opentau_cli.policies import build_policy

    torch.manual_seed(1)
    state = build_policy(PolicyConfig(**POLICY[preset])).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def measure(side: str, preset: str, checkpoint: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", side, preset, str(checkpoint)], capture_output=True,
                          text=True, env=env(), timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_rows(runs: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """Rows of the table: one copy of the weights, each side's best (lowest) peak memory and time over its rounds,
    and the ratios of each other side to build + load."""
    weights = runs[SIDES[0]][0]["weights_bytes"]
    best = {side: {k: min(r[k] for r in rounds) for k in ("peak_above_base", "wall_s")} for side, rounds in runs.items()}
    rows = [("one copy of the weights (fp32)", f"{weights / MIB:.0f} MiB")]
    for side in SIDES:
        peak = best[side]["peak_above_base"]
        rows.append((f"{side}: peak RSS above imports", f"{peak / MIB:.0f} MiB ({peak / weights:.2f} copies of the weights)"))
        rows.append((f"{side}: wall time of build + load", f"{best[side]['wall_s']:.2f} s"))
    old = best[SIDES[0]]
    for side in SIDES[1:]:
        new = best[side]
        rows.append((f"{side} / build + load: peak RSS", f"{new['peak_above_base'] / old['peak_above_base']:.2f}x"))
        rows.append((f"{side} / build + load: wall time", f"{new['wall_s'] / old['wall_s']:.2f}x"))
    return rows


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
        return
    parser = base_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    preset = "tiny" if args.smoke else "small"
    rounds = 1 if args.smoke else args.rounds
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="opentau-bench-") as tmp:
        checkpoint = write_checkpoint(preset, Path(tmp) / "model.safetensors")
        for _ in range(rounds):  # alternating, so a change in machine load hits both sides alike
            for side in SIDES:
                runs[side].append(measure(side, preset, checkpoint))
    rows = [("policy", f"pi05_{preset} from a local model.safetensors, fp32, {rounds} round(s) per side in fresh "
                       "processes, best of each")] + compare_rows(runs)
    table = dict(rows)
    print_rows("Starting from pretrained weights: build + load vs no init", rows)
    report(args, "Starting from pretrained weights: build + load vs no init", rows,
           ["peak RSS: the kernel's peak resident set (VmHWM) of the child, reset once imports are done, minus its RSS "
            "at that point; it counts file pages a memory-mapped read touches",
            "every side's rounds: " + "; ".join(f"{side}: " + ", ".join(f"{r['peak_above_base'] / MIB:.0f} MiB / "
                                                                           f"{r['wall_s']:.2f} s" for r in rounds_)
                                              for side, rounds_ in runs.items())],
           Headline(f"no init, no draws / build + load: {table['no init, no draws / build + load: peak RSS']} peak RSS, "
                    f"{table['no init, no draws / build + load: wall time']} wall time"))


if __name__ == "__main__":
    main()
