"""The loop on a CPU: MetaWorld expert demonstrations -> `opentau train` -> `opentau eval --env` on seeds not in the data.

For each task (randomized object and goal positions): `opentau dataset synth --env metaworld:TASK` records the
scripted expert from seeds 0..E-1; `opentau train` trains the tiny preset on it; `opentau eval --env` rolls the
trained policy out from seeds 1000.. (never in the data), and the same policy untrained (one step at lr 1e-12: the
initial weights with the data's statistics) from the same seeds. Prints the success rates with their Wilson 95%
intervals and each stage's wall time; targets: trained >= 80% on reach, >= 50% on push, untrained <= 10%.

Why the tiny preset: it is the only one that trains in minutes on two CPU cores, and MetaWorld's 4-d
delta actions from a 4-d state and one camera need little capacity. Images at 64 px (the goal marker is then about
one pixel: the state, as LeRobot's wrapper gives it, holds no goal, so the camera is the policy's only view of it;
larger images cost CPU time); chunks of 10 actions executed whole (n_action_steps 10) as trained.
Run on 2026-12-06 (BENCHMARKS.md): reach-v3 35% (7/20) after 3000 steps against 10% untrained; push-v3 (shortened:
1000 steps) 10% against 0%: below the targets.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from _common import TINY_CONFIG, Headline, base_parser, combined, opentau_bin, print_rows, report, run, verdict

TARGETS = {"reach-v3": 0.8, "push-v3": 0.5}
UNTRAINED_TARGET = 0.1
EVAL_SEED = 1000  # the data's seeds are 0..episodes-1


def train(data: Path, out: Path, steps: int, image_size: int, extra: list[str]) -> float:
    _, wall = run([opentau_bin(), "train", "--config_path", str(TINY_CONFIG), f"--dataset.root={data}",
                   f"--output_dir={out}", f"--steps={steps}", f"--save_freq={steps}", "--validation.val_split=0",
                   "--validation.val_freq=0", f"--policy.image_resolution=[{image_size},{image_size}]",
                   f"--log_freq={max(1, steps // 10)}", *extra], timeout=7200)
    return wall


def evaluate(run_dir: Path, task: str, out: Path, rollouts: int, envs: int, max_steps: int) -> tuple[dict, float]:
    _, wall = run([opentau_bin(), "eval", str(run_dir), "--env", f"metaworld:{task}", "--rollouts", str(rollouts),
                   "--seed", str(EVAL_SEED), "--envs", str(envs), "--max-steps", str(max_steps), "--output", str(out)],
                  timeout=7200)
    return json.loads((out / "eval_info.json").read_text()), wall


def rate(info: dict) -> str:
    low, high = info["success_rate_95"]
    return f"{info['success_rate']:.0%} ({info['successes']}/{info['episodes_run']}; 95% {low:.0%}-{high:.0%})"


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--tasks", default="reach-v3,push-v3")
    parser.add_argument("--episodes", type=int, default=50, help="Expert episodes per task.")
    parser.add_argument("--steps", type=int, default=3000, help="Training steps per task.")
    parser.add_argument("--rollouts", type=int, default=30)
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=200, help="Steps per evaluated episode (the experts need ~45-60).")
    args = parser.parse_args()
    if args.smoke:
        args.tasks, args.episodes, args.steps, args.rollouts, args.max_steps = "reach-v3", 3, 2, 2, 10
    rows, notes, headlines = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_closed_loop_") as tmp:
        tmp = Path(tmp)
        for task in args.tasks.split(","):
            data = tmp / f"{task}_data"
            proc, synth_wall = run([opentau_bin(), "dataset", "synth", str(data), "--env", f"metaworld:{task}",
                                    "--episodes", str(args.episodes), "--seed", "0", "--image-size", str(args.image_size)])
            frames = json.loads((data / "meta" / "info.json").read_text())["total_frames"]
            train_wall = train(data, tmp / f"{task}_run", args.steps, args.image_size, [])
            untrained_wall = train(data, tmp / f"{task}_untrained", 1, args.image_size, ["--optimizer.lr=1e-12"])
            trained, eval_wall = evaluate(tmp / f"{task}_run", task, tmp / f"{task}_eval", args.rollouts, args.envs,
                                          args.max_steps)
            untrained, _ = evaluate(tmp / f"{task}_untrained", task, tmp / f"{task}_eval0", args.rollouts, args.envs,
                                    args.max_steps)
            target = TARGETS.get(task)
            headlines.append(Headline(f"{task} trained {trained['success_rate']:.0%} (untrained {untrained['success_rate']:.0%})",
                                      f">= {target:.0%}" if target else "none",
                                      trained["success_rate"] >= target if target else None))
            rows += [
                (f"{task}: trained success", rate(trained) + (f", {verdict(trained['success_rate'], target)} ({target:.0%})" if target else "")),
                (f"{task}: untrained success", rate(untrained) + f", {verdict(untrained['success_rate'], UNTRAINED_TARGET, higher_is_better=False)} ({UNTRAINED_TARGET:.0%})"),
                (f"{task}: expert data", f"{args.episodes} episodes, {frames} frames, recorded in {synth_wall:.0f} s"),
                (f"{task}: train", f"{args.steps} steps in {train_wall:.0f} s"),
                (f"{task}: eval (trained)", f"{args.rollouts} episodes, {trained['mean_steps']:.0f} steps on average, "
                                            f"{args.envs} envs, in {eval_wall:.0f} s"),
            ]
    notes += [f"tiny preset (configs/examples/pi05_tiny_config.json), {args.image_size} px images, chunk 10 executed whole; "
              f"eval seeds {EVAL_SEED}.. (data seeds 0..{args.episodes - 1}); at most {args.max_steps} steps per episode",
              "untrained = the same preset and data statistics after one step at lr 1e-12",
              "wall times on a shared 2-core machine with other work running"]
    print_rows("closed loop (MetaWorld expert data -> train -> eval)", rows)
    report(args, "Closed loop: expert data, train, eval in MetaWorld", rows, notes, combined(*headlines))


if __name__ == "__main__":
    main()
