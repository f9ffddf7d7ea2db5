"""The per-rank training process that `accelerate launch` starts: `python -m opentau_cli.train.worker --config ... --launch ...`.

It runs under opentau's per-rank runtime (`opentau_cli.process.runtime`): everything it prints goes to `<log_dir>/rank<N>.log`,
rank 0 also shows progress on the launcher's console. Exit codes: 0 done or preempted-and-saved; 2 a problem with the
user's input found late (e.g. in the data); 1 a failure.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

class Preemption:
    """SIGTERM / SIGUSR1 set a flag; the loop finishes its step, all ranks agree, save, and exit 0. A notice that came
    earlier counts too: one this rank received while it started up, or one its launcher received before this rank
    existed (process/runtime.py preemption_received: a group being restarted, or still starting)."""

    def __init__(self, enabled: bool, launch_log_dir: Path):
        from opentau_cli.process.runtime import PREEMPT_SIGNALS, preemption_received

        self.launch_log_dir = Path(launch_log_dir)
        self.signal = preemption_received(self.launch_log_dir)
        for s in PREEMPT_SIGNALS:
            signal.signal(s, self._handle if enabled else signal.SIG_DFL)
        if not enabled and self.signal:  # checkpoint.save_on_preemption=false: the signal ends the rank, as it would have
            os.kill(os.getpid(), signal.Signals[self.signal])

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def by_launcher(self) -> bool:
        """The notice came through opentau's launcher (a preemption), not from torch's agent re-forming the group."""
        from opentau_cli.process.runtime import PREEMPTED_FILE

        return (self.launch_log_dir / PREEMPTED_FILE).exists()

    def _handle(self, signum, _frame):
        self.signal = signal.Signals(signum).name
        print(f"Received {self.signal}: finishing the current step, then saving.", flush=True)

    def before_training(self, accelerator, run_dir: Path, resume_from: Path | None, restarted: bool) -> str | None:
        """Every rank agrees (a collective) whether a notice came before the first step; if so, the line that says the
        run stopped before training began, with nothing since its checkpoint to save."""
        from opentau_cli.process.runtime import attempt, max_restarts
        from opentau_cli.train.trainer import any_rank

        if not any_rank(accelerator, self.requested or self.by_launcher()):
            return None
        name = self.signal or "a preemption notice"
        if max_restarts() and not self.by_launcher():  # torch's agent stops the group to re-form it (machines joined)
            return f"Stopped by {name} before training began; the group continues if it re-forms."
        if resume_from is None:
            return f"Stopped by {name} before training began: nothing to save; run the same command again to start."
        began = f" during restart {attempt()}, before training resumed" if restarted else " before training began"
        return (f"Stopped by {name}{began}: nothing was trained since checkpoint {resume_from.name}; continue with "
                f"`opentau resume {run_dir}`.")


def agree_run_id(accelerator, launch: dict, machine_rank: int) -> tuple[str, int, list[int]]:
    """The run's identity on every machine, and its leader: the run id of machine 0's launcher (which holds the run
    lock, hosts the rendezvous and shows progress; each machine's launcher started on its own clock), and the global
    rank of machine 0's first rank. With restarts the c10d rendezvous numbers machines in the order it sorts them, so
    global rank 0 may be on another machine (docs/ARCHITECTURE.md, "Restarts"). The run id names the save's temp dirs
    and the run's log dir, into which this rank's log moves; the machine of each global rank is noted with the group."""
    import os

    import torch.distributed as dist

    from opentau_cli.process.runtime import join_run_logs

    me = (machine_rank, int(os.environ.get("LOCAL_RANK", "0") or 0), launch["run_id"])
    everyone = [me]
    if accelerator.num_processes > 1:
        everyone = [None] * accelerator.num_processes
        dist.all_gather_object(everyone, me)
    leader = min(range(len(everyone)), key=lambda rank: everyone[rank][:2])
    run_id = everyone[leader][2]
    log_dir = Path(launch["log_dir"])
    join_run_logs(log_dir, log_dir.parent / run_id, accelerator.process_index)
    return run_id, leader, [machine for machine, _, _ in everyone]


def fit(cfg, setup, launch: dict, console) -> int:
    """Build, maybe resume, and run the loop: step, log, validate, save."""
    from opentau_cli.data.remote import DataUnavailable
    from opentau_cli.process import runlock
    from opentau_cli.process import restarts
    from opentau_cli.process.runtime import attempt, keep_until_exit, max_restarts
    from opentau_cli.process.uploader import StatusView
    from opentau_cli.store.layout import METRICS, TB_RUN, TENSORBOARD
    from opentau_cli.train.manager import BestCheckpoints, CheckpointManager, machine_local_disks
    from opentau_cli.train.metrics import MetricsLogger, Progress, truncate_metrics
    from opentau_cli.train.trackers import Trackers
    from opentau_cli.train.trainer import build_trainer

    run_dir = Path(cfg.output_dir)
    resume_from = Path(launch["resume_from"]) if launch.get("resume_from") else None
    cfg, setup = restarts.fit_to_world(cfg, setup)  # elastic machines: the group may have re-formed smaller or larger
    preemption = Preemption(cfg.checkpoint.save_on_preemption, Path(launch["log_dir"]))
    tb_dir = run_dir / TENSORBOARD if cfg.logging.uses_tensorboard else None
    trainer = build_trainer(cfg, setup, tensorboard_dir=tb_dir, console=console)
    keep_until_exit(trainer)  # freed only by os._exit (runtime.keep_until_exit says why)
    acc = trainer.accelerator
    run_id, leader, placement = agree_run_id(acc, launch, setup.machine_rank)
    run_log_dir = Path(launch["log_dir"]).parent / run_id
    runlock.register_rank(run_dir)  # the run stays locked while this rank lives, whatever happens to its launcher
    # Machines without an output_dir they share each keep their part; checkpoint.remote holds the whole checkpoints.
    planned = int(launch["accelerate"].get("num_machines") or 1)  # the launch's machines, not this group's
    local_parts = machine_local_disks(acc, run_dir, run_id, setup.machine_rank, cfg.checkpoint.remote, planned)
    failure = None
    if max_restarts():
        failure, resume_from = restart_point(acc, leader, cfg, setup, launch, run_log_dir, resume_from, local_parts,
                                             placement)
    leads = acc.process_index == leader
    ckpt = CheckpointManager(acc, run_dir, total_steps=cfg.steps, run_id=run_id,
                             keep_last=cfg.checkpoint.keep_last, protect=resume_from, parent=resume_from,
                             save_kwargs=trainer.save_state_kwargs, load_kwargs=trainer.load_state_kwargs,
                             async_save=cfg.checkpoint.async_save and not local_parts, machine_local=local_parts,
                             extra_files=trainer.checkpoint_files,
                             # best_metric: resolved by the config rules (config/rules.py) whenever keep_best is on
                             best=BestCheckpoints(cfg.checkpoint.keep_best, cfg.checkpoint.best_metric, cfg.checkpoint.best_mode)
                             if cfg.checkpoint.keep_best else None,
                             report=lambda text: progress.message(text))  # progress exists before the first save
    resume_state = None
    if resume_from is not None:
        resume_state = trainer.restore(ckpt, resume_from)
    continued = resume_from is not None or failure is not None
    if continued and acc.is_main_process:
        truncate_metrics(run_dir / METRICS, trainer.step)
    if tb_dir is not None:
        # One TensorBoard run per run directory; a resume purges what a dead or rolled-back launch logged past its step.
        acc.init_trackers(TB_RUN, init_kwargs={"tensorboard": {"purge_step": trainer.step + 1}} if continued else {})
    # W&B, MLflow, ...: continue (or fork) the tracked runs the checkpoint records (train/trackers.py).
    trackers = Trackers.open(acc, cfg, run_dir, resume_state=resume_state, step=trainer.step)
    metrics = MetricsLogger(acc, run_dir / METRICS, tensorboard=tb_dir is not None, trackers=trackers)
    progress = Progress(cfg.steps, trainer.step, console, cfg.logging.progress_bar, restarts=attempt(),
                        uploads=StatusView(run_dir) if cfg.checkpoint.remote and leads else None)
    if failure is not None:
        if leads:
            progress.message(restarts.restart_line(restarts.record_restart(run_dir, run_id, failure, resume_from, trainer.step,
                                                                          setup.world_size)))
    elif resume_from is not None:
        progress.message(f"Resumed from {resume_from} at step {trainer.step}.")
    for note in trackers.notes:
        progress.message(note)
    config = cfg.to_json_dict()
    config["resume"] = False  # a saved config starts nothing by itself; --resume=true or `opentau resume` resumes it
    marks = restarts.StepMarks(run_log_dir, acc.process_index) if max_restarts() else None
    watchdog = restarts.Watchdog(cfg.distributed.timeout_minutes * 60, acc.process_index)
    try:
        stopped = preemption.before_training(acc, run_dir, resume_from, failure is not None)
        if stopped:
            progress.message(stopped)
            return 0
        while trainer.step < cfg.steps:
            if marks is not None:
                marks.running(trainer.step + 1)
            result = trainer.train_step(stop_requested=preemption.requested)
            watchdog.beat(trainer.step)
            ckpt.poll()  # async_save: publishes the save in flight once written; raises if it failed
            step = trainer.step
            if result.record is not None:
                metrics.log(result.record)
                print(json.dumps(result.record), flush=True)
            progress.update(step, result.record)
            validation = None
            if cfg.validation.val_freq and step % cfg.validation.val_freq == 0:
                validation = trainer.validate()
                if validation is not None:
                    metrics.log(validation)
                    shown = [f"{k} {validation[k]:.4f}" for k in ("val_loss", "ema_val_loss") if k in validation]
                    progress.message(f"step {step}: {', '.join(shown)}")
            if step % cfg.save_freq == 0 or step == cfg.steps or result.stop:
                # The step's validation goes with the checkpoint: keep_best ranks checkpoints by it.
                started = time.perf_counter()
                saved = ckpt.save(step, config=config, state={**trainer.state_dict(), "validation": validation,
                                                              "trackers": trackers.state()})
                trackers.checkpoint(step, time.perf_counter() - started, saved)
            watchdog.beat()
            if result.stop:
                ckpt.wait()
                if max_restarts() and not preemption.by_launcher():  # the agent's, re-forming the group (machines joined)
                    progress.message(f"Stopped by a signal: saved step {step}; the group continues from it if it "
                                     f"re-forms, else continue with `opentau resume {run_dir}`.")
                else:
                    progress.message(f"Preempted: saved step {step}; continue with `opentau resume {run_dir}`.")
                break
        watchdog.stop()
        ckpt.wait()  # async_save: the last save is published before the run ends
    except DataUnavailable as e:  # every rank together (Trainer.agreed_next), at the last step trained
        stop_for_data(e, trainer.step, ckpt, lambda: {**trainer.state_dict(), "validation": None,
                                                       "trackers": trackers.state()}, config, run_dir)
    finally:
        progress.close()
        metrics.close()
        if tb_dir is not None:
            acc.end_training()
        trainer.data.stream.close()
    return 0


def stop_for_data(e, step: int, ckpt, state, config: dict, run_dir: Path):
    """A dataset in object storage could not be read for dataset.remote_wait_seconds (or changed under the run): what
    was trained is saved (`state()`, unless that step is saved already) and the launch stops with one sentence (exit
    1), its data position at the first batch not trained on (docs/ARCHITECTURE.md, "Datasets in object storage")."""
    from opentau_cli.data.remote import DataChanged
    from opentau_cli.errors import RunError
    from opentau_cli.store.layout import step_of

    if step and (ckpt.parent is None or step_of(ckpt.parent.name) != step):
        ckpt.save(step, config=config, state=state())
    ckpt.wait()
    flag = " --dataset-changed=true" if isinstance(e, DataChanged) else ""
    then = "to train on the files as they are now" if flag else "once the store answers"
    if not step:
        raise RunError(f"{e}: no step was trained; run the same command again {then}.") from None
    raise RunError(f"{e}: step {step} is saved; continue with `opentau resume {run_dir}{flag}` {then}.") from None


def restart_point(acc, leader: int, cfg, setup, launch: dict, run_log_dir: Path, resume_from: Path | None,
                  machine_local: bool = False, placement: list[int] | None = None):
    """Where a group of a restartable launch starts (docs/ARCHITECTURE.md, "Restarts"): the launch's own source for
    its first group; for a later one (a failure restarted it, or machines left or joined) why the previous group
    ended and the checkpoint to continue from (the run's `last`, else the launch's own source). A failure no restart
    can cure, or a `last` that fails verification, ends the launch here. The leader (machine 0's first rank) decides
    for all and notes each group in `<run log dir>/groups.jsonl`."""
    from accelerate.utils import broadcast_object_list

    from opentau_cli.process import restarts
    from opentau_cli.store.manifest import verify_manifest
    from opentau_cli.store.runs import clean_leftovers, latest

    run_dir = Path(cfg.output_dir)
    decision = [None, str(resume_from) if resume_from else None, None]
    if acc.process_index == leader:
        change = restarts.group_change(run_log_dir, setup.world_size)
        if change is not None:
            if change["machines_changed"]:
                failure = restarts.machines_changed(change, setup.world_size)
            else:
                failure = restarts.previous_failure(launch, run_log_dir, setup.machine_rank,
                                                    setup.num_processes // setup.num_machines, change.get("placement"))
                failure.world_before = change["world_before"]
            clean_leftovers(run_dir)  # the previous group's unfinished saves
            source = latest(run_dir) or resume_from
            reason = None if change["machines_changed"] else restarts.incurable(failure, run_dir, run_log_dir, source)
            if reason is None and source is not None and not machine_local:  # parts: checked as they are fetched
                problems = verify_manifest(source)
                if problems:
                    reason = f"checkpoint {source} fails verification ({problems[0]}); restore it or roll back with `opentau resume --rollback`"
            decision = [failure, str(source) if source else None, reason]
        restarts.note_group(run_log_dir, setup.world_size, placement)
    failure, source, reason = broadcast_object_list(decision, from_process=leader)
    if reason:
        restarts.stop_launch(run_log_dir, reason)
    if machine_local and failure is not None:
        source = parts_from_store(acc, cfg, setup, run_dir, source, leader)
    return failure, Path(source) if source else None


def parts_from_store(acc, cfg, setup, run_dir: Path, leader_source: str | None, leader: int) -> str | None:
    """Where a re-formed group of machines that keep their own run directories continues (docs/ARCHITECTURE.md,
    "Remote checkpoints"): the newest checkpoint committed in checkpoint.remote (after waiting up to
    remote_drain_seconds for the one the previous group published last), each machine downloading into its own run
    directory the files its ranks load (every file on another world). Returns this machine's copy."""
    import torch.distributed as dist
    from accelerate.utils import broadcast_object_list

    from opentau_cli.store.layout import CHECKPOINTS, read_last, step_of
    from opentau_cli.store.remote_run import RemoteRun, files_for
    from opentau_cli.store.storage import open_storage
    from opentau_cli.store.topology import is_reshard

    remote = RemoteRun(open_storage(cfg.checkpoint.remote, cfg.checkpoint.remote_options))
    chosen = [None]
    if acc.process_index == leader:
        newest = read_last(run_dir / CHECKPOINTS)
        deadline = time.monotonic() + cfg.checkpoint.remote_drain_seconds
        while newest and step_of(remote.newest_committed() or "-1") < step_of(newest) and time.monotonic() < deadline:
            time.sleep(1)  # the launcher's uploader commits the previous group's last save once every part is in
        chosen = [remote.newest_committed() or (Path(leader_source).name if leader_source else None)]
    name = broadcast_object_list(chosen, from_process=leader)[0]
    if name is None:
        return None
    machines = [setup.machine_rank] * acc.num_processes
    if acc.num_processes > 1:
        dist.all_gather_object(machines, setup.machine_rank)
    mine = {rank for rank, machine in enumerate(machines) if machine == setup.machine_rank}
    problem = [None]
    if acc.local_process_index == 0:
        try:
            manifest = remote.manifest(name)
            state = json.loads(remote.storage.read_bytes(f"{CHECKPOINTS}/{name}/training_state.json"))
            remote.fetch(name, run_dir, only=files_for(manifest, None if is_reshard(state, setup) else mine),
                         history=acc.is_main_process)  # the metrics' writer
        except Exception as e:  # noqa: BLE001 - every rank stops with the same sentence
            problem = [f"downloading checkpoint {name} from {remote.url} failed ({type(e).__name__}: {e})"]
    problems = [problem[0]] * acc.num_processes
    if acc.num_processes > 1:
        dist.all_gather_object(problems, problem[0])
    failed = next((p for p in problems if p), None)
    if failed:
        from opentau_cli.errors import RunError

        raise RunError(failed)
    return str(run_dir / CHECKPOINTS / name)


def main(argv: list[str] | None = None) -> None:
    from opentau_cli.process.runtime import catch_preemption, run_rank

    catch_preemption()
    run_rank(fit, argv, description=__doc__)


if __name__ == "__main__":
    main()
