"""What a local dataset looked like when a run read it, so that a resume notices when its files changed under the same
root (docs/ARCHITECTURE.md, "Datasets on the Hugging Face Hub" pins a Hub dataset by commit; this is the local
analogue).

A fingerprint is cheap to take on any size of dataset: the xxh3 of every file under `meta/` (small: info, statistics,
episodes, tasks) and the number and total size of the data and video files. It survives copying or moving the
dataset (no paths or times in it); a rewrite changes the meta files or the files' sizes.
"""

from __future__ import annotations

import os
from pathlib import Path

from opentau_cli.config.model import DEMO_DATASET, MixtureMember
from opentau_cli.errors import UserError

FINGERPRINTS = "dataset_fingerprints"  # training_state.json: {member label: fingerprint}
CHANGED_FLAG = "--dataset-changed=true"


def fingerprint(root: Path) -> dict:
    """{"meta": xxh3 of meta/'s files (names and bytes), "files": data and video files, "bytes": their total size}."""
    import xxhash

    root = Path(root)
    meta = xxhash.xxh3_128()
    files = size = 0
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        rel = Path(dirpath).relative_to(root)
        for name in sorted(names):
            path = Path(dirpath, name)
            if rel.parts[:1] == ("meta",):
                meta.update(f"{(rel / name).as_posix()}\0".encode())
                meta.update(path.read_bytes())
            elif rel.parts[:1] in (("data",), ("videos",)):
                files += 1
                size += path.stat().st_size
    return {"meta": meta.hexdigest(), "files": files, "bytes": size}


def fingerprints(members: list[MixtureMember], roots: list[Path]) -> dict[str, dict]:
    """What training_state.json records of the local datasets a run reads (the demo, made by opentau from its
    config, and Hub datasets, pinned by commit, have none)."""
    return {m.label: fingerprint(root) for m, root in zip(members, roots)
            if not m.repo_id and (m.root or DEMO_DATASET) != DEMO_DATASET and Path(root).is_dir()}


def check_unchanged(ckpt: Path, members: list[MixtureMember], recorded: dict, accept: bool) -> list[str]:
    """Refuse (UserError) a resume whose local datasets changed since `ckpt` recorded them, unless `accept`
    (--dataset-changed=true); returns the lines that say what was accepted."""
    notes, changed = [], []
    for member in members:
        was = recorded.get(member.label)
        root = Path(member.root or "")
        if not was or member.repo_id or not root.is_dir():
            continue
        now = fingerprint(root)
        if now == was:
            continue
        what = []
        if now["meta"] != was["meta"]:
            what.append("its meta/ files differ")
        if (now["files"], now["bytes"]) != (was["files"], was["bytes"]):
            what.append(f"its data and video files are {now['files']} files of {now['bytes']:,} bytes, were "
                        f"{was['files']} of {was['bytes']:,}")
        line = f"{root} changed since checkpoint {Path(ckpt).name} was saved ({'; '.join(what)})"
        (notes if accept else changed).append(line)
    if changed:
        raise UserError(f"{'; '.join(changed)}: resuming would continue the data order over other data. Restore the "
                        f"dataset, start a new run from the checkpoint's weights with --policy.pretrained_path, or pass "
                        f"{CHANGED_FLAG} to resume on the dataset as it is now.")
    return [f"{line}; resuming on it as it is now ({CHANGED_FLAG})." for line in notes]
