"""Whether a checkpoint may resume into this launch: undamaged, in its run's checkpoints/ folder, saved by the same
topology (unless resharding) and the same architecture (docs/ARCHITECTURE.md, "Resume contract")."""

from __future__ import annotations

import json
from pathlib import Path

from opentau_cli.errors import UserError
from opentau_cli.store.layout import CHECKPOINTS, TRAIN_CONFIG, step_of
from opentau_cli.store.lineage import archive_of
from opentau_cli.store.manifest import verify_manifest
from opentau_cli.store.pickle_scan import scan_checkpoint_pickles
from opentau_cli.store.runs import read_training_state, run_dir_of


# Policy fields that change the shape of the weights: a checkpoint only resumes into the same values.
ARCHITECTURE_FIELDS = (
    "type", "preset", "chunk_size", "max_state_dim", "max_action_dim", "image_resolution",
    "tokenizer_max_length", "discrete_action_loss", "discrete_action_bins",
)


RESHARD_FLAG = "--reshard=true"
ROLLBACK_FLAG = "--rollback=true"


def _check_same_topology(ckpt_dir: Path, state: dict, setup) -> None:
    """A plain resume continues bit for bit only under the backend, ZeRO stage and world size it was saved by."""
    saved_backend, saved_stage = state.get("backend"), state.get("zero_stage")
    saved_ds = saved_backend == "deepspeed"
    if (saved_backend == "fsdp") != (setup.backend == "fsdp"):
        raise UserError(
            f"Checkpoint '{ckpt_dir}' was saved by {'FSDP2' if saved_backend == 'fsdp' else saved_backend} training and "
            f"this launch is {setup.label}: resume with the same backend, or pass {RESHARD_FLAG} to continue it under "
            "this launch."
        )
    if saved_ds and setup.backend != "deepspeed":
        raise UserError(
            f"Checkpoint '{ckpt_dir}' holds DeepSpeed ZeRO-{saved_stage} shards and this launch is {setup.label}: resume "
            f"with the same DeepSpeed accelerate config, pass {RESHARD_FLAG} to continue it under this launch, or run "
            "`opentau checkpoint consolidate` on it to start a new run from its weights."
        )
    if not saved_ds and setup.backend == "deepspeed":
        raise UserError(
            f"Checkpoint '{ckpt_dir}' was saved by {saved_backend} training and this launch is {setup.label}: resume with "
            f"the same backend, or pass {RESHARD_FLAG} to continue it under this launch."
        )
    if saved_ds and saved_stage != setup.zero_stage:
        raise UserError(
            f"Checkpoint '{ckpt_dir}' was saved under ZeRO-{saved_stage} and this launch is ZeRO-{setup.zero_stage}: "
            f"resume with the same ZeRO stage, or pass {RESHARD_FLAG} to continue it under this launch."
        )
    if state.get("world_size") != setup.world_size:
        raise UserError(
            f"Checkpoint '{ckpt_dir}' was saved by {state.get('world_size')} processes and this launch has "
            f"{setup.world_size}: resume with {state.get('world_size')} processes, or pass {RESHARD_FLAG} to continue it "
            "on these (the global batch is kept; losses then match the uninterrupted run within noise, not bit for bit)."
        )


def check_in_run(ckpt_dir: Path) -> None:
    """Refuse to resume a checkpoint that is not in its run's `checkpoints/` folder: a resume writes its checkpoints
    and metrics beside its source, so one from a rollback's archive (`rolled_back/<time>/checkpoints/`) would train
    inside the archive, and one copied elsewhere would make a run of whatever folder holds it (docs/ARCHITECTURE.md,
    "Run history": rolled-back checkpoints are never resumed). Exporting, evaluating and serving them is fine."""
    ckpt_dir = Path(ckpt_dir)
    copy = f"mkdir -p NEW_RUN/{CHECKPOINTS} && cp -r {ckpt_dir} NEW_RUN/{CHECKPOINTS}/ && opentau resume NEW_RUN"
    run = archive_of(ckpt_dir)
    if run is not None:
        raise UserError(f"Checkpoint {ckpt_dir} was moved aside by a rollback of {run}, and an archive is never resumed "
                        f"or written; to continue it, copy it into a new run and resume that: `{copy}`.")
    if ckpt_dir.parent.name != CHECKPOINTS:
        raise UserError(f"Checkpoint {ckpt_dir} is not in a run's {CHECKPOINTS}/ folder, so a resume would turn "
                        f"{ckpt_dir.parent} into a run; copy it into a new run and resume that: `{copy}`.")


def _earlier(ckpt_dir: Path) -> str:
    """The way out of a damaged checkpoint: the command that resumes the newest sound one before it (a rollback, as
    it is older than the damaged one), or restoring the files."""
    from opentau_cli.store.lineage import ROLLED_BACK
    from opentau_cli.store.runs import checkpoint_steps

    run = run_dir_of(ckpt_dir)
    step = step_of(Path(ckpt_dir).name)
    older = [p for s, p in checkpoint_steps(run / CHECKPOINTS) if step is not None and s < step]
    earlier = next((p for p in reversed(older) if not verify_manifest(p)), None)  # the newest sound one
    if earlier is None:
        return (f"No earlier checkpoint of {run} is sound: restore the files of {Path(ckpt_dir).name}, or start the run "
                "again with `opentau train`.")
    return (f"Restore its files, or resume the earlier checkpoint {earlier.name} with `opentau resume {earlier} "
            f"{ROLLBACK_FLAG}` (the newer checkpoints move into {run / ROLLED_BACK}/<time>/; nothing is deleted).")


def check_resumable(ckpt_dir: Path, cfg, setup, *, reshard: bool = False) -> dict:
    """Refuse (UserError, nothing loaded) a checkpoint that is damaged, lies outside its run's checkpoints/ (an
    archive: check_in_run) or does not fit this launch; returns its state. With `reshard` another backend, ZeRO stage
    or world size is allowed (train/reshard.py).

    The manifest is checked first, so library loaders that unpickle (Accelerate's RNG .pkl, optimizer.bin,
    DeepSpeed's .pt) only ever see files it vouches for.
    """
    check_in_run(ckpt_dir)
    problems = verify_manifest(ckpt_dir)
    if problems:
        shown = "; ".join(str(p) for p in problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise UserError(f"Checkpoint '{ckpt_dir}' fails its manifest ({shown}); nothing was loaded. {_earlier(ckpt_dir)}")
    # A forged manifest would vouch for anything: also vet every pickle the loaders will open (constructs nothing).
    unsafe = scan_checkpoint_pickles(ckpt_dir)
    if unsafe:
        raise UserError(f"Refusing to resume from '{ckpt_dir}': {unsafe[0]}; nothing was loaded.")
    state = read_training_state(ckpt_dir)
    if not reshard:
        _check_same_topology(ckpt_dir, state, setup)
    try:
        saved_cfg = json.loads((ckpt_dir / TRAIN_CONFIG).read_text())
    except (OSError, ValueError):
        raise UserError(f"Checkpoint '{ckpt_dir}' has no readable {TRAIN_CONFIG}.") from None
    saved_policy = saved_cfg.get("policy", {})
    now_policy = cfg.policy.model_dump(mode="json")
    diffs = [f"policy.{k}: checkpoint {saved_policy.get(k)!r}, now {now_policy.get(k)!r}"
             for k in ARCHITECTURE_FIELDS if saved_policy.get(k) != now_policy.get(k)]
    if diffs:
        raise UserError(
            f"Checkpoint '{ckpt_dir}' does not fit this config ({'; '.join(diffs)}); resume with the checkpoint's own "
            f"{TRAIN_CONFIG}, or start a new run with --policy.pretrained_path."
        )
    return state


# What names the run a checkpoint belongs to, beside the policy's shape: the data it learns from, the weights it
# started from and its seed. A command whose config differs here is another run (--resume=auto refuses to continue it).
RUN_FIELDS = ("seed", "dataset.repo_id", "dataset.root", "dataset.mixture", "policy.pretrained_path",
              "policy.lora.rank", *(f"policy.{name}" for name in ARCHITECTURE_FIELDS))


def _field(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def check_same_run(saved: dict, cfg, where: str, continue_with: str) -> None:
    """Refuse (UserError) to continue a checkpoint whose train_config.json (`saved`) is another run's than `cfg`'s:
    it differs in a RUN_FIELDS value. Paths are compared as the config resolved them (absolute)."""
    now = cfg.model_dump(mode="json")
    diffs = [f"{name} {_field(saved, name)!r} there, {_field(now, name)!r} here" for name in RUN_FIELDS
             if _field(saved, name) != _field(now, name)]
    if diffs:
        raise UserError(f"{where} holds another run ({'; '.join(diffs)}): pick another --output_dir"
                        f"{' and --checkpoint.remote' if '://' in continue_with else ''}, or continue that run with "
                        f"`opentau resume {continue_with}`.")
