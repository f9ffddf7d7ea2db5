"""The config's filesystem paths: resolved where they were given, recorded so that a run directory travels.

docs/ARCHITECTURE.md, "Run history". A relative path on the command line, in the environment or in a config file
the user wrote means the working directory of that command. `train_config.json` in a checkpoint records every such
path absolute, except a path inside the run directory, which it records relative to the run directory: a run copied
or moved elsewhere (rsync to another cluster) resumes there. Checkpoints written before this rule (no `lineage` in
their training_state.json) recorded paths as typed; those stay relative to the working directory.

Pure functions on the config's JSON form; no heavy imports.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_ROOT = "@demo"
# Top-level path fields, by dotted key; mixture members' roots are `dataset.mixture.<i>.root`.
PATH_KEYS = ("output_dir", "dataset.root", "policy.pretrained_path", "policy.tokenizer_path")
# Fields that may also hold a Hugging Face repo id (org/name[@revision]) instead of a path.
REPO_ID_KEYS = ("policy.pretrained_path", "policy.tokenizer_path")
# store/layout.py's names (config/ imports no other opentau package; tests/test_paths.py checks they agree).
CHECKPOINTS, TRAINING_STATE, LINEAGE = "checkpoints", "training_state.json", "lineage"


def is_path_key(key: str) -> bool:
    parts = key.split(".")
    return key in PATH_KEYS or (len(parts) == 4 and parts[:2] == ["dataset", "mixture"] and parts[2].isdigit()
                                and parts[3] == "root")


def looks_like_url(text: str) -> bool:
    """`scheme://...` (a dataset in object storage): not a path of this machine."""
    scheme, sep, _ = str(text).partition("://")
    return bool(sep) and scheme[:1].isalpha() and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


def looks_like_repo_id(text: str) -> bool:
    """`org/name` or `org/name@rev`: one slash, no leading dot or slash."""
    name = text.split("@", 1)[0]
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and all(name.split("/"))


def resolve_value(key: str, value, base: Path):
    """`value` of the path field `key`, made absolute against `base` (left alone: None, the demo, a repo id that is
    not an existing local path, an absolute path)."""
    if value is None or not isinstance(value, (str, os.PathLike)):
        return value
    text = os.fspath(value)
    if not text or text == DEMO_ROOT or looks_like_url(text):
        return value
    path = Path(text).expanduser()
    if path.is_absolute():
        return str(path)
    local = base / path
    if key in REPO_ID_KEYS and looks_like_repo_id(text) and not local.exists():
        return value
    return os.path.normpath(local)


def _fields(data: dict):
    """(dotted key, container, field name) of every path field present in a config dict."""
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            yield key, node, leaf
    mixture = (data.get("dataset") or {}).get("mixture") if isinstance(data.get("dataset"), dict) else None
    for i, member in enumerate(mixture or []):
        if isinstance(member, dict) and "root" in member:
            yield f"dataset.mixture.{i}.root", member, "root"


def resolve_paths(data: dict, base: Path) -> dict:
    """Make every relative path field of a config dict absolute against `base`, in place; returns it."""
    base = Path(base).absolute()
    for key, node, leaf in _fields(data):
        node[leaf] = resolve_value(key, node[leaf], base)
    return data


def record_paths(data: dict, run_dir: Path) -> dict:
    """A copy of a resolved config dict for a checkpoint: paths inside `run_dir` relative to it (`.` for the run
    itself), every other path as it is (absolute)."""
    import copy

    out = copy.deepcopy(data)
    run_dir = Path(os.path.abspath(run_dir))
    for _key, node, leaf in _fields(out):
        value = node[leaf]
        if not isinstance(value, str) or not os.path.isabs(value):
            continue
        try:
            rel = Path(os.path.abspath(value)).relative_to(run_dir)
        except ValueError:
            continue
        node[leaf] = rel.as_posix() if rel.parts else "."
    return out


def missing_paths(data: dict, *, origin: Path, overridden: set[str], lora: bool) -> list[str]:
    """One line per path field of a resumed config that does not exist here (those the command line gave are the
    launch checks' business), naming the field, the recorded path, where it came from and the override that fixes
    it. `pretrained_path` is read on resume only by a LoRA run (its frozen base)."""
    problems = []
    for key, node, leaf in _fields(data):
        value = node[leaf]
        if key in overridden or key == "output_dir" or value in (None, "", DEMO_ROOT):
            continue
        if key == "policy.pretrained_path" and not lora:
            continue
        text = os.fspath(value)
        if key in REPO_ID_KEYS and not os.path.isabs(text) and looks_like_repo_id(text) or looks_like_url(text):
            continue
        if Path(text).exists():
            continue
        problems.append(
            f"{key} '{text}' (recorded in {origin}) does not exist on this machine: the run or the data moved? "
            f"Pass --{key}=WHERE_IT_IS_NOW."
        )
    return problems


def paths_base(config_file: Path) -> Path:
    """What a config file's relative paths are relative to: the run directory for a checkpoint's train_config.json
    written with lineage (recorded by `record_paths`), else the working directory (a file the user wrote, or an
    older checkpoint's config, which recorded paths as typed)."""
    import json

    folder = Path(config_file).absolute().parent
    try:
        state = json.loads((folder / TRAINING_STATE).read_text())
    except (OSError, ValueError):
        return Path.cwd()
    if not isinstance(state, dict) or (LINEAGE not in state and int(state.get("format_version") or 1) < 2):
        return Path.cwd()
    return folder.parent.parent if folder.parent.name == CHECKPOINTS else folder.parent
