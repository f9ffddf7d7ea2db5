"""Training steps/s with the evaluation in a simulator on (eval.env) vs off, side by side.

The evaluation runs in a process of its own started by the launcher (process/evaluator.py), never on the ranks; the
question is what it costs the training loop when it shares the machine. Runs are launched in pairs (off, on, off,
on) on the same synthetic MetaWorld expert data; steps/s is read from each run's metrics.jsonl (the training rows'
samples_per_s, which counts training steps' time only; the first interval dropped as warm-up). With 2 cores or more the cores are split as on a GPU node's host (tests/hooks): the
rank and its data workers on core 0, the launcher and the evaluation on core 1 (also eval.cpus=[1], which the
evaluation process applies with os.sched_setaffinity). Target: >= 0.95x when the evaluation has a core of its own.
The 1-minute load average before and after each launch is reported beside the ratio: with other work on the machine
the split cores are not the runs' own, and the ratio measures that work too.

    python benchmarks/bench_eval_training.py --results FILE   # 120 steps, a save every 20, 3 pairs of launches
    python benchmarks/bench_eval_training.py --smoke          # 20 steps, 1 pair (CI)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY_CONFIG, base_parser, opentau_bin, print_rows, ratio_headline, report, run, verdict  # noqa: E402

ENV = "metaworld:reach-v3"


def steps_per_second(run_dir: Path, batch_size: int) -> float:
    """The median training steps/s of the run's logged intervals (metrics.jsonl `samples_per_s`, which counts the
    training steps' time only), the first interval dropped as warm-up."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in rows if r.get("kind") == "train"][1:]
    return statistics.median(rates) / batch_size


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/opentau-bench-eval-training"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=3)  # a median that one disturbed pair cannot move
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.save_every, args.rollouts, args.pairs = 20, 10, 2, 1
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "reach"
    run([opentau_bin(), "dataset", "synth", str(data), "--env", ENV, "--episodes", "4", "--seed", "0",
         "--image-size", "32"])
    config = args.config or TINY_CONFIG
    batch_size = json.loads(Path(config).read_text())["batch_size"]
    common = [opentau_bin(), "train", "--config_path", str(config), f"--dataset.root={data}", f"--steps={args.steps}",
              f"--save_freq={args.save_every}", "--log_freq=5", "--validation.val_split=0", "--validation.val_freq=0",
              "--dataset.num_workers=0"]
    split = (os.cpu_count() or 1) >= 2
    variables = {"OMP_NUM_THREADS": "1", "BENCH_RANK_CPUS": "0", "BENCH_OTHER_CPUS": "1",
                 "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "tests" / "hooks")} if split else {}
    on_flags = [f"--eval.env={ENV}", f"--eval.rollouts={args.rollouts}", "--eval.max_steps=50",
                *(["--eval.cpus=[1]"] if split else [])]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    loads: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}  # 1-minute load average before, after
    evaluated = []
    try:
        for pair in range(args.pairs):
            for side in ("off", "on"):
                out = work / f"{side}-{pair}"
                before = os.getloadavg()[0]
                run([*common, f"--output_dir={out}", *(on_flags if side == "on" else [])], extra_env=variables)
                loads[side].append((before, os.getloadavg()[0]))
                rates[side].append(steps_per_second(out, batch_size))
                if side == "on":
                    records = [json.loads(p.read_text()) for p in (out / "evals").glob("0*.json")]
                    evaluated.append(sum(r["status"] == "done" for r in records))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.smoke:
            shutil.rmtree(work, ignore_errors=True)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    pairs = [f"{a / b:.3f}x" for a, b in zip(rates["on"], rates["off"])]
    saves = args.steps // args.save_every
    where = "rank on core 0, launcher and evaluation on core 1" if split else "one core shared"
    shown = {side: ", ".join(f"{a:.1f}-{b:.1f}" for a, b in loads[side]) for side in loads}
    rows = [("training steps/s, eval.env off", f"{off:.2f}"),
            ("training steps/s, eval.env on", f"{on:.2f} ({' and '.join(map(str, evaluated))} of {saves} checkpoints "
                                              f"evaluated, the rest skipped as newer ones arrived)"),
            (f"on / off ({where})", f"{on / off:.3f}x (target >= 0.95x, {verdict(on / off, 0.95)}); pair by pair "
                                    f"{', '.join(pairs)}"),
            ("machine load (1-min average, before-after each launch)",
             f"off {shown['off']}; on {shown['on']} (on {os.cpu_count()} CPUs: above 2, other work shares the "
             "cores the split gives each side)")]
    title = "Evaluation during training: training steps/s with eval.env on vs off"
    print_rows(title, rows)
    report(args, title, rows, [f"{args.steps} steps, save_freq {args.save_every}, {args.rollouts} rollouts of "
                               f"{ENV} per evaluation, {args.pairs} pair(s) of launches (medians); tiny preset unless "
                               "--config"],
           ratio_headline(f"training steps/s, eval.env on / off ({where})", on / off, 0.95, digits=3))


if __name__ == "__main__":
    main()
