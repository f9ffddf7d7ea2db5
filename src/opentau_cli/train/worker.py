"""The per-rank training process that `accelerate launch` starts: `python -m opentau_cli.train.worker --config ... --launch ...`.

Everything this process prints goes to `<log_dir>/rank<N>.log`; rank 0 also shows progress on the launcher's console.
Exit codes: 0 done or preempted-and-saved; 2 a problem with the user's input found late (e.g. in the data); 1 a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from pathlib import Path

USER_ERROR_MARK = "opentau-user-error: "


def redirect_output(log_dir: Path, rank: int):
    """Send this rank's stdout/stderr (Python and C level) to its log file; return a handle on the console for rank 0."""
    console = os.fdopen(os.dup(1), "w", buffering=1) if rank == 0 else None
    log = open(log_dir / f"rank{rank}.log", "a", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    return console


def report_failure(e: BaseException) -> int:
    """Print a worker failure the way the launcher reads it (call inside `except`); returns the exit code."""
    from opentau_cli.errors import RunError, UserError

    if isinstance(e, UserError):
        print(f"{USER_ERROR_MARK}{e}", flush=True)
        return 2
    if isinstance(e, RunError):
        print(f"Error: {e}", flush=True)
        return 1
    traceback.print_exc()
    sys.stderr.flush()
    return 1


def close_process_group() -> None:
    """Tear down torch.distributed before exit: a process that exits with gloo's threads still running can abort
    ("terminate called without an active exception") after its work is done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Preemption:
    """SIGTERM / SIGUSR1 set a flag; the loop finishes its step, all ranks agree, save, and exit 0."""

    def __init__(self, enabled: bool):
        self.requested = False
        if enabled:
            for s in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(s, self._handle)

    def _handle(self, signum, _frame):
        self.requested = True
        print(f"Received {signal.Signals(signum).name}: finishing the current step, then saving.", flush=True)


def fit(cfg, setup, launch: dict, console) -> int:
    """Build, maybe resume, and run the loop: step, log, validate, save."""
    from opentau_cli.checkpoint.layout import METRICS, TENSORBOARD
    from opentau_cli.checkpoint.manager import CheckpointManager
    from opentau_cli.train.metrics import MetricsLogger, Progress, truncate_metrics
    from opentau_cli.train.trainer import any_rank, build_trainer

    run_dir = Path(cfg.output_dir)
    resume_from = Path(launch["resume_from"]) if launch.get("resume_from") else None
    preemption = Preemption(cfg.checkpoint.save_on_preemption)
    tb_dir = run_dir / TENSORBOARD if cfg.logging.tensorboard else None
    trainer = build_trainer(cfg, setup, tensorboard_dir=tb_dir)
    acc = trainer.accelerator
    if tb_dir is not None:
        acc.init_trackers(launch["run_id"])
    ckpt = CheckpointManager(acc, run_dir, total_steps=cfg.steps, run_id=launch["run_id"],
                             keep_last=cfg.checkpoint.keep_last, protect=resume_from)
    if resume_from is not None:
        trainer.load_state_dict(ckpt.load(resume_from))
        if acc.is_main_process:
            truncate_metrics(run_dir / METRICS, trainer.step)
    metrics = MetricsLogger(acc, run_dir / METRICS, tensorboard=tb_dir is not None)
    progress = Progress(cfg.steps, trainer.step, console, cfg.logging.progress_bar)
    if resume_from is not None:
        progress.message(f"Resumed from {resume_from} at step {trainer.step}.")
    config = cfg.to_json_dict()
    config["resume"] = False  # a saved config starts nothing by itself; --resume=true or `opentau resume` resumes it
    try:
        while trainer.step < cfg.steps:
            trainer.train_step()
            step = trainer.step
            if step % cfg.log_freq == 0 or step == cfg.steps:
                record = trainer.collect_metrics()
                metrics.log(record)
                progress.update(step, record)
                print(json.dumps(record), flush=True)
            else:
                progress.update(step, None)
            if cfg.validation.val_freq and step % cfg.validation.val_freq == 0:
                record = trainer.validate()
                if record is not None:
                    metrics.log(record)
                    progress.message(f"step {step}: val_loss {record.get('val_loss', float('nan')):.4f}")
            stop = any_rank(acc, preemption.requested)
            if step % cfg.save_freq == 0 or step == cfg.steps or stop:
                path = ckpt.save(step, config=config, state=trainer.state_dict())
                progress.message(f"Saved checkpoint {path}")
            if stop:
                progress.message(f"Preempted: saved step {step}; continue with `opentau resume {run_dir}`.")
                break
    finally:
        progress.close()
        metrics.close()
        if tb_dir is not None:
            acc.end_training()
        trainer.data.stream.close()
        close_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="The resolved train_config.json written by the launcher.")
    parser.add_argument("--launch", required=True, help="launch.json: accelerate setup, resume checkpoint, log dir, run id.")
    args = parser.parse_args(argv)
    launch = json.loads(Path(args.launch).read_text())
    rank = int(os.environ.get("RANK", "0"))
    console = redirect_output(Path(launch["log_dir"]), rank)

    from opentau_cli.config import TrainConfig
    from opentau_cli.config import setup_from_dict

    try:
        cfg = TrainConfig.model_validate(json.loads(Path(args.config).read_text()))
        return fit(cfg, setup_from_dict(launch["accelerate"]), launch, console)
    except KeyboardInterrupt:
        return 130
    except BaseException as e:
        return report_failure(e)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip native teardown: with the work done and logs flushed, gloo/DeepSpeed threads torn down at interpreter
    # exit sometimes abort a rank ("terminate called without an active exception"), failing a finished run.
    os._exit(code)
