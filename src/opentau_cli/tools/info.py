"""Read-only views of checkpoints: `inspect` one or a run, `verify` one or a whole run, `list` a run's checkpoints.

Nothing here unpickles anything but allow-listed data: JSON files, safetensors headers, and DeepSpeed shards through
`shard_reader` (metadata only, never tensor data). torch is imported only to read a DeepSpeed or FSDP2 checkpoint's
metadata: `checkpoint list`, `inspect` and `verify` of safetensors checkpoints start without it (a second of CPU).
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opentau_cli.errors import UserError
from opentau_cli.store import evals, manifest as mf
from opentau_cli.store.format import check_readable
from opentau_cli.store.layout import (
    BEST, CHECKPOINTS, DS_SHARD_RE, DS_TAG, LAST, MANIFEST, MODEL_WEIGHTS, TRAIN_CONFIG, TRAINING_STATE, WEIGHTS_INDEX, ds_shard_glob,
    find_tag_dir, is_dcp_checkpoint, leftover_of, rank_shard_files, read_last, step_of,
)
from opentau_cli.store.lineage import current_branch, lineage_in, lineage_of, newest_complete, rolled_back


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes); reads only the header bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("too short")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable safetensors file ({e}).") from None
    header.pop("__metadata__", None)
    return header


def dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass
class CheckpointInfo:
    path: str
    step: int | None = None
    backend: str | None = None
    zero_stage: int | None = None
    world_size: int | None = None
    mixed_precision: str | None = None
    preset: str | None = None
    policy_type: str | None = None
    parameters: int | None = None
    trainable_parameters: int | None = None
    parameters_source: str | None = None
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> number of values
    consolidated: bool | None = None  # None: not a DeepSpeed checkpoint (weights already in model.safetensors)
    complete: bool = False
    files: dict[str, int] = field(default_factory=dict)  # relative path -> bytes
    total_bytes: int = 0
    time: str | None = None
    lora: dict | None = None  # a LoRA checkpoint: rank, alpha and the base it does not copy ({"source", "files"|"seed"})
    lineage: dict | None = None  # the checkpoint it continues and the launch that wrote it (store/lineage.py)
    links: list[str] = field(default_factory=list)  # which of its run's checkpoints/last and checkpoints/best point at it
    evaluation: dict | None = None  # its evaluation in eval.env (evaluation_of), None when the run evaluates none

    def to_dict(self) -> dict:
        return asdict(self)


def evaluation_of(run_dir: Path, name: str) -> dict | None:
    """A checkpoint's evaluation in the simulator (eval.env, store/evals.py) without its episodes: the record (status
    done, skipped or failed), or {"status": "running" | "waiting"} while the launcher owes it; None otherwise."""
    record = evals.read_record(run_dir, name)
    if record is not None:
        return {k: v for k, v in record.items() if k != "episodes"}
    queue = evals.read_queue(run_dir)
    if queue["running"] == name:
        return {"status": "running"}
    return {"status": "waiting"} if name in queue["waiting"] else None


def describe_evaluation(evaluation: dict | None) -> str:
    """'62.5%', 'skipped', 'running', ... ('-': none)."""
    if not evaluation:
        return "-"
    if evaluation.get("status") == evals.DONE:
        return f"{evaluation['success_rate']:.1%}"
    return evaluation.get("status", "-")


def _weights_index(ckpt_dir: Path) -> list[Path]:
    single = ckpt_dir / MODEL_WEIGHTS
    if single.is_file():
        return [single]
    index = ckpt_dir / WEIGHTS_INDEX
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        return [ckpt_dir / n for n in names]
    return []


def inspect_checkpoint(ckpt_dir: Path) -> CheckpointInfo:
    """Describe one checkpoint dir (opentau's, or a bare DeepSpeed / Accelerate save_state dir)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise UserError(f"{ckpt_dir} is not a directory.")
    check_readable(ckpt_dir)
    info = CheckpointInfo(path=str(ckpt_dir))
    state = _read_json(ckpt_dir / TRAINING_STATE)
    config = _read_json(ckpt_dir / TRAIN_CONFIG)
    info.step = state.get("step")
    info.backend = state.get("backend")
    info.zero_stage = state.get("zero_stage")
    info.world_size = state.get("world_size")
    info.mixed_precision = state.get("mixed_precision")
    info.time = state.get("time")
    info.lineage = lineage_in(state)
    policy = config.get("policy", {}) if isinstance(config.get("policy"), dict) else {}
    info.preset = state.get("preset") or policy.get("preset")
    info.policy_type = policy.get("type")
    if (policy.get("lora") or {}).get("rank"):
        info.lora = {"rank": policy["lora"]["rank"], "alpha": policy["lora"].get("alpha"), "base": state.get("lora_base")}
    for rel in mf.list_files(ckpt_dir):
        info.files[rel] = (ckpt_dir / rel).stat().st_size
    if (ckpt_dir / MANIFEST).exists():
        info.files[MANIFEST] = (ckpt_dir / MANIFEST).stat().st_size
    info.total_bytes = sum(info.files.values())
    info.complete = mf.is_complete(ckpt_dir)
    info.links = links_to(ckpt_dir)
    if ckpt_dir.resolve().parent.name == CHECKPOINTS:
        info.evaluation = evaluation_of(ckpt_dir.resolve().parent.parent, ckpt_dir.resolve().name)

    ds = _deepspeed_summary(ckpt_dir)
    weights = _weights_index(ckpt_dir)
    if ds is not None:
        info.backend = info.backend or "deepspeed"
        for k in ("zero_stage", "world_size", "step", "mixed_precision"):
            if getattr(info, k) is None:
                setattr(info, k, ds[k])
        info.parameters, info.trainable_parameters = ds["parameters"], ds["trainable"]
        info.dtypes = ds["dtypes"]
        info.parameters_source = "deepspeed shards (parameters only)"
        info.consolidated = bool(weights)
    elif is_dcp_checkpoint(ckpt_dir):  # FSDP2: the model's tensors as its DCP metadata lists them
        from opentau_cli.store.dcp import summary as dcp_summary

        info.parameters, info.dtypes = dcp_summary(ckpt_dir)
        info.parameters_source = "DCP shards (parameters and buffers)"
        info.consolidated = bool(weights)
    if weights and ds is None and info.consolidated is None:
        counts: Counter = Counter()
        for w in weights:
            for meta in safetensors_header(w).values():
                counts[meta["dtype"]] += math.prod(meta["shape"])
        info.dtypes = dict(counts)
        info.parameters = sum(counts.values())
        info.parameters_source = f"{MODEL_WEIGHTS} (parameters and buffers)"
    return info


def links_to(ckpt_dir: Path) -> list[str]:
    """Which of `last` and `best` in the checkpoints/ folder holding `ckpt_dir` designate it (`ckpt_dir` may be one of
    those links itself)."""
    real = Path(os.path.realpath(ckpt_dir))
    if real.parent.name != CHECKPOINTS:
        return []
    return [link for link in (LAST, BEST) if read_last(real.parent, link) == real.name]


def _deepspeed_summary(ckpt_dir: Path) -> dict | None:
    """Stage, world size, step and parameter counts from DeepSpeed's model-states file (metadata only)."""
    try:
        tag_dir = find_tag_dir(ckpt_dir)
    except UserError:
        return None
    models = rank_shard_files(tag_dir, "model")
    optims = rank_shard_files(tag_dir, "optim")
    if 0 not in models:
        return None
    from opentau_cli.store.shard_reader import LazyTensor, load_shard

    m0 = load_shard(models[0])
    shapes = {k: v for group in (m0.get("param_shapes") or []) for k, v in group.items()}
    frozen = m0.get("frozen_param_shapes") or {}
    trainable = sum(math.prod(s) for s in shapes.values())
    dtypes: Counter = Counter()
    for name, t in (m0.get("module") or {}).items():
        if name in shapes or name in frozen:
            n = math.prod(shapes.get(name) or frozen.get(name))
            dtypes[str(t.dtype).removeprefix("torch.") if isinstance(t, LazyTensor) else "?"] += n
    stage = 3 if any(DS_SHARD_RE.search(p.name) for p in models.values()) else 2  # per-rank model states: ZeRO-3
    ds_cfg = m0.get("ds_config") if isinstance(m0.get("ds_config"), dict) else {}
    stage = (ds_cfg.get("zero_optimization") or {}).get("stage", stage)
    precision = "bf16" if (ds_cfg.get("bf16") or {}).get("enabled") else "fp16" if (ds_cfg.get("fp16") or {}).get("enabled") else "no"
    return {
        "mixed_precision": precision,
        "zero_stage": stage,
        "world_size": m0.get("dp_world_size") or len(optims),
        "step": m0.get("global_steps"),
        "parameters": trainable + sum(math.prod(s) for s in frozen.values()),
        "trainable": trainable,
        "dtypes": dict(dtypes),
    }


# ---------------------------------------------------------------- verify / list


@dataclass
class VerifyReport:
    checkpoints: dict[str, list[str]] = field(default_factory=dict)  # checkpoint path -> problems ([] = sound)
    notes: list[str] = field(default_factory=list)  # leftovers and the like: reported, not failures
    problems: list[str] = field(default_factory=list)  # run-level problems (e.g. `last` points nowhere)

    @property
    def ok(self) -> bool:
        return not self.problems and all(not p for p in self.checkpoints.values())


def _checkpoint_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]
    return sorted(dirs, key=lambda p: (step_of(p.name) is None, step_of(p.name) or 0, p.name))


def _leftovers(root: Path) -> list[Path]:
    """Dirs of interrupted saves and deletions: never checkpoints; the next run removes them."""
    return sorted(p for p in root.iterdir() if p.is_dir() and leftover_of(p.name))


def _run_root(path: Path) -> Path | None:
    """The `checkpoints/` dir if `path` is a run dir or a checkpoints dir, else None (a single checkpoint)."""
    if (path / CHECKPOINTS).is_dir():
        return path / CHECKPOINTS
    if path.name == CHECKPOINTS and not (path / MANIFEST).exists():
        return path
    return None


def verify_path(path: Path) -> VerifyReport:
    """Re-hash every file of one checkpoint, or of every checkpoint of a run, against its manifest."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory: pass a checkpoint directory or a run directory.")
    report = VerifyReport()
    root = _run_root(path)
    if root is None:
        check_readable(path)
        report.checkpoints[str(path)] = [str(p) for p in mf.verify_manifest(path)]
        return report
    dirs = _checkpoint_dirs(root)
    if not dirs:
        raise UserError(f"{root} holds no checkpoints.")
    for d in dirs:
        check_readable(d)
    for d in dirs:
        report.checkpoints[str(d)] = [str(p) for p in mf.verify_manifest(d)]
    for d in _leftovers(root):
        what, _ = leftover_of(d.name)
        report.notes.append(f"{d.name}: an interrupted {what} (not a checkpoint; the next run removes it)")
    last = read_last(root)
    if (root / LAST).exists() or (root / LAST).is_symlink():
        if last is None or not (root / last).is_dir():
            report.problems.append(f"{root / LAST} points at '{last}', which does not exist")
        elif report.checkpoints.get(str(root / last)):
            report.problems.append(f"{root / LAST} points at {last}, which fails verification")
    return report


@dataclass
class ListedCheckpoint:
    name: str  # under checkpoints/, or rolled_back/<time>/checkpoints/<step> for a rolled-back one
    step: int | None
    time: str | None
    bytes: int
    complete: bool  # every file its manifest lists is there at its size; re-hashed too when `verified` is not None
    last: bool  # checkpoints/last points at it
    consolidated: bool | None
    note: str = ""
    verified: bool | None = None  # None: hashes not checked (list without --verify, or a leftover: no checkpoint)
    branch: bool = False  # on the branch `last` designates (what `opentau resume RUN` continues)
    parent: str | None = None  # the checkpoint it continues, from its lineage record
    rolled_back: str | None = None  # the rollback (rolled_back/<time>) that moved it aside
    best: bool = False  # checkpoints/best (checkpoint.keep_best) points at it
    evaluation: dict | None = None  # its evaluation in eval.env (evaluation_of)


def list_run(run_dir: Path, *, verify: bool = False) -> list[ListedCheckpoint]:
    """Every checkpoint of a run (and leftovers of interrupted saves), oldest first, then those rolled back.

    Cheap by default: sizes against the manifest, no re-hash; `verify` re-hashes every file as `checkpoint verify` does."""
    run_dir = Path(run_dir)
    root = _run_root(run_dir)
    if root is None:
        if not run_dir.is_dir():
            raise UserError(f"{run_dir} is not a directory.")
        raise UserError(f"{run_dir} has no {CHECKPOINTS}/ directory: pass a run directory (e.g. outputs/train/pi05).")
    run = root.parent
    last, best = read_last(root), read_last(root, BEST)
    branch = {p.name for p in current_branch(run)}
    rows = []
    for d in _checkpoint_dirs(root) + _leftovers(root):
        check_readable(d)
        leftover = leftover_of(d.name)
        row = _listed(d, d.name, verify, leftover=leftover)
        row.last, row.best = not leftover and d.name == last, not leftover and d.name == best
        row.branch = not leftover and d.name in branch
        row.evaluation = None if leftover else evaluation_of(run, d.name)
        rows.append(row)
    for stamp, d in rolled_back(run):
        row = _listed(d, d.relative_to(run).as_posix(), verify, leftover=None)
        row.rolled_back = stamp
        rows.append(row)
    return rows


def _listed(d: Path, name: str, verify: bool, leftover) -> ListedCheckpoint:
    state = _read_json(d / TRAINING_STATE)
    step = state.get("step", step_of(d.name))
    when = state.get("time") or time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(d.stat().st_mtime))
    ds = (d / DS_TAG).is_dir() or any(d.glob(f"*/{ds_shard_glob('model')}")) or is_dcp_checkpoint(d)
    consolidated = ((d / MODEL_WEIGHTS).is_file() or (d / WEIGHTS_INDEX).is_file()) if ds else None
    problems = [] if leftover else mf.verify_manifest(d, rehash=verify)
    complete = not leftover and not problems
    if leftover:
        note = f"interrupted {leftover[0]}"
    elif problems:
        note = ("fails verification: " if verify else "incomplete: ") + "; ".join(map(str, problems[:2])) + \
            (f"; and {len(problems) - 2} more" if len(problems) > 2 else "")
    else:
        note = ""
    parent = ((lineage_in(state) or {}).get("parent") or {}).get("name")
    return ListedCheckpoint(name=name, step=step, time=when, bytes=dir_size(d), complete=complete, last=False,
                            consolidated=consolidated, note=note, verified=complete if verify and not leftover else None,
                            parent=parent)


# ---------------------------------------------------------------- inspect a run


@dataclass
class RunInfo:
    path: str
    checkpoints: list[str] = field(default_factory=list)  # published, oldest first
    last: str | None = None  # what checkpoints/last designates
    best: str | None = None  # what checkpoints/best designates (checkpoint.keep_best)
    last_complete: bool | None = None  # its files at their manifest sizes (hashes not checked)
    branch: list[str] = field(default_factory=list)  # `last` and its ancestors, oldest first
    off_branch: list[str] = field(default_factory=list)  # published, but not on last's branch
    resumes_from: str | None = None  # what `opentau resume RUN` continues
    launches: list[str] = field(default_factory=list)  # the launches that wrote the branch, oldest first
    rolled_back: dict[str, list[str]] = field(default_factory=dict)  # rolled_back/<time> -> the checkpoints it holds
    interrupted: list[str] = field(default_factory=list)  # leftovers of interrupted saves or deletions
    restarts: list[dict] = field(default_factory=list)  # automatic restarts, oldest first (process/restarts.py)
    # checkpoint.remote: {"url", "checkpoints": {name: "remote" | "uploading" | "local"}, ...} as the launcher's
    # uploads left it (process/uploader.py)
    remote: dict | None = None
    evaluations: dict[str, dict] = field(default_factory=dict)  # checkpoint name -> its evaluation (evaluation_of)

    def to_dict(self) -> dict:
        return asdict(self)


def is_run_dir(path: Path) -> bool:
    return _run_root(Path(path)) is not None


def inspect_run(run_dir: Path) -> RunInfo:
    """Describe a run directory: its checkpoints, `last`, the branch `last` is on, and what rollbacks moved aside."""
    run_dir = Path(run_dir)
    root = _run_root(run_dir)
    if root is None:
        raise UserError(f"{run_dir} has no {CHECKPOINTS}/ directory: pass a run directory or a checkpoint directory.")
    run = root.parent
    info = RunInfo(path=str(run))
    published = [d for d in _checkpoint_dirs(root) if step_of(d.name) is not None]
    info.checkpoints = [d.name for d in published]
    info.interrupted = [d.name for d in _leftovers(root)]
    info.last, info.best = read_last(root), read_last(root, BEST)
    if info.last and (root / info.last).is_dir():
        info.last_complete = mf.is_complete(root / info.last)
    branch = current_branch(run)
    info.branch = [d.name for d in branch]
    info.off_branch = [n for n in info.checkpoints if n not in info.branch]
    point = newest_complete(branch)  # resume_point's answer, from the branch walked above
    info.resumes_from = point.name if point is not None else None
    for d in branch:
        launch = (lineage_of(d) or {}).get("launch")
        if launch and launch not in info.launches:
            info.launches.append(launch)
    for stamp, d in rolled_back(run):
        info.rolled_back.setdefault(stamp, []).append(d.name)
    from opentau_cli.process.restarts import read_restarts

    info.restarts = read_restarts(run)
    from opentau_cli.process.uploader import read_status

    info.remote = read_status(run)
    names = sorted(set(evals.records(run)) | evals.busy(run), key=int)
    info.evaluations = {n: e for n in names if (e := evaluation_of(run, n)) is not None}
    return info
