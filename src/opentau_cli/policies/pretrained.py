"""Start a policy from published or own weights: resolve the source, detect its layout, match every tensor, report,
load tensor by tensor (ZeRO-3: one gathered parameter at a time), and take normalization statistics from the
checkpoint where it has them.

A checkpoint is read through `safe_open`: its header gives names and shapes without reading data, so the match and
its report (and every refusal) come before any weight is touched, identically on every rank.

`build_pretrained` builds the policy without random initialization (parameters on the meta device) and reads each
tensor from the file straight into its parameter's new storage: host RAM holds about one copy of the weights.
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from opentau_cli.errors import UserError
from opentau_cli.policies import hub
from opentau_cli.policies.layouts import NATIVE, Layout, detect_layout, ignored_reason, our_name, read_stats
from opentau_cli.store.layout import MODEL_WEIGHTS, WEIGHTS_INDEX

SHORT_LIST = 8


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: a file, a directory with model.safetensors, or shards + index."""
    if path.is_file():
        return [path]
    if (path / MODEL_WEIGHTS).is_file():
        return [path / MODEL_WEIGHTS]
    index = path / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise UserError(f"{index}: not a safetensors index ({exc}).") from exc
        return [path / name for name in sorted(set(weight_map.values()))]
    raise UserError(f"{path}: holds neither {MODEL_WEIGHTS} nor {WEIGHTS_INDEX}.")


class Checkpoint:
    """An open checkpoint: names and shapes from the headers, tensors read one at a time on demand."""

    def __init__(self, source: str | Path):
        self.source = str(source)
        self.path = hub.resolve(self.source, "policy.pretrained_path")
        self.root = self.path if self.path.is_dir() else self.path.parent
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}  # tensor name -> the open file holding it
        self._files: dict[str, Path] = {}  # tensor name -> the file holding it
        self._starts: dict[Path, dict[str, int]] = {}  # file -> where each tensor's bytes start (read_into only)
        self.shapes: dict[str, tuple[int, ...]] = {}
        try:
            for file in weight_files(self.path):
                if not file.is_file():
                    raise UserError(f"{file}: shard named by the index is missing.")
                try:
                    handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                    for key in handle.keys():
                        self.shapes[key] = tuple(handle.get_slice(key).get_shape())
                        self._handles[key] = handle
                        self._files[key] = file
                except (SafetensorError, OSError) as exc:
                    raise UserError(f"{file}: not a readable safetensors file ({exc}).") from exc
            self.layout: Layout = detect_layout(self.shapes, self.source)
        except BaseException:
            self._stack.close()
            raise

    def tensor(self, key: str) -> torch.Tensor:
        return self._handles[key].get_tensor(key)

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill `out` (contiguous, on the CPU, the tensor's shape) with the tensor, cast to out's dtype. Read with
        plain file reads, not through the memory map: mapped pages count in the process's resident memory for as
        long as the file stays open, page-cache pages do not."""
        dtype = self.tensor(key).dtype  # the mapped tensor: its dtype, no byte read
        target = out if dtype == out.dtype else torch.empty(out.shape, dtype=dtype)
        if target.numel():
            view = memoryview(target.view(-1).view(torch.uint8).numpy())
            file = self._files[key]
            if file not in self._starts:  # the header again, once per file: safe_open does not give the offsets
                self._starts[file] = _data_starts(file)
            start = self._starts[file][key]
            with open(file, "rb", buffering=0) as f:
                f.seek(start)
                done = 0
                while done < len(view):  # one read returns at most ~2 GB
                    n = f.readinto(view[done:])
                    if not n:
                        raise UserError(f"{file}: ends inside tensor {key} (a truncated download?).")
                    done += n
        if target is not out:
            out.copy_(target)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _data_starts(file: Path) -> dict[str, int]:
    """Where each tensor's bytes start in a safetensors file: 8 bytes of header length, the JSON header, the data."""
    with open(file, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
    return {key: 8 + length + entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"}


def _shown(keys: list[str], limit: int = SHORT_LIST) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


@dataclass
class LoadReport:
    """What a load did: the layout, every tensor loaded (policy name <- checkpoint name), and every missing,
    unexpected, mis-shaped or deliberately ignored one; plus where the normalization statistics came from."""

    source: str = ""
    resolved: str = ""
    layout: Layout | None = None
    loaded: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    shapes: dict[str, tuple] = field(default_factory=dict)  # mis-shaped policy name -> (checkpoint, policy) shapes
    ignored: dict[str, list[str]] = field(default_factory=dict)  # reason -> checkpoint names
    not_carried: list[str] = field(default_factory=list)  # statistics buffers this layout keeps elsewhere
    stats_source: str = ""

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def _mismatch(self, name: str) -> str:
        ckpt, own = self.shapes.get(name, ((), ()))
        return f"{name} (checkpoint {_shape(ckpt)}, policy {_shape(own)})"

    def describe(self, limit: int = SHORT_LIST) -> str:
        """One line: counts and the first names of what does not match."""
        parts = []
        for label, keys in (("missing", self.missing), ("unexpected", self.unexpected)):
            if keys:
                parts.append(f"{len(keys)} {label} keys: {_shown(keys, limit)}")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} shape-mismatched keys: {_shown([self._mismatch(k) for k in self.mismatched], limit)}")
        return "; ".join(parts)

    def summary(self) -> str:
        """The console lines: source, layout, counts, short lists."""
        total = len(self.loaded) + len(self.missing) + len(self.mismatched)
        lines = [f"Pretrained weights: {self.source}" + (f" ({self.resolved})" if self.resolved != self.source else ""),
                 f"  layout: {self.layout.label if self.layout else 'unknown'}",
                 f"  loaded {len(self.loaded)} of {total} tensors"]
        if self.not_carried:
            lines.append(f"  {len(self.not_carried)} statistics buffers are not weights in this layout: set from the statistics below")
        for label, keys in (("missing", self.missing), ("unexpected", self.unexpected)):
            if keys:
                lines.append(f"  {len(keys)} {label}: {_shown(keys)}")
        if self.mismatched:
            lines.append(f"  {len(self.mismatched)} shape-mismatched: {_shown([self._mismatch(k) for k in self.mismatched])}")
        for reason, keys in self.ignored.items():
            lines.append(f"  ignored {len(keys)}: {reason}")
        if self.stats_source:
            lines.append(f"  normalization statistics: {self.stats_source}")
        return "\n".join(lines)

    def full(self) -> str:
        """The summary plus every name, for the run's log."""
        lines = [self.summary(), "  every tensor loaded (policy <- checkpoint):"]
        lines += [f"    {ours} <- {theirs}" for ours, theirs in self.loaded.items()]
        for label, keys in (("missing", self.missing), ("unexpected", self.unexpected), ("not carried", self.not_carried)):
            if keys:
                lines.append(f"  every {label}:")
                lines += [f"    {k}" for k in keys]
        if self.mismatched:
            lines.append("  every shape-mismatched:")
            lines += [f"    {self._mismatch(k)}" for k in self.mismatched]
        for reason, keys in self.ignored.items():
            lines.append(f"  every ignored ({reason}):")
            lines += [f"    {k}" for k in keys]
        return "\n".join(lines)


def _statistics_buffers(policy: torch.nn.Module) -> set[str]:
    """The state_dict entries that are buffers, not parameters: the normalization statistics (and their widths)."""
    params = {name for name, _ in policy.named_parameters()}
    return {name for name in policy.state_dict() if name not in params}


def match(policy: torch.nn.Module, ckpt: Checkpoint) -> LoadReport:
    """Map every checkpoint tensor onto the policy and report, from shapes only. Refuses a pi0 checkpoint for a
    pi05 policy (and the reverse) whatever pretrained_strict says: such weights would load and mean nothing."""
    layout = ckpt.layout
    if layout.policy_type != policy.cfg.type:
        raise UserError(f"{ckpt.source} is a {layout.label} checkpoint but policy.type={policy.cfg.type}: set "
                        f"--policy.type={layout.policy_type} (its weights mean something else in a {policy.cfg.type} policy).")
    own = {name: tuple(t.shape) for name, t in policy.state_dict().items()}
    # A ZeRO-3 partitioned parameter is an empty shard; its full shape is ds_shape.
    own.update({name: tuple(p.ds_shape) for name, p in policy.named_parameters() if hasattr(p, "ds_shape")})
    stats = set() if layout.name == NATIVE else _statistics_buffers(policy)
    report = LoadReport(source=ckpt.source, resolved=str(ckpt.path), layout=layout)
    plan: dict[str, str] = {}
    for key in sorted(ckpt.shapes):
        name = our_name(key, layout)
        reason = ignored_reason(key, name)
        if reason:
            report.ignored.setdefault(reason, []).append(key)
        elif name not in own:
            report.unexpected.append(key)
        elif name in plan:
            # The tied token embedding: a layout with both keeps embed_tokens and lm_head equal; use embed_tokens.
            plan[name], tied = sorted((plan[name], key), key=lambda k: k.endswith("lm_head.weight"))
            report.ignored.setdefault(f"tied copy of {name}", []).append(tied)
        else:
            plan[name] = key
    for name, shape in own.items():
        if name in plan:
            if ckpt.shapes[plan[name]] != shape:
                report.mismatched.append(name)
                report.shapes[name] = (ckpt.shapes[plan[name]], shape)
            else:
                report.loaded[name] = plan[name]
        elif name in stats:
            report.not_carried.append(name)
        else:
            report.missing.append(name)
    return report


def refuse_unless_clean(report: LoadReport, ckpt: Checkpoint, preset: str) -> None:
    if report.clean:
        return
    hint = ""
    guess = guess_preset(ckpt)
    if report.mismatched and guess and guess != preset:
        hint = f" It looks like a {guess} checkpoint: set --policy.preset={guess}."
    raise UserError(f"{ckpt.source} does not match the policy ({report.describe()}).{hint} "
                    "Set policy.pretrained_strict=false to load what matches.")


def guess_preset(ckpt: Checkpoint) -> str | None:
    """The preset whose sizes the checkpoint has (widths and layer counts), if any."""
    from opentau_cli.policies.pi05.configuration import PRESETS

    shapes = {our_name(k, ckpt.layout): s for k, s in ckpt.shapes.items()}

    def layers(prefix: str) -> int:
        found = {int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
        return max(found) + 1 if found else 0

    seen = {
        "vision": (shapes.get("vlm.vision_tower.post_layernorm.weight", (0,))[0], layers("vlm.vision_tower.encoder.layers.")),
        "vlm": (shapes.get("vlm.language_model.norm.weight", (0,))[0], layers("vlm.language_model.layers.")),
        "expert": (shapes.get("expert.layers.0.mlp.down_proj.weight", (0,))[0], layers("expert.layers.")),
    }
    for name, sizes in PRESETS.items():
        if all(seen[part] == (sizes[part]["hidden_size"], sizes[part]["num_hidden_layers"]) for part in seen):
            return name
    return None


def _width(feature_stats: dict) -> int:
    return len(next(iter(feature_stats.values())))


def _another_robot(ckpt: Checkpoint, problems: list[str]) -> UserError:
    return UserError(f"{ckpt.source}: {'; '.join(problems)}: it was trained on another robot; set "
                     "policy.pretrained_strict=false to normalize with the dataset's statistics instead.")


def _plan_statistics(ckpt: Checkpoint, report: LoadReport, dataset_stats: dict | None, strict: bool) -> dict | None:
    """The statistics to set after the weights (None: keep what the policy has), and report.stats_source."""
    problems = []
    if ckpt.layout.name == NATIVE:
        report.stats_source = "from the checkpoint (the policy's statistics buffers)"
        for feature in ("state", "action"):
            key = f"{feature}_dim"
            if dataset_stats and key in ckpt.shapes and key in report.loaded:
                width, data_width = int(ckpt.tensor(key).item()), _width(dataset_stats[feature])
                if width != data_width:
                    problems.append(f"the checkpoint's {feature} statistics have {width} dims but the dataset's {feature} has {data_width}")
        if not problems:
            return None
        if strict:
            raise _another_robot(ckpt, problems)
        report.stats_source = f"from the dataset ({'; '.join(problems)})"
        return dataset_stats
    found, where = read_stats(ckpt.layout, ckpt.root, ckpt.shapes, ckpt.tensor)
    if found is None:
        report.stats_source = f"from the dataset ({where})" if dataset_stats else f"none ({where}; the policy keeps its own)"
        return None
    merged, theirs_used, data_used = {}, [], []
    for feature in ("state", "action"):
        theirs, data = found.get(feature), (dataset_stats or {}).get(feature)
        if theirs is None:
            if data:
                merged[feature] = data
                data_used.append(f"{feature} (the checkpoint has none)")
            continue
        if data and _width(theirs) != _width(data):
            problems.append(f"the checkpoint's {feature} statistics ({where}) have {_width(theirs)} dims but the "
                            f"dataset's {feature} has {_width(data)}")
            merged[feature] = data
            data_used.append(f"{feature} ({problems[-1]})")
            continue
        merged[feature] = {**(data or {}), **theirs}
        theirs_used.append(f"{feature} {'/'.join(sorted(theirs))}")
        filled = [k for k in (data or {}) if k not in theirs]
        if filled:
            data_used.append(f"{feature} {'/'.join(filled)}")
    if problems and strict:
        raise _another_robot(ckpt, problems)
    parts = [f"from the checkpoint ({where}): {', '.join(theirs_used)}"] if theirs_used else []
    report.stats_source = "; ".join(parts + ([f"from the dataset: {', '.join(data_used)}"] if data_used else []))
    return merged if {"state", "action"} <= set(merged) else None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _copy(policy: torch.nn.Module, ckpt: Checkpoint, loaded: dict[str, str], partitioned: bool) -> None:
    """Copy the checkpoint's tensors into the policy, one at a time. Partitioned (ZeRO-3): each parameter is gathered
    alone, rank 0 fills it from the file and DeepSpeed re-partitions it, so no rank holds more than one full parameter
    beyond its shard; buffers are not partitioned and every rank fills its own. A parameter on the meta device
    (build_policy(empty=True)) gets its storage here, read from the file into it."""
    params = dict(policy.named_parameters())
    targets = {**dict(policy.named_buffers()), **params}
    rank = _rank()
    with torch.no_grad():
        for name, key in loaded.items():
            if partitioned and name in params:
                import deepspeed

                with deepspeed.zero.GatheredParameters([params[name]], modifier_rank=0):
                    if rank == 0:
                        params[name].copy_(ckpt.tensor(key))
            elif targets[name].is_meta:
                param = targets[name]
                value = torch.empty(param.shape, dtype=param.dtype)
                ckpt.read_into(key, value)
                # In place: the module (and anything sharing the parameter) keeps the same object, now with storage.
                torch.utils.swap_tensors(param, torch.nn.Parameter(value, requires_grad=param.requires_grad))
            else:
                targets[name].copy_(ckpt.tensor(key))


def _load_matched(policy: torch.nn.Module, ckpt: Checkpoint, report: LoadReport, strict: bool,
                  dataset_stats: dict | None, partitioned: bool) -> None:
    if strict:
        refuse_unless_clean(report, ckpt, policy.cfg.preset)
    stats = _plan_statistics(ckpt, report, dataset_stats, strict)
    _copy(policy, ckpt, report.loaded, partitioned)
    if stats is not None:
        policy.set_stats(stats)


def load_pretrained(policy: torch.nn.Module, source: str | Path, strict: bool = True, *,
                    dataset_stats: dict | None = None, partitioned: bool = False) -> LoadReport:
    """Load `source` (a file, a directory or a Hugging Face repo id) into `policy` and return the report.

    Strict: any missing / unexpected / mis-shaped tensor, or statistics of another width than the dataset's, is a
    UserError naming them, raised before anything is loaded. Not strict: loads what matches (the dataset's
    statistics where the checkpoint's do not fit) and the report says what was left out. `partitioned`: the policy
    was built under ZeRO-3 (call it on every rank).
    """
    with Checkpoint(source) as ckpt:
        report = match(policy, ckpt)
        _load_matched(policy, ckpt, report, strict, dataset_stats, partitioned)
    return report


def build_pretrained(policy_cfg, stats: dict | None = None, *, dataset_stats: dict | None = None,
                     rng_draws: bool = True) -> tuple[torch.nn.Module, LoadReport]:
    """The policy started from `policy_cfg.pretrained_path` (strict per `policy_cfg.pretrained_strict`), equal in
    every tensor, requires_grad and global RNG state to `build_policy` followed by `load_pretrained`, without the
    random initialization of weights the file replaces: the parameters are built on the meta device and each gets
    its storage as it is read (about one copy of the weights in host RAM). `stats` and `rng_draws` as for
    build_policy (without the draws the RNG state is the one before the call; the tensors are the same).

    A non-strict load that leaves a parameter unfilled (missing or mis-shaped in the file) needs that parameter's
    initial value: the policy is then built as build_policy builds it, from the same RNG state."""
    from opentau_cli.policies.build import build_policy

    rng = torch.get_rng_state()
    policy = build_policy(policy_cfg, stats, empty=True, rng_draws=rng_draws)
    with Checkpoint(policy_cfg.pretrained_path) as ckpt:
        report = match(policy, ckpt)
        if policy_cfg.pretrained_strict:
            refuse_unless_clean(report, ckpt, policy_cfg.preset)
        if any(name not in report.loaded for name, _ in policy.named_parameters()):
            torch.set_rng_state(rng)
            policy = build_policy(policy_cfg, stats)
        _load_matched(policy, ckpt, report, policy_cfg.pretrained_strict, dataset_stats, partitioned=False)
    return policy, report


def check_pretrained(policy_cfg) -> LoadReport:
    """What loading `policy_cfg.pretrained_path` will report, from the checkpoint's headers alone (the policy built on
    the meta device, no weight read): the refusals a load would make (layout, type, strict key match), before any
    process starts."""
    from opentau_cli.policies.build import build_policy

    with torch.device("meta"):
        policy = build_policy(policy_cfg)
    with Checkpoint(policy_cfg.pretrained_path) as ckpt:
        report = match(policy, ckpt)
        if policy_cfg.pretrained_strict:
            refuse_unless_clean(report, ckpt, policy_cfg.preset)
    return report
