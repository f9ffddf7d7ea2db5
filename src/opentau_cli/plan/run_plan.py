"""Decide a launch before any process starts: the config, its Accelerate setup, every rule, and for a resume the
checkpoint it continues.

`config validate`, `train`, `resume` and `profile` all come through `check_launch`, so they refuse exactly the
same things (docs/ARCHITECTURE.md, "Rules"). This is the layer above `config`: it hands the config rules the data
and policy checks, and adds the checkpoint's resume checks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from opentau_cli.config import (
    AccelerateSetup, Machine, TrainConfig, Validated, load_config, parse_overrides, resolve_accelerate_config, setup_from_dict,
    validate, with_machine,
)
from opentau_cli.config.paths import missing_paths
from opentau_cli.data.check import check_dataset
from opentau_cli.data.fingerprint import CHANGED_FLAG, FINGERPRINTS, check_unchanged
from opentau_cli.data.hub import asked_revisions, pin_for_resume, told_revision
from opentau_cli.data.remote import unpin
from opentau_cli.errors import UserError
from opentau_cli.plan.memory import parameter_counts
from opentau_cli.plan.remote import check_remote, check_remote_history, check_writer, local_copy, remote_last
from opentau_cli.plan.resume import RESHARD_FLAG, ROLLBACK_FLAG, check_in_run, check_resumable, check_same_run
from opentau_cli.process import runlock
from opentau_cli.process.launch import RunPlan
from opentau_cli.store.layout import CHECKPOINTS, LAST, LAUNCH_FILE, LOGS, TRAIN_CONFIG, holds_run, run_part
from opentau_cli.store.lineage import archive_of
from opentau_cli.store.runs import find_checkpoint, is_checkpoint_dir, read_training_state, run_dir_of
from opentau_cli.store.topology import describe_change, fit_global_batch, is_reshard, topology, topology_entry
from opentau_cli.train.trackers import check_trackers


def check_policy(cfg: TrainConfig) -> list[str]:
    """What the policy refuses to be built from (an image size its vision tower cannot patch, more action bins than
    its vocabulary), found by building it on the meta device (no memory, well under a second), and whether its
    weight and tokenizer sources exist (a path, or a Hugging Face repo id in the cache or on the Hub) and the weights
    fit it (read from their headers only). A resume loads the checkpoint's weights, not pretrained_path."""
    # transformers and huggingface_hub (importing opentau_cli.policies imports both): only once the config itself
    # loaded, and only where needed; a policy counted before is not built again (plan/memory.py parameter_counts).
    sources = {f"policy.{name}": getattr(cfg.policy, name) for name in ("pretrained_path", "tokenizer_path")}
    sources = {name: source for name, source in sources.items() if source is not None}
    if sources:
        from opentau_cli.policies.hub import check_sources

        errors = check_sources(sources)
        if errors:  # building the policy loads the same tokenizer and would say the same again
            return errors
    errors = []
    try:
        parameter_counts(cfg.policy)
        if cfg.policy.pretrained_path is not None and not cfg.resume:
            from opentau_cli.policies import check_pretrained

            check_pretrained(cfg.policy)
    except UserError as e:
        errors.append(str(e))
    return errors


def check_lora_resume(ckpt: Path, cfg: TrainConfig, state: dict, saved: dict) -> None:
    """The same LoRA setting as the checkpoint (`saved`: its train_config.json), and for a LoRA checkpoint the same
    base weights (their hashes)."""
    from opentau_cli.config.model import LoraConfig

    if LoraConfig(**saved.get("policy", {}).get("lora", {})) == cfg.policy.lora and not cfg.policy.lora.enabled:
        return  # full fine-tuning then and now: nothing to check, and no transformers to import for it (Start-up)
    from opentau_cli.policies.lora import check_resume

    check_resume(ckpt, saved.get("policy", {}), state, cfg)


def check_mixture_resume(ckpt: Path, cfg: TrainConfig, saved: dict, overrides: dict | None = None) -> None:
    """The checkpoint's dataset.mixture (`saved`: its train_config.json, paths resolved as load_config resolves
    them): another one would not continue its data order, nor fit its statistics. A member's root given on the
    command line (`--dataset.mixture.N.root`) says where the same data is now (a moved run) and is not a change."""
    import copy

    from opentau_cli.config.paths import is_path_key, paths_base, resolve_paths

    before = saved.get("dataset", {}).get("mixture")
    now = cfg.dataset.model_dump(mode="json")["mixture"]
    if before is None and now is None:
        return
    from opentau_cli.data.mixture import mixture_changes  # imports torch: only for a mixture

    if before is not None:  # only the members' paths are compared: resolve those, not a copy of the whole config
        members = {"dataset": {"mixture": copy.deepcopy(before)}}
        before = resolve_paths(members, paths_base(ckpt / TRAIN_CONFIG))["dataset"]["mixture"]
    from opentau_cli.config.model import MixtureMember

    defaults = MixtureMember().model_dump(mode="json")
    for member in before or []:  # a setting added since the checkpoint was written: it ran with the default
        for name, value in defaults.items():
            member.setdefault(name, value)
    for key in overrides or {}:
        if before and now and key.startswith("dataset.mixture.") and is_path_key(key):  # dataset.mixture.N.root
            i = int(key.split(".")[2])
            if i < min(len(before), len(now)):
                before[i]["root"] = now[i]["root"]
    changes = mixture_changes(before, now)
    if changes:
        raise UserError(f"Checkpoint '{ckpt}' trained on another mixture ({'; '.join(changes)}): resume with the "
                        "checkpoint's dataset.mixture, or start a new run with --policy.pretrained_path.")


def check_output_dir(cfg: TrainConfig) -> list[str]:
    """output_dir can be a directory (it, or the first of its parents that exists, is one) that this user may write, and a fresh run never
    writes into another run's directory by accident (a failed start's leftovers do not count)."""
    out = Path(cfg.output_dir)
    for path in (out, *out.parents):
        if path.is_dir():
            break
        if path.exists() or path.is_symlink():  # a file, or a link to nothing: mkdir would fail after the checks
            what = "is a file" if path.is_file() else "is not a directory"
            if path == out:
                return [f"output_dir '{out}' {what}: pick another --output_dir."]
            return [f"output_dir '{out}' cannot be created: '{path}' {what}; pick another --output_dir."]
    if not os.access(path, os.W_OK | os.X_OK):  # checked here, not found by the launch's first write
        why = "lies on a read-only filesystem" if os.statvfs(path).f_flag & os.ST_RDONLY else "is not writable by this user"
        where = f"'{out}'" if path == out else f"its parent '{path}'"
        return [f"output_dir '{out}' cannot be written: {where} {why}; pick another --output_dir (or make it writable)."]
    archive = archive_of(out)
    if archive is not None:  # --overwrite would empty the archive, a resume would train in it
        return [f"output_dir '{out}' lies in the rollback archive of {archive} (rolled_back/), which nothing writes: "
                "pick another --output_dir."]
    inside = next((p for p in Path(os.path.abspath(out)).parents if run_part(p) in ("the checkpoint", "the checkpoints folder")), None)
    if inside is not None:
        return [f"output_dir '{out}' lies inside {run_part(inside)} {inside}: pick a directory outside it."]
    if cfg.resume or cfg.overwrite or not holds_run(cfg.output_dir):
        return []
    return [f"output_dir '{cfg.output_dir}' already exists; resume it with `opentau resume {cfg.output_dir}`, "
            "pick another --output_dir, or pass --overwrite=true."]


# The checks of other packages that the config rules run with their own.
LAUNCH_CHECKS = (check_dataset, check_policy, check_output_dir, check_trackers, check_remote)


def check_launch(cfg: TrainConfig, setup: AccelerateSetup, machine: Machine, resume_from: Path | None = None) -> Validated:
    """Every rule a launch must pass on `machine` (resume checks aside): raises one UserError naming every problem.
    `resume_from`: the checkpoint a resume continues (its size is what a save of this run writes)."""
    from opentau_cli.plan.memory import check_memory
    from opentau_cli.plan.save_time import check_save_grace

    checked = validate(cfg, setup, machine, LAUNCH_CHECKS)
    check_machines(checked.config, setup)
    check_memory(checked.config, setup, machine)  # a run that will not fit the card is refused before launch
    # A save that the stop signal's grace may cut short: a warning, the rates being estimates.
    checked.warnings.extend(check_save_grace(checked.config, setup, resume_from))
    return checked


def check_machines(cfg: TrainConfig, setup: AccelerateSetup) -> None:
    """Elastic machines (distributed.machines MIN:MAX) are refused unless every world they allow can continue the run
    (docs/ARCHITECTURE.md, "Restarts"); restarts over a fixed number of machines count as MIN = MAX."""
    span = cfg.distributed.machine_range
    if span is None:
        return
    text = cfg.distributed.machines
    low, high = span
    where = f"distributed.machines {text}"
    if high != setup.num_machines:
        raise UserError(f"{where} needs --num_machines {high} (the most machines; the YAML's num_processes is for them "
                        f"all), got {setup.num_machines}.")
    # Machine 0's address (the rendezvous endpoint) is the multi-machine rule's (config/rules.py).
    if not cfg.distributed.max_restarts:
        raise UserError(f"{where} needs distributed.max_restarts of 1 or more: a machine that leaves ends the group, "
                        "which re-forms through a restart.")
    per_machine = setup.num_processes // setup.num_machines
    if setup.backend == "fsdp" and low * per_machine < 2:
        raise UserError(f"{where} lets the run go on with {low * per_machine} process, which FSDP2 cannot shard over: "
                        f"raise MIN so that at least 2 processes remain.")
    for machines in range(low, high + 1):
        world = machines * per_machine
        global_batch = cfg.batch_size * setup.world_size
        if global_batch % world:
            raise UserError(f"{where} lets the run go on with {machines} machine{'s' * (machines != 1)} ({world} "
                            f"processes), over which the global batch of {global_batch} does not divide: pick a MIN:MAX "
                            "whose every process count divides it, or change batch_size.")
        fit_global_batch(cfg.model_dump(), setup.world_size, world, {})


def plan_train(config_path: Path | None, accelerate_config: Path | None, args: list[str], machine: Machine | None = None,
               machines: dict | None = None, reshard: bool = False, rollback: bool = False,
               break_lock: bool = False, dataset_changed: bool = False,
               echo: Callable[[str], None] | None = None) -> RunPlan:
    """`opentau train`: a fresh run, or with --resume=true the checkpoint the config came from (else output_dir's
    newest), or with --resume=auto whichever of the two output_dir (or checkpoint.remote) calls for (`_plan_auto`).

    `machine` is the one the rules check for; by default this one. `machines`: the command line's machine settings
    (`config.with_machine`: they and the cluster's environment override the YAML). `reshard`: a resume may change
    the number of processes, the backend or the ZeRO stage (train/reshard.py). `rollback`: a resume from a
    checkpoint older than the run's newest moves the newer ones aside instead of being refused (lineage.py).
    `break_lock`: the launch will take over a lost node's run lock (process/runlock.py), so that lock refuses nothing here.
    `dataset_changed`: a resume may read a local dataset whose files changed since the checkpoint (data/fingerprint.py).
    `echo`: where a download of checkpoint.remote's last checkpoint (--resume=auto) says what it does."""
    machine = machine or Machine.this()
    overrides = parse_overrides(args)
    auto = str(overrides.get("resume", "")).strip().lower() == AUTO
    if auto:  # --resume=auto: decided below from what output_dir (or checkpoint.remote) holds
        overrides = {k: v for k, v in overrides.items() if k != "resume"}
    cfg = load_config(config_path, overrides)
    if auto:
        return _plan_auto(cfg, accelerate_config, overrides, machine, machines, reshard, rollback, break_lock,
                          dataset_changed, echo or (lambda line: None))
    for flag, given in ((RESHARD_FLAG, reshard), (ROLLBACK_FLAG, rollback), (CHANGED_FLAG, dataset_changed)):
        if given and not cfg.resume:
            raise UserError(f"{flag} applies to a resume: pass it with --resume=true, or use `opentau resume RUN {flag}`.")
    if not cfg.resume:
        setup = with_machine(resolve_accelerate_config(accelerate_config), machines)
        check_not_live(cfg.output_dir, setup, break_lock, cfg.checkpoint.remote, cfg.checkpoint.remote_options)
        branches = asked_revisions(cfg)  # before check_launch pins the commits
        return RunPlan(checked=check_launch(cfg, setup, machine), dataset_branches=branches)
    source = Path(cfg.config_path).parent if cfg.config_path else None
    if source is not None and is_checkpoint_dir(source):
        ckpt = find_checkpoint(source)
    else:
        ckpt = find_checkpoint(cfg.output_dir)
    return _plan_resume(cfg, ckpt, accelerate_config, overrides, machine, machines, reshard, rollback, break_lock,
                        dataset_changed)


AUTO = "auto"  # --resume=auto


def _plan_auto(cfg: TrainConfig, accelerate_config: Path | None, overrides: dict, machine: Machine,
               machines: dict | None, reshard: bool, rollback: bool, break_lock: bool, dataset_changed: bool,
               echo: Callable[[str], None]) -> RunPlan:
    """`opentau train ... --resume=auto`, the one command a scheduler's requeue runs again (docs/ARCHITECTURE.md,
    "Schedulers"): a fresh run when output_dir and checkpoint.remote hold no checkpoint; else the checkpoint `last`
    designates (the remote's, downloaded as `opentau resume URL` does, when it is there), continued exactly as
    `opentau resume` would (`_plan_resume`); refused when that checkpoint belongs to another run."""
    setup = with_machine(resolve_accelerate_config(accelerate_config), machines)
    # A requeued job may start while the job it replaces still saves.
    wait_until_free(cfg.output_dir, setup, break_lock, cfg.distributed.lock_wait_seconds, echo,
                    cfg.checkpoint.remote, cfg.checkpoint.remote_options)
    ckpt = _auto_checkpoint(cfg, echo)  # every machine, as `opentau resume` runs on every machine
    if ckpt is None:
        branches = asked_revisions(cfg)
        return RunPlan(checked=check_launch(cfg, setup, machine), dataset_branches=branches,
                       notes=[f"--resume=auto: {cfg.output_dir} holds no checkpoint: starting the run."])
    cfg.resume = True
    plan = _plan_resume(cfg, ckpt, accelerate_config, {**overrides, "output_dir": str(cfg.output_dir)}, machine,
                        machines, reshard, rollback, break_lock, dataset_changed)
    plan.notes.insert(0, f"--resume=auto: continuing from {ckpt}.")
    return plan


def _local_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a resume of `run_dir` continues from (find_checkpoint: `last`, else its newest sound ancestor;
    a run whose every checkpoint is damaged is refused there), or None when the run has no checkpoint at all."""
    from opentau_cli.store.runs import checkpoint_steps

    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir() or not (checkpoint_steps(folder) or (folder / LAST).exists()):
        return None
    return find_checkpoint(Path(run_dir))


def _auto_checkpoint(cfg: TrainConfig, echo: Callable[[str], None]) -> Path | None:
    """--resume=auto's checkpoint: checkpoint.remote's `last` (its local copy, fetched unless a complete copy of it or
    of a newer one of the same run is in output_dir), else output_dir's own, else None. Another run's checkpoint is
    refused before anything is downloaded."""
    url, options = cfg.checkpoint.remote, cfg.checkpoint.remote_options
    if url:
        last = remote_last(url, options)
        if last is not None:
            _, saved = last
            check_same_run(saved, cfg, f"checkpoint.remote {url}", url)
            return local_copy(url, str(cfg.output_dir), options, echo)
    ckpt = _local_checkpoint(cfg.output_dir)
    if ckpt is not None:
        check_same_run(_read_train_config(ckpt), cfg, f"output_dir '{cfg.output_dir}'", str(cfg.output_dir))
    return ckpt


def plan_resume(target: Path, accelerate_config: Path | None, args: list[str], machine: Machine | None = None,
                machines: dict | None = None, reshard: bool = False, rollback: bool = False,
                break_lock: bool = False, dataset_changed: bool = False) -> RunPlan:
    """`opentau resume RUN_DIR|CKPT_DIR`: the checkpoint's own train_config.json plus the command line's overrides."""
    ckpt = find_checkpoint(target)
    overrides = parse_overrides(args)
    cfg = load_config(ckpt / TRAIN_CONFIG, {**overrides, "resume": "true"})
    return _plan_resume(cfg, ckpt, accelerate_config, overrides, machine or Machine.this(), machines, reshard, rollback,
                        break_lock, dataset_changed)


def _plan_resume(cfg: TrainConfig, ckpt: Path, accelerate_config: Path | None, overrides: dict, machine: Machine,
                 machines: dict | None, reshard: bool = False, rollback: bool = False,
                 break_lock: bool = False, dataset_changed: bool = False) -> RunPlan:
    import json

    notes = []
    check_in_run(ckpt)  # an archive is refused before its recorded paths are checked
    if "output_dir" not in overrides:
        cfg.output_dir = run_dir_of(ckpt)  # the run the checkpoint belongs to, even if it was moved
    missing = missing_paths(cfg.model_dump(mode="json"), origin=ckpt / TRAIN_CONFIG, overridden=set(overrides),
                            lora=cfg.policy.lora.enabled)
    if missing:
        raise UserError("\n".join(missing) if len(missing) > 1 else missing[0])
    saved = read_training_state(ckpt)
    if accelerate_config is not None:
        setup = resolve_accelerate_config(accelerate_config)
    else:
        # The launch the checkpoint was saved under, so `opentau resume RUN` needs no flags.
        if not saved.get("accelerate"):
            raise UserError(f"Checkpoint '{ckpt}' does not record its launch; pass --accelerate-config.")
        setup = setup_from_dict(saved["accelerate"])
        notes.append(f"Using the checkpoint's launch setup ({setup.label}, {setup.world_size} processes).")
    setup = with_machine(setup, machines)
    check_not_live(cfg.output_dir, setup, break_lock, cfg.checkpoint.remote, cfg.checkpoint.remote_options)
    # A run on elastic machines changes its world by design (a machine that left or joins): no flag needed.
    reshard = reshard or cfg.distributed.machines is not None
    saved_config = None  # the checkpoint's train_config.json, read once
    if reshard and is_reshard(saved, setup):
        saved_config = _read_train_config(ckpt)
        notes.append(_keep_global_batch(cfg, saved_config, saved, setup, overrides))
    # The dataset commits the checkpoint trained on, and the branches they came from (launch.json of its launch).
    started_on = recorded_branches(ckpt, saved)
    branches = asked_revisions(cfg) if told_revision(overrides) else started_on
    notes.extend(pin_for_resume(ckpt, cfg, saved, overrides, started_on))
    unpin(cfg)  # a dataset in object storage: what its store holds now is pinned, then compared with the checkpoint's
    checked = check_launch(cfg, setup, machine, ckpt)
    # A local dataset rewritten under the same root since the checkpoint, or one in object storage whose files
    # changed: refused as another Hub commit would be, unless the command line says so (the flag, or naming it).
    notes.extend(check_unchanged(ckpt, checked.config.dataset.members(), saved.get(FINGERPRINTS) or {},
                                 accept=dataset_changed or told_revision(overrides), dataset=checked.config.dataset))
    state = check_resumable(ckpt, checked.config, setup, reshard=reshard)
    if saved_config is None:
        saved_config = json.loads((ckpt / TRAIN_CONFIG).read_text())  # readable: check_resumable read it
    check_lora_resume(ckpt, checked.config, state, saved_config)
    check_mixture_resume(ckpt, checked.config, saved_config, overrides)
    # A line only when there are newer checkpoints to move aside. Machine 0 judges the run's history: another machine
    # joins the live run, whose newest checkpoint may be published while this plan is made (elastic machines).
    history = check_history(ckpt, rollback) if setup.machine_rank == 0 else []
    remote_history = check_remote_history(checked.config, ckpt, rollback) if setup.machine_rank == 0 else []
    notes.extend(history + remote_history)
    schedule = describe_schedule_change(saved_config, checked.config, int(state.get("step", 0)))
    if schedule:
        notes.append(schedule)
    done = int(state.get("step", 0)) >= checked.config.steps
    if done:
        notes.append(f"Nothing to do: {ckpt} is at step {state.get('step')} of steps={checked.config.steps} "
                     "(pass a larger --steps to train further).")
    return RunPlan(checked=checked, resume_from=ckpt, notes=notes, finished=done, rollback=bool(history),
                   remote_rollback=bool(remote_history), dataset_branches=branches)


def recorded_branches(ckpt: Path, state: dict) -> dict[str, str]:
    """The revisions the launch that wrote `ckpt` asked its Hub datasets at (launch.json `dataset_branches`, found by
    the run id the checkpoint's lineage records); {} when not recorded."""
    import json

    from opentau_cli.store.lineage import lineage_in

    launch = (lineage_in(state) or {}).get("launch")
    if not state.get("dataset_revisions") or not isinstance(launch, str) or not launch:
        return {}
    try:
        recorded = json.loads((run_dir_of(ckpt) / LOGS / launch / LAUNCH_FILE).read_text()).get("dataset_branches")
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in recorded.items()} if isinstance(recorded, dict) else {}


def check_not_live(run_dir: Path, setup: AccelerateSetup, break_lock: bool, remote: str | None = None,
                   remote_options: dict | None = None) -> None:
    """A live run holding the run directory's lock is refused first, in the words the launch would use (process/runlock.py):
    what it is writing (a checkpoint being published, newer than `last` for a moment) must not be judged as a finished
    run's history (the history check would advise --rollback=true, which would move the live run's checkpoints), and
    nothing is printed before the refusal. Machine 0 takes the lock (and checkpoint.remote's lease: another launch
    writing there is refused the same way); the other machines of a run join it."""
    if setup.machine_rank == 0:
        runlock.check_free(run_dir, break_lock=break_lock)
        check_writer(remote, remote_options or {}, break_lock)


def wait_until_free(run_dir: Path, setup: AccelerateSetup, break_lock: bool, wait: float,
                    echo: Callable[[str], None], remote: str | None = None, remote_options: dict | None = None) -> None:
    """check_not_live, after waiting up to `wait` seconds (distributed.lock_wait_seconds) for a live run to release
    the run directory and checkpoint.remote's lease: a requeued job can start while the job it replaces still saves
    (SLURM sends KillWait's SIGKILL after its SIGTERM), and a lost node's lock goes stale STALE_S after its last
    heartbeat (process/runlock.py), its lease once it expires (process/lease.py)."""
    import time

    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            return check_not_live(run_dir, setup, break_lock, remote, remote_options)
        except UserError as busy:
            if time.monotonic() >= deadline:
                raise UserError(f"{str(busy).rstrip('.')}; waited {wait:g} s for it "
                                "(distributed.lock_wait_seconds).") from None
            if not said:
                echo(f"{busy} Waiting up to {wait:g} s for it to end (--resume=auto).")
                said = True
            time.sleep(1.0)


def check_history(ckpt: Path, rollback: bool) -> list[str]:
    """A resume writes its checkpoints after `ckpt`'s step: newer checkpoints of the run would be overwritten or mixed
    into another branch's history. Refused unless `rollback` (then the launcher moves them aside: lineage.py)."""
    from opentau_cli.store.lineage import ROLLED_BACK, newer_checkpoints, span

    run_dir = run_dir_of(ckpt)
    newer = newer_checkpoints(run_dir, ckpt)
    if not newer:
        return []
    if not rollback:
        # Advice is never the command just run: `opentau resume RUN` takes this checkpoint when the newer ones fail
        # their manifests.
        from opentau_cli.store.runs import latest

        newest = latest(run_dir)
        if newest is not None and newest.resolve() != Path(ckpt).resolve():
            why = "resuming from it would overwrite them and mix two histories"
            first = f"Resume the newest with `opentau resume {run_dir}`, or pass {ROLLBACK_FLAG}"
        else:
            why = "they fail their manifests (`opentau checkpoint list {run} --verify` says why), and resuming from it would overwrite them".format(run=run_dir)
            first = f"Restore them, or pass {ROLLBACK_FLAG}"
        raise UserError(
            f"Checkpoint {ckpt.name} is older than the run's newest checkpoints ({span(newer)}): {why}. {first} "
            f"to move the newer checkpoints and their metrics into {run_dir / ROLLED_BACK}/<time>/ "
            f"and continue from step {ckpt.name.lstrip('0') or 0}."
        )
    return [f"Rollback: {span(newer)} and their metrics records will move into {run_dir / ROLLED_BACK}/<time>/ "
            f"(nothing is deleted); the run continues from {ckpt}."]


def describe_schedule_change(saved: dict, cfg: TrainConfig, step: int) -> str | None:
    """The line that says what a new --steps does to the learning-rate schedule at the resume step (`saved`: the
    checkpoint's train_config.json)."""
    from opentau_cli.train.schedule import lr_at

    saved_steps = saved.get("steps")
    if saved_steps is None or saved_steps == cfg.steps or cfg.scheduler.type == "constant":
        return None
    if cfg.scheduler.decay_steps is not None:
        return (f"Schedule unchanged: scheduler.decay_steps={cfg.scheduler.decay_steps} fixes the cosine decay, "
                f"so --steps {saved_steps} -> {cfg.steps} only changes where the run stops.")
    before = lr_at(step, cfg.optimizer.lr, cfg.scheduler, saved_steps)
    after = lr_at(step, cfg.optimizer.lr, cfg.scheduler, cfg.steps)
    return (f"Schedule: --steps {saved_steps} -> {cfg.steps} re-plans the cosine decay over {cfg.steps} steps: the "
            f"learning rate at step {step} goes from {before:.3g} to {after:.3g}. To keep the original schedule, "
            f"pass --scheduler.decay_steps={saved_steps} (the rate then stays at decay_lr past step {saved_steps}).")


def _read_train_config(ckpt: Path) -> dict:
    import json

    try:
        return json.loads((ckpt / TRAIN_CONFIG).read_text())
    except (OSError, ValueError):
        raise UserError(f"Checkpoint '{ckpt}' has no readable {TRAIN_CONFIG}.") from None


def _keep_global_batch(cfg: TrainConfig, saved_cfg: dict, saved: dict, setup: AccelerateSetup, overrides: dict) -> str:
    """An elastic resume: set the per-process batch, per-device batch and accumulation that keep the checkpoint's
    global batch on this launch (`saved_cfg`: its train_config.json); returns the line that says what changed."""
    given = {key: getattr(cfg, key) for key in ("batch_size", "per_device_batch_size", "gradient_accumulation_steps")
             if key in overrides}  # parsed and typed by load_config
    batch = fit_global_batch(saved_cfg, int(saved["world_size"]), setup.world_size, given)
    for key, value in batch.items():
        setattr(cfg, key, value)
    before = dict(topology(saved))
    if before.get("per_device_batch") is None:  # a checkpoint from before the history: its config says
        before.update(per_device_batch=saved_cfg.get("per_device_batch_size"), grad_accum=saved_cfg.get("gradient_accumulation_steps"))
    return describe_change(before, topology_entry(int(saved.get("step", 0)), setup, cfg))
