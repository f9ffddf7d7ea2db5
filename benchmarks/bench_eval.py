"""Benchmark: `opentau eval --env` against LeRobot 0.4.4's `eval_policy`, env steps per second and memory per env.

The same policy (a pi05_small checkpoint with drawn weights, and its LeRobot export), env, episodes (seeds from 0),
steps per episode, envs at once and rendered image size on both sides, one after the other in one run:
`opentau eval RUN --env ENV --rollouts N --envs E --max-steps M --image-size SIZE --render fast|shipped`, and
LeRobot's own `make_env` + `eval_policy` with its pi05 on the export (tests/lerobot_eval_driver.py in the lerobot-sim
venv of scripts/peer_envs.sh). Each side is one process timed from outside (start-up and model load included); env
steps are the steps the envs took (LeRobot's vector env steps every env until the batch's last episode ends; an
untrained policy's episodes all run to the step limit, so the counts agree). Memory: the peak resident set of the
process and its children, sampled every 0.1 s from outside (psutil), divided by the envs.

Render settings: LeRobot renders with the simulator's shipped scene; opentau eval's default `--render fast` turns
shadows, multisampling and reflections off, `--render shipped` keeps them. Each is timed, and the first steps of the
same seeded episode are recorded on both sides, LeRobot's env stepped with our actions (so both follow one
trajectory), to give the mean absolute image difference (in 1/255) of our images to LeRobot's.

    python benchmarks/bench_eval.py              # metaworld:push-v3, 4 episodes of 100 steps on 2 envs, 64 px policy
    python benchmarks/bench_eval.py --env pusht
    python benchmarks/bench_eval.py --smoke      # PushT, 1 episode of 10 steps, 1 env (CI)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from _common import REPO, Headline, base_parser, combined, env, opentau_bin, print_rows, ratio_headline, report, verdict

sys.path.insert(0, str(REPO / "tests"))

TARGET = 1.5
DRIVER = REPO / "tests" / "lerobot_eval_driver.py"


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        process = psutil.Process(pid)
        total = process.memory_info().rss
        for child in process.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return 0


def measured(args: list[str], extra_env: dict, timeout: float) -> tuple[float, int]:
    """Run a command; (wall seconds, peak RSS of its process tree in bytes). A failure ends the benchmark."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env(), **extra_env},
                            cwd=REPO)
    peak = 0
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        done.set()
        sampler.join()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(out[-3000:] + err[-4000:])
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(map(str, args))}")
    return wall, peak


def image_difference(ours: Path, theirs: Path) -> float:
    """Mean absolute difference of every recorded image, ours against LeRobot's, in 1/255."""
    with np.load(ours) as a, np.load(theirs) as b:
        keys = [k for k in b.files if "/obs/observation.image" in k]
        return float(np.mean([np.abs(a[k] - b[k]).mean() for k in keys]) * 255)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--env", default=None, help="metaworld:push-v3 (default) or pusht")
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--envs", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None,
                        help="Steps per episode on both sides (default: 100; 10 with --smoke).")
    parser.add_argument("--resolution", type=int, default=64,
                        help="The policy's image size (the envs render their own).")
    parser.add_argument("--lerobot-only", action="store_true", help="Measure LeRobot's side only (no opentau eval).")
    args = parser.parse_args()
    task = args.env or ("pusht" if args.smoke else "metaworld:push-v3")
    episodes = args.episodes or (1 if args.smoke else 4)
    envs = args.envs or (1 if args.smoke else 2)
    max_steps = args.max_steps or (10 if args.smoke else 100)
    record_steps = 3 if args.smoke else 10

    from peer_envs import byte_level_tokenizer, lerobot_sim_python, sizes_for_peers
    from test_eval_peer import ENVS, PUSHT_TASK, lerobot_export, sim_checkpoint

    python = lerobot_sim_python()
    size = ENVS[task]["size"]  # what LeRobot's wrapper renders; ours is asked for the same
    sim_env = {"MUJOCO_GL": "egl"}
    task_args = ["--task", PUSHT_TASK] if task == "pusht" else []
    rows = [("env, episodes x steps, envs at once", f"{task}, {episodes} x {max_steps}, {envs}"),
            ("rendered / policy image size", f"{size} px / {args.resolution} px")]
    notes = ["LeRobot 0.4.4's make_env + eval_policy with its pi05 on our LeRobot export "
             "(tests/lerobot_eval_driver.py, lerobot-sim venv of scripts/peer_envs.sh); a pi05_small checkpoint with "
             "drawn weights; both sides draw each chunk's noise from a generator seeded with the episode's seed",
             "env steps/s: steps taken / wall time of the whole command, timed from outside (start-up and model load "
             "included); RSS: the peak of the process and its children, sampled every 0.1 s, per env = peak / envs",
             "render settings: LeRobot renders with the simulator's shipped scene (shadows, 4x multisampling, "
             "reflections); opentau eval's default `--render fast` turns those off, `--render shipped` keeps them; "
             "the image difference is the mean absolute difference of the first steps' images of the same seeded "
             "episode against LeRobot's, its env stepped with our actions"]
    headlines = []
    with tempfile.TemporaryDirectory(prefix="bench_eval_") as tmp:
        root = Path(tmp)
        tokenizer = byte_level_tokenizer(root / "tokenizer")
        sizes = root / "sizes.json"
        sizes.write_text(json.dumps(sizes_for_peers("pi05_small")))
        run, _ = sim_checkpoint(root, task, tokenizer, resolution=args.resolution)
        export = lerobot_export(run, root / "export")
        driver = [python, str(DRIVER)]
        common = [str(export), str(tokenizer), str(sizes), task, "--seed", "0", *task_args]

        lerobot_info = root / "lerobot.json"
        lerobot_wall, lerobot_rss = measured([*driver, "eval", *common, "--episodes", str(episodes), "--envs",
                                              str(envs), "--max-steps", str(max_steps), "--output", str(lerobot_info)],
                                             sim_env, 7200)
        info = json.loads(lerobot_info.read_text())
        lerobot_rate = info["env_steps"] / lerobot_wall
        rows += [("LeRobot eval_policy: env steps, wall s (episodes only)",
                  f"{info['env_steps']}, {lerobot_wall:.1f} ({info['seconds']:.1f})"),
                 ("LeRobot eval_policy: env steps/s", f"{lerobot_rate:.2f}"),
                 ("LeRobot eval_policy: peak RSS, per env",
                  f"{lerobot_rss / 2**20:.0f} MiB, {lerobot_rss / envs / 2**20:.0f} MiB")]
        renders = [] if args.lerobot_only else (["fast", "shipped"] if task != "pusht" else ["fast"])
        for render in renders:  # PushT draws with pygame: no render settings
            eval_args = [opentau_bin(), "eval", str(run), "--env", task, "--seed", "0", "--image-size", str(size),
                         "--render", render]
            ours_dir = root / f"ours_{render}"
            ours_wall, ours_rss = measured([*eval_args, "--rollouts", str(episodes), "--envs", str(envs), "--max-steps",
                                            str(max_steps), "--output", str(ours_dir)], sim_env, 7200)
            ours_steps = sum(e["steps"] for e in json.loads((ours_dir / "eval_info.json").read_text())["episodes"])
            ratio = (ours_steps / ours_wall) / lerobot_rate
            headlines.append(ratio_headline(f"env steps/s, --render {render} / LeRobot", ratio, TARGET))
            # The same seeded episode's first steps on both sides, LeRobot's env stepped with our actions (the
            # driver's --follow): the images differ by the render settings only.
            rec, theirs_rec = root / f"ours_rec_{render}", root / f"lerobot_rec_{render}.npz"
            subprocess.run([*eval_args, "--rollouts", "1", "--max-steps", str(record_steps), "--record-steps",
                            str(record_steps), "--output", str(rec)], check=True, capture_output=True,
                           env={**env(), **sim_env}, cwd=REPO, timeout=3600)
            subprocess.run([*driver, "record", *common, "--episodes", "1", "--steps", str(record_steps), "--follow",
                            str(rec / "steps.npz"), "--output", str(theirs_rec)], check=True, capture_output=True,
                           env={**env(), **sim_env}, cwd=REPO, timeout=3600)
            difference = image_difference(rec / "steps.npz", theirs_rec)
            rows += [(f"opentau eval --render {render}: env steps, wall s", f"{ours_steps}, {ours_wall:.1f}"),
                     (f"opentau eval --render {render}: env steps/s", f"{ours_steps / ours_wall:.2f}"),
                     (f"opentau eval --render {render}: peak RSS, per env",
                      f"{ours_rss / 2**20:.0f} MiB, {ours_rss / envs / 2**20:.0f} MiB"),
                     (f"opentau eval --render {render}: image difference vs LeRobot", f"{difference:.2f}/255 mean abs"),
                     (f"env steps/s, opentau --render {render} / LeRobot",
                      f"{ratio:.2f}x (target >= {TARGET}x: {verdict(ratio, TARGET)})")]
    print_rows("opentau eval vs LeRobot 0.4.4 eval_policy", rows)
    report(args, "Simulator evaluation speed", rows, notes,
           combined(*headlines) if headlines else Headline("LeRobot's side only (--lerobot-only)"))


if __name__ == "__main__":
    main()
