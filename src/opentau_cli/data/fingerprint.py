"""What a local dataset looked like when a run read it, so that a resume notices when its files changed under the same
root (docs/ARCHITECTURE.md, "Datasets on the Hugging Face Hub" pins a Hub dataset by commit; this is the local
analogue).

A fingerprint is cheap to take on any size of dataset: the xxh3 of every file under `meta/` (small: info, statistics,
episodes, tasks) and the number and total size of the data and video files. It survives copying or moving the
dataset (no paths or times in it); a rewrite changes the meta files or the files' sizes.

A dataset in object storage (data/remote.py) has the same fingerprint, taken from its cached meta/ and the store's
listing (the same three values as for a copy on disk), plus its URL and `versions`: the store's ETag, time and size
of every file the run reads, which a rewrite of any of them changes whatever its size.
"""

from __future__ import annotations

import os
from pathlib import Path

from opentau_cli.config.model import DEMO_DATASET, DatasetConfig, MixtureMember
from opentau_cli.errors import UserError
from opentau_cli.store.storage import is_url

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


def remote_fingerprint(files) -> dict:
    """The fingerprint of a dataset in object storage as a run reads it (data/remote.py RemoteFiles)."""
    return {**fingerprint(files.root), **files.store_totals, "url": files.url,
            "versions": {rel: dict(pin) for rel, pin in sorted(files.pins.items())}}


def fingerprints(members: list[MixtureMember], roots: list[Path], sources: list | None = None) -> dict[str, dict]:
    """What training_state.json records of the local datasets a run reads and of those in object storage (`sources`:
    how each member's files are reached, data/remote.py); the demo, made by opentau from its config, and Hub
    datasets, pinned by commit, have none."""
    out = {}
    for m, root, files in zip(members, roots, sources or [None] * len(members)):
        if getattr(files, "url", None):
            out[m.label] = remote_fingerprint(files)
        elif not m.repo_id and (m.root or DEMO_DATASET) != DEMO_DATASET and Path(root).is_dir():
            out[m.label] = fingerprint(root)
    return out


def _changed_versions(now: dict, was: dict) -> list[str]:
    """The files a run read whose version in the store differs from the recorded one (a file gone from the store
    changes the store's count of files)."""
    recorded, current = was.get("versions") or {}, now.get("versions") or {}
    return [rel for rel, pin in recorded.items() if rel in current and current[rel].get("etag") != pin.get("etag")]


def check_unchanged(ckpt: Path, members: list[MixtureMember], recorded: dict, accept: bool,
                    dataset: DatasetConfig | None = None) -> list[str]:
    """Refuse (UserError) a resume whose local datasets, or datasets in object storage, changed since `ckpt` recorded
    them, unless `accept` (--dataset-changed=true); returns the lines that say what was accepted. `dataset`: the
    checked config's, whose launch check pinned the versions in the store now (data/remote.py)."""
    notes, changed = [], []
    for member in members:
        was = recorded.get(member.label)
        if not was or member.repo_id:
            continue
        if is_url(member.root or ""):
            from opentau_cli.data.remote import open_files

            where, now = member.root, remote_fingerprint(open_files(member, dataset or DatasetConfig()))
            versions = _changed_versions(now, was)
        else:
            where = root = Path(member.root or "")
            if not root.is_dir():
                continue
            now, versions = fingerprint(root), []
        if all(now.get(k) == was.get(k) for k in ("meta", "files", "bytes")) and not versions:
            continue
        what = []
        if now["meta"] != was["meta"]:
            what.append("its meta/ files differ")
        if (now["files"], now["bytes"]) != (was["files"], was["bytes"]):
            what.append(f"its data and video files are {now['files']} files of {now['bytes']:,} bytes, were "
                        f"{was['files']} of {was['bytes']:,}")
        if versions:
            shown = ", ".join(versions[:3]) + (f" and {len(versions) - 3} more" if len(versions) > 3 else "")
            what.append(f"{len(versions)} of the files it read {'has' if len(versions) == 1 else 'have'} another "
                        f"version in the store ({shown})")
        line = f"{where} changed since checkpoint {Path(ckpt).name} was saved ({'; '.join(what)})"
        (notes if accept else changed).append(line)
    if changed:
        raise UserError(f"{'; '.join(changed)}: resuming would continue the data order over other data. Restore the "
                        f"dataset, start a new run from the checkpoint's weights with --policy.pretrained_path, or pass "
                        f"{CHANGED_FLAG} to resume on the dataset as it is now.")
    return [f"{line}; resuming on it as it is now ({CHANGED_FLAG})." for line in notes]
