"""The evaluation of one published checkpoint during training (eval.env): a process of its own, started by the
launcher's evaluation thread (process/evaluator.py), never on the ranks (docs/ARCHITECTURE.md, "Evaluation during
training").

    python -m opentau_cli.sim.watch RUN_DIR CHECKPOINT_DIR

It reads the checkpoint's own train_config.json (its eval section), loads the published checkpoint as `opentau eval`
does (tools/serve.load_served: consolidated weights, DeepSpeed and DCP shards read offline, so no rank gathers
anything), rolls out eval.rollouts episodes from eval.seed, then logs the result at the checkpoint's step
(metrics.jsonl, TensorBoard, MLflow by run id) and writes evals/<step>.json last, atomically: a kill before that
leaves no record, and the launcher redoes it. With checkpoint.best_metric eval/success_rate it repoints
checkpoints/best.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from opentau_cli.config.model import EVAL_SUCCESS, TrainConfig
from opentau_cli.errors import UserError
from opentau_cli.store import evals
from opentau_cli.store.layout import BEST, CHECKPOINTS, METRICS, TB_RUN, TENSORBOARD, TRAIN_CONFIG, point_last, step_of

NICE = 10  # below the ranks, as the asynchronous save's writer (train/async_save.py)


def check_eval_setting(cfg: TrainConfig) -> None:
    """What `opentau eval --env` would refuse about this run's policy in eval.env, refused before launch: an unknown or
    uninstalled env, cameras or widths the env cannot give the policy (sim/rollout.check_policy_env, with the policy
    built from the config)."""
    if not cfg.eval.enabled:
        return
    from types import SimpleNamespace

    from opentau_cli.sim.envs import make_env, parse_env
    from opentau_cli.sim.rollout import check_policy_env

    try:
        env = make_env(parse_env(cfg.eval.env), tuple(cfg.policy.image_resolution))
    except UserError as e:
        raise UserError(_as_setting(str(e))) from None
    try:
        policy = _configured_policy(cfg, SimpleNamespace)
        if policy is not None:
            check_policy_env(policy, env, cfg.eval.camera_map)
    except UserError as e:
        raise UserError(f"eval.env {cfg.eval.env}: {_as_setting(str(e))}") from None
    finally:
        env.close()


def _as_setting(message: str) -> str:
    """`opentau eval`'s sentence with its flags named as the eval section's settings."""
    message = re.sub(r"--camera-map ([^=\s]+)=([^\s]+?)(\.?)$", r'eval.camera_map {"\1": "\2"}\3', message)
    return message.replace("--env ", "eval.env ").replace("--camera-map", "eval.camera_map")


def _configured_policy(cfg: TrainConfig, namespace):
    """What check_policy_env reads of a served policy, from the config and its first dataset's metadata: cameras,
    state and action widths, image resolution; no weights are built. None where the metadata is not on this disk
    (the bundled demo, a dataset in object storage): the env alone is checked then."""
    import torch

    from opentau_cli.data.meta import camera_slots, read_meta

    member = cfg.dataset.members()[0]
    try:
        meta = read_meta(member.root)
    except Exception:  # noqa: BLE001 - not readable here: the launch's own data checks say why
        return None
    cameras = camera_slots(meta, member.camera_keys, cfg.dataset.num_cameras)
    action = meta.width(member.action_key)
    policy = namespace(cfg=cfg.policy, action_mean=torch.zeros(action))
    return namespace(cameras=cameras, state_width=meta.width(member.state_key), action_width=action, policy=policy)


def evaluate_checkpoint(run_dir: Path, ckpt: Path) -> dict:
    """Evaluate `ckpt` by its own eval settings, log the result at its step and record it (see the module doc)."""
    from opentau_cli.sim.rollout import load_policy, run_episodes, summary

    run_dir, ckpt = Path(run_dir), Path(ckpt)
    cfg = TrainConfig.model_validate(json.loads((ckpt / TRAIN_CONFIG).read_text()))
    step = step_of(ckpt.name)
    served = load_policy(ckpt, device=cfg.eval.device)
    seeds = list(range(cfg.eval.seed, cfg.eval.seed + cfg.eval.rollouts))
    episodes = run_episodes(served, cfg.eval.env, seeds, envs=cfg.eval.envs, max_steps=cfg.eval.max_steps,
                            camera_map=cfg.eval.camera_map, echo=lambda m: print(m, file=sys.stderr))
    record = {"status": evals.DONE, "step": step, "checkpoint": ckpt.name, "env": cfg.eval.env,
              "seed": cfg.eval.seed, "rollouts": cfg.eval.rollouts, "max_steps": cfg.eval.max_steps,
              "weights": served.origin.get("weights"), **summary(episodes, served.action_width),
              "episodes": [e.record() for e in episodes]}
    log_result(run_dir, cfg, record)
    evals.write_record(run_dir, ckpt.name, record)
    if cfg.checkpoint.keep_best and cfg.checkpoint.best_metric == EVAL_SUCCESS:
        _point_best(run_dir, cfg)
    return record


def log_result(run_dir: Path, cfg: TrainConfig, record: dict) -> None:
    """The result at the checkpoint's step: one metrics.jsonl row (once, even when a killed evaluation is redone),
    TensorBoard (an event file of its own beside the ranks'), MLflow's run by its id."""
    row = {"step": record["step"], "kind": "eval", **{key: record[field] for field, key in evals.LOGGED.items()}}
    metrics = run_dir / METRICS
    logged = metrics.is_file() and any(_is_row(line, row["step"]) for line in metrics.read_text().splitlines())
    if not logged:
        with open(metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
    if cfg.logging.uses_tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(run_dir / TENSORBOARD / TB_RUN), filename_suffix=".eval")
        for key, value in row.items():
            if key not in ("step", "kind"):
                writer.add_scalar(key, value, row["step"])
        writer.close()
    _log_mlflow(run_dir, cfg, row)


def _is_row(line: str, step: int) -> bool:
    try:
        data = json.loads(line)
    except ValueError:
        return False
    return data.get("step") == step and evals.SUCCESS_KEY in data


def _log_mlflow(run_dir: Path, cfg: TrainConfig, row: dict) -> None:
    """MLflow takes metrics for a run by its id from any process (trackers.json records it)."""
    if "mlflow" not in cfg.logging.trackers:
        return
    from opentau_cli.train.trackers import LOGGED

    try:
        run_id = json.loads((run_dir / LOGGED).read_text())["mlflow"]["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    for key, value in row.items():
        # once per step, as the metrics.jsonl row: a redone evaluation (killed before its record) finds its points
        if key not in ("step", "kind") and all(m.step != row["step"] for m in client.get_metric_history(run_id, key)):
            client.log_metric(run_id, key, value, step=row["step"])


def _point_best(run_dir: Path, cfg: TrainConfig) -> None:
    from opentau_cli.store.lineage import current_branch
    from opentau_cli.store.manifest import is_complete
    from opentau_cli.train.manager import BestCheckpoints

    best = BestCheckpoints(cfg.checkpoint.keep_best, EVAL_SUCCESS, cfg.checkpoint.best_mode)
    chosen = best.choose([p for p in current_branch(run_dir) if is_complete(p)])
    if chosen:
        point_last(run_dir / CHECKPOINTS, chosen[0].name, BEST)


def main(argv: list[str]) -> int:
    run_dir, ckpt = Path(argv[0]), Path(argv[1])
    cpus = TrainConfig.model_validate(json.loads((ckpt / TRAIN_CONFIG).read_text())).eval.cpus
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.nice(NICE)
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    try:
        record = evaluate_checkpoint(run_dir, ckpt)
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(f"Checkpoint {ckpt.name}: success rate {record['success_rate']:.1%} in {record['env']}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
