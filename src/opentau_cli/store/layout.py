"""Where a run keeps its files: the one place that spells a run's or a checkpoint's file and directory names, and
those of the machine's cache of datasets in object storage (below).

docs/ARCHITECTURE.md, "Checkpoint contract". A run directory holds:

    metrics.jsonl, tensorboard/train/, logs/<time>/, logs/run.lock (while a run lives)
    rolled_back/<time>/                 checkpoints/, metrics.jsonl and evals/ a rollback moved aside (lineage.py)
    evals/<step>.json, evals/queue.json the evaluations in a simulator with eval.env (evals.py)
    checkpoints/<step>/                 published checkpoints, the step zero-padded (step_dir_name)
    checkpoints/last                    the newest published one (point_last writes it, read_last reads it)
    checkpoints/best                    with checkpoint.keep_best: the best by checkpoint.best_metric
    checkpoints/.tmp-<step>-<run id>/   a save in progress, or left by an interrupted one
    checkpoints/.old-<step>-<run id>/   a checkpoint being deleted, or left by an interrupted deletion

A checkpoint directory holds what `accelerator.save_state` writes (Accelerate's and DeepSpeed's own names, below),
train_config.json, training_state.json and, written last, manifest.json. Imports nothing heavy: the launcher uses it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from opentau_cli.errors import UserError

# The run directory.
CHECKPOINTS = "checkpoints"
LAST = "last"
BEST = "best"  # checkpoints/best: the best kept checkpoint by checkpoint.best_metric (keep_best)
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
TB_RUN = "train"  # tensorboard/train/: every launch of a run writes there (a resume with purge_step)
LOGS = "logs"
RUN_LOCK = "run.lock"  # logs/run.lock: held by the live run (opentau_cli.process.runlock)
LAUNCHER_LOG = "launcher.log"  # logs/<time>/launcher.log: Accelerate's launcher and torch's elastic agent write here
LAUNCH_FILE = "launch.json"  # logs/<run id>/launch.json: what process/launch.py hands its ranks, read back by a later resume
UPLOADING = ".uploading"  # .uploading/<name>/: links to a checkpoint's files while it uploads (process/uploader.py)
EVALS = "evals"  # evals/<step>.json, evals/queue.json: the evaluations in a simulator (store/evals.py)
ROLLED_BACK = "rolled_back"  # rolled_back/<time>/checkpoints/<step>/ and rolled_back/<time>/metrics.jsonl (lineage.py)

# What opentau adds to a checkpoint.
TRAIN_CONFIG = "train_config.json"
TRAINING_STATE = "training_state.json"
MANIFEST = "manifest.json"
# The EMA of the trained weights (train/ema.py): single / DDP, rank 0's by parameter name; DeepSpeed, each rank's of
# its own fp32 master partitions.
EMA_WEIGHTS = "ema.safetensors"
EMA_STATE = "ema"  # training_state.json's record of the EMA ({"decay": d}); absent when the run kept none

# What Accelerate's save_state writes (accelerate.utils.constants; tests check them against it).
MODEL_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # Hugging Face shards: model-00001-of-00003.safetensors + this index
OPTIMIZER = "optimizer.bin"
SCHEDULER = "scheduler.bin"

# What DeepSpeed's save_checkpoint writes under Accelerate: a tag directory named after Accelerate's MODEL_NAME,
# a `latest` file naming it, and per-rank shards (`[bf16_]zero_pp_rank_<r>_mp_rank_00_{optim,model}_states.pt`; the
# model states of ZeRO-1/2 are the single `mp_rank_00_model_states.pt`).
DS_TAG = "pytorch_model"
DS_LATEST = "latest"
DS_MODEL_STATES = "mp_rank_00_model_states.pt"
DS_SHARD_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")
ZERO_TO_FP32 = "zero_to_fp32.py"  # DeepSpeed copies its consolidation script into each save
# What an FSDP2 save writes (store/dcp.py): DCP's directory (model + optimizer, sharded per rank) and its metadata.
DCP_DIR = "fsdp_state"
DCP_METADATA = ".metadata"

_SAVING = ".tmp-"
_DELETING = ".old-"

# A machine's cache of datasets in object storage (data/remote.py; docs/ARCHITECTURE.md, "Datasets in object
# storage"), $OPENTAU_CACHE_DIR/datasets:
#
#     <cache>/.lock                      one flock for every change of what the cache holds
#     <cache>/.pressure                  touched when a process needs room: the others let go of what they keep open
#     <cache>/<id>/source.json           the dataset's URL (id: a digest of it)
#     <cache>/<id>/meta-<digest>/meta/   one version of its meta files: the root `read_meta` reads (never evicted)
#     <cache>/<id>/pins/<revision>.json  the files a run reads and their versions (never evicted)
#     <cache>/<id>/files/<path>.<tag>    fetched data and video files, <tag> naming their version (evicted LRU)
#     <file>.<pid>.part                  a file being written by process <pid>, its whole size allocated
DATASET_CACHE = "datasets"
CACHE_LOCK = ".lock"
CACHE_PRESSURE = ".pressure"
DATASET_SOURCE = "source.json"
DATASET_META = "meta"  # a LeRobot dataset's meta/ folder
DATASET_FILES = "files"
DOWNLOAD_PART = ".part"


def cached_meta_dir(dataset_home: Path, version: str) -> Path:
    """Where one version of a cached dataset's meta/ is kept: <id>/meta-<version>."""
    return dataset_home / f"{DATASET_META}-{version}"


def pins_file(dataset_home: Path, revision: str) -> Path:
    """The record of the files a run reads of a cached dataset, and their versions: <id>/pins/<revision>.json."""
    return dataset_home / "pins" / f"{revision}.json"


def rank_state_file(rank: int) -> str:
    """Accelerate's per-rank RNG state file (RNG_STATE_NAME)."""
    return f"random_states_{rank}.pkl"


def ema_rank_file(rank: int) -> str:
    """A DeepSpeed rank's EMA of its fp32 master partitions."""
    return f"ema_rank{rank}.safetensors"


def ema_group_name(group: int) -> str:
    """The tensor in ema_rank<r>.safetensors that holds the EMA of parameter group `group`'s flat partition."""
    return f"group_{group}"


def ds_shard_glob(kind: str, rank: int | None = None) -> str:
    """Glob for DeepSpeed's `kind` ("optim" or "model") states files, of every rank or of one."""
    return f"*_{kind}_states.pt" if rank is None else f"*zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"


def weights_index_path(weights: Path) -> Path:
    """The index of a sharded output: model.safetensors -> model.safetensors.index.json."""
    return weights.with_name(weights.name + ".index.json")


def weights_shard_path(weights: Path, i: int, n: int) -> Path:
    """Shard i of n (from 1) of a sharded output, Hugging Face's naming: model-00001-of-00003.safetensors."""
    return weights.with_name(f"{weights.stem}-{i:05d}-of-{n:05d}{weights.suffix}")


def step_dir_name(step: int, total_steps: int) -> str:
    return str(step).zfill(max(6, len(str(total_steps))))


def step_of(name: str) -> int | None:
    """The step a published checkpoint directory is named for (the inverse of step_dir_name); None for other names."""
    return int(name) if name.isdigit() else None


def tmp_dir(root: Path, step_name: str, run_id: str) -> Path:
    """Where a save of `step_name` by run `run_id` is written before it is published."""
    return root / f"{_SAVING}{step_name}-{run_id}"


def old_dir(root: Path, step_name: str, run_id: str) -> Path:
    """Where a checkpoint is hidden (renamed) before it is deleted."""
    return root / f"{_DELETING}{step_name}-{run_id}"


def leftover_of(name: str) -> tuple[str, str] | None:
    """("save" or "deletion", step dir name) if `name` is a temp dir of a save or a deletion, else None."""
    for prefix, kind in ((_SAVING, "save"), (_DELETING, "deletion")):
        if name.startswith(prefix):
            return kind, name[len(prefix):].split("-", 1)[0]
    return None


def point_last(root: Path, name: str, link_name: str = LAST) -> None:
    """Atomically repoint `checkpoints/last` (or `checkpoints/best`): a relative symlink, a pointer file where links
    are not possible."""
    link = root / link_name
    tmp = root / f".{link_name}-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(name, tmp)
    except OSError:
        tmp.write_text(name + "\n")
    os.replace(tmp, link)


def read_last(root: Path, link_name: str = LAST) -> str | None:
    """The checkpoint name `checkpoints/last` (or `checkpoints/best`) designates, or None."""
    link = root / link_name
    if link.is_symlink():
        return Path(os.readlink(link)).name
    if link.is_file():
        return link.read_text().strip() or None
    return None


def holds_run(path: Path) -> bool:
    """True when a fresh run must not write into `path`: it holds a checkpoint, or anything opentau does not write.

    The directory of a start that failed before its first checkpoint (logs, perhaps metrics) is not in use, so the
    same command can be run again (`launch.prepare_output_dir` files that start's results under its logs)."""
    if not path.exists():
        return False
    if not path.is_dir():
        return True
    if any(entry.name not in (LOGS, METRICS, TENSORBOARD, CHECKPOINTS) for entry in path.iterdir()):
        return True
    ckpts = path / CHECKPOINTS
    return ckpts.exists() and (not ckpts.is_dir() or any(leftover_of(entry.name) is None for entry in ckpts.iterdir()))


def is_checkpoints_folder(path: Path) -> bool:
    """A run's `checkpoints/` (or a rollback's `rolled_back/<time>/checkpoints/`): so named, and holding a
    published checkpoint, `last` / `best`, or a save's or deletion's leftover."""
    path = Path(path)
    if path.name != CHECKPOINTS or not path.is_dir():
        return False
    try:
        return any(step_of(e.name) is not None or e.name in (LAST, BEST) or leftover_of(e.name) for e in path.iterdir())
    except OSError:
        return False


def is_checkpoint_dir(path: Path) -> bool:
    """A checkpoint directory, published or copied elsewhere: it holds what opentau adds to every checkpoint."""
    path = Path(path)
    return path.is_dir() and ((path / TRAINING_STATE).is_file() or (path / MANIFEST).is_file())


def is_run_dir(path: Path) -> bool:
    """A run directory: it holds checkpoints, metrics or a live run's lock (a rolled-back run also holds its
    checkpoints/ and metrics; a rollback's archive, rolled_back/<time>/, counts as a run of its own)."""
    path = Path(path)
    return path.is_dir() and (is_checkpoints_folder(path / CHECKPOINTS) or (path / METRICS).is_file()
                              or (path / LOGS / RUN_LOCK).exists())


def run_part(path: Path) -> str | None:
    """What `path` is of a run ("the run", "the checkpoints folder", "the checkpoint"), read from disk; None when it is
    none of them."""
    if is_run_dir(path):
        return "the run"
    if is_checkpoints_folder(path):
        return "the checkpoints folder"
    if is_checkpoint_dir(path):
        return "the checkpoint"
    return None


def is_dcp_checkpoint(ckpt_dir: Path) -> bool:
    """Whether `ckpt_dir` holds an FSDP2 checkpoint's sharded state (DCP_DIR with its metadata)."""
    return (Path(ckpt_dir) / DCP_DIR / DCP_METADATA).is_file()


def find_tag_dir(ckpt_dir: Path) -> Path:
    """The directory holding DeepSpeed's *_model_states.pt: via `latest`, a single tag subdir, or ckpt_dir itself."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise UserError(f"{ckpt_dir} is not a directory.")

    states = ds_shard_glob("model")

    def has_states(d: Path) -> bool:
        return any(d.glob(states))

    for root in (ckpt_dir, ckpt_dir / DS_TAG):
        latest = root / DS_LATEST
        if latest.is_file():
            tag = latest.read_text().strip()
            if tag and "/" not in tag and has_states(root / tag):
                return root / tag
            raise UserError(f"{latest} names DeepSpeed tag '{tag}', but {root / tag} holds no {states} file.")
    if has_states(ckpt_dir):
        return ckpt_dir
    candidates = sorted({p.parent for p in ckpt_dir.glob(f"*/{states}")} | {p.parent for p in ckpt_dir.glob(f"*/*/{states}")})
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise UserError(f"{ckpt_dir} holds several DeepSpeed tags ({', '.join(c.name for c in candidates)}) and no "
                        f"'{DS_LATEST}' file; pass the tag directory itself.")
    if (ckpt_dir / MODEL_WEIGHTS).exists():
        raise UserError(f"{ckpt_dir} is not a DeepSpeed checkpoint: its weights are already in {MODEL_WEIGHTS}.")
    if (ckpt_dir / CHECKPOINTS).is_dir():
        raise UserError(f"{ckpt_dir} is a run directory: pass one of its checkpoints, e.g. {ckpt_dir / CHECKPOINTS / LAST}.")
    raise UserError(f"{ckpt_dir} is not a DeepSpeed checkpoint (no {states} under it).")


def rank_shard_files(tag_dir: Path, kind: str) -> dict[int, Path]:
    """rank -> DeepSpeed's `kind` ("optim" or "model") states file in a tag directory (ZeRO-1/2's one model file: 0)."""
    files = {}
    for p in tag_dir.glob(ds_shard_glob(kind)):
        m = DS_SHARD_RE.search(p.name)
        if m and int(m.group(2)) != 0:
            raise UserError(f"{p}: tensor/pipeline-parallel (mp_rank > 0) checkpoints are not supported.")
        files[int(m.group(1)) if m else 0] = p
    return files
