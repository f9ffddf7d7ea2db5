"""The manifest of a checkpoint: size and xxhash of every file, written last, checked before anything is loaded.

`manifest.json` = {"version": 1, "format_version": F, "opentau_version": "X.Y.Z", "hash": "xxh3_128",
"files": {"<relative/posix/path>": {"size": N, "hash": "<hex>"}}, "world_size": W, "rank_files": {"<rank>": [paths]}}.
"version" is the manifest's own layout; "format_version" the checkpoint's (store/format.py; absent before
format 2), "opentau_version" the release that wrote it. The manifest itself is not listed. A directory is a complete
checkpoint only if its manifest vouches for exactly the files present and those hold every rank's own state (what
training_state.json's world size and backend call for), so neither a half-written save nor one that missed a rank
(a machine that wrote elsewhere) ever passes as a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import xxhash

from opentau_cli.store.faults import fault_point
from opentau_cli.store.format import FIELD as FORMAT_FIELD, FORMAT_VERSION
from opentau_cli.store.layout import (
    DS_SHARD_RE, DS_TAG, EMA_STATE, EMA_WEIGHTS, MANIFEST, TRAINING_STATE, ema_rank_file, rank_state_file,
)
from opentau_cli.store.outputs import file_mode, follow_umask, pid_alive

HASH_NAME = "xxh3_128"
_CHUNK = 8 * 1024 * 1024
_TEMP_SUFFIX = ".tmp"  # of write_json_atomic's temp files
# A file's hidden siblings at the top of a checkpoint: `.<name>.tmp-<pid>` (a file being written, e.g. by
# safetensors_writer), `.<name>.old-<pid>` (a file being replaced) and write_json_atomic's `.<name>.<random>.tmp`.
# They are never checkpoint content: a writer killed before its rename leaves one (docs/ARCHITECTURE.md,
# "Checkpoint contract").
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)$")
_JSON_TEMP = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]+\.tmp$")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint directory: kind is missing | extra | truncated | altered."""

    kind: str
    path: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.path}" + (f" ({self.detail})" if self.detail else "")


class MissingRankState(Exception):
    """A save lacks some rank's own files: it must not be published."""


def rank_layout(ckpt_dir: Path) -> tuple[int, int | None, bool] | None:
    """(world size, ZeRO stage or None, whether it holds an EMA) from the checkpoint's training_state.json; None when
    it does not say."""
    try:
        state = json.loads((Path(ckpt_dir) / TRAINING_STATE).read_text())
    except (OSError, ValueError):
        return None
    world = state.get("world_size") if isinstance(state, dict) else None
    if not isinstance(world, int) or world < 1:
        return None
    # An FSDP2 EMA lies in the DCP shards with the model's (store/dcp.py), not in a file of its own.
    ema = bool(state.get(EMA_STATE)) and state.get("backend") != "fsdp"
    return world, (state.get("zero_stage") if state.get("backend") == "deepspeed" else None), ema


def rank_files(files, world_size: int, zero_stage: int | None, ema: bool = False
               ) -> tuple[dict[str, list[str]], list[tuple[int, str]]]:
    """Each rank's own files among `files` (relative posix paths), and (rank, what) for each one a rank lacks: every
    rank writes its RNG state; under DeepSpeed ZeRO-1/2/3 its optimizer shard, under ZeRO-3 its parameter shard too.
    With an EMA (train/ema.py) every DeepSpeed rank writes its own, and single / DDP rank 0 the whole one."""
    found: dict[str, list[str]] = {str(r): [] for r in range(world_size)}
    kinds: dict[int, set[str]] = {r: set() for r in range(world_size)}
    states = {rank_state_file(r): r for r in range(world_size)}
    emas = ({ema_rank_file(r): r for r in range(world_size)} if zero_stage else {EMA_WEIGHTS: 0}) if ema else {}
    states.update(emas)
    for rel in sorted(files):
        name = rel.rsplit("/", 1)[-1]
        shard = DS_SHARD_RE.search(name) if rel.startswith(f"{DS_TAG}/") else None
        if shard and int(shard.group(1)) < world_size:
            rank, kind = int(shard.group(1)), f"DeepSpeed {shard.group(3)} shard"
        elif rel in states:
            rank, kind = states[rel], rel
        else:
            continue
        found[str(rank)].append(rel)
        kinds[rank].add(kind)
    needed = ["DeepSpeed optim shard"] if zero_stage else []
    needed += ["DeepSpeed model shard"] if zero_stage == 3 else []
    missing = [(r, what) for r in range(world_size) for what in [rank_state_file(r), *needed] if what not in kinds[r]]
    missing += [(r, name) for name, r in emas.items() if name not in kinds[r]]
    return found, missing


def hash_file(path: Path, *, fsync: bool = False) -> str:
    """xxh3-128 of the file; fsync=True also forces its data to disk (it is being read anyway)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _temp_prefix(name: str) -> str:
    return f".{name}."


def sibling_of(name: str) -> str | None:
    """The file name a hidden sibling (a temp or old copy, see above) stands for; None for any other name."""
    found = _SIBLING.match(name) or _JSON_TEMP.match(name)
    return found.group("name") if found else None


def sibling_pid(name: str) -> int | None:
    """The process that made a `.<name>.tmp-<pid>` / `.<name>.old-<pid>` sibling."""
    found = _SIBLING.match(name)
    return int(found.group("pid")) if found else None


def temp_sibling(path: Path) -> Path:
    """Where this process writes `path` before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def old_sibling(path: Path) -> Path:
    """Where this process puts `path` aside while it is being replaced."""
    return path.with_name(f".{path.name}.old-{os.getpid()}")


def _is_manifest_name(name: str) -> bool:
    # Temp files of an interrupted manifest write are ours too, not checkpoint content; so are the hidden siblings
    # of a writer killed before its rename (put_back, clean_siblings).
    return name == MANIFEST or sibling_of(name) is not None


def list_files(ckpt_dir: Path) -> list[str]:
    """Relative posix paths of every regular file under ckpt_dir (symlinks to files count), manifest excluded."""
    ckpt_dir = Path(ckpt_dir)
    out = []
    for root, dirs, files in os.walk(ckpt_dir):
        dirs.sort()
        for name in sorted(files):
            rel = Path(root, name).relative_to(ckpt_dir).as_posix()
            if root == str(ckpt_dir) and _is_manifest_name(name):
                continue
            out.append(rel)
    return out


def write_json_atomic(path: Path, data: dict) -> Path:
    """Write JSON via a temp file in the same directory, fsync, then rename (readers never see half a file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path.name), suffix=_TEMP_SUFFIX)
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; the published file gets the usual mode
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        fault_point("json_synced", path)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_manifest(ckpt_dir: Path, *, fsync: bool = False, hashed: dict[str, tuple[int, str]] | None = None) -> Path:
    """Hash every file of ckpt_dir and write ckpt_dir/manifest.json atomically; call it after everything else is written.

    fsync=True makes every listed file durable before the manifest vouches for it, so a power loss after publishing
    cannot leave a checkpoint whose manifest is complete but whose data never reached the disk. Raises
    MissingRankState (nothing written) when training_state.json names a world size whose ranks are not all there.
    `hashed`: files their writer hashed as it wrote them (and synced, where fsync is asked), relative path -> (size,
    hash); those are not read again while they have that size.
    """
    ckpt_dir = Path(ckpt_dir)
    record = manifest_record(hash_files(ckpt_dir, fsync=fsync, hashed=hashed), rank_layout(ckpt_dir), ckpt_dir)
    return write_json_atomic(ckpt_dir / MANIFEST, record)


def hash_files(ckpt_dir: Path, *, fsync: bool = False, hashed: dict[str, tuple[int, str]] | None = None) -> dict:
    """{relative path: {"size", "hash"}} of every file of ckpt_dir (the manifest's entries; see write_manifest)."""
    ckpt_dir = Path(ckpt_dir)
    follow_umask(ckpt_dir)  # Accelerate's model.safetensors comes from safetensors' save_file: 0600 otherwise
    files = {}
    for rel in list_files(ckpt_dir):
        p = ckpt_dir / rel
        size, known = p.stat().st_size, (hashed or {}).get(rel)
        files[rel] = {"size": size, "hash": known[1] if known and known[0] == size else hash_file(p, fsync=fsync)}
    return files


def manifest_record(files: dict, layout: tuple[int, int | None, bool] | None, where: Path) -> dict:
    """The manifest of a checkpoint holding `files` ({relative path: {"size", "hash"}}, from every machine that wrote
    a part of it), whose training state says `layout` (rank_layout). Raises MissingRankState when a rank's own
    files are not among them."""
    from opentau_cli import __version__

    manifest: dict = {"version": 1, FORMAT_FIELD: FORMAT_VERSION, "opentau_version": __version__, "hash": HASH_NAME}
    if layout is not None:
        found, missing = rank_files(files, *layout)
        if missing:
            shown = ", ".join(f"rank {r}'s {what}" for r, what in missing[:4]) + (" and more" if len(missing) > 4 else "")
            raise MissingRankState(
                f"{shown} missing from {where} (every machine of a run must write to the same output_dir, on a "
                "filesystem they share, or keep its part and upload it with checkpoint.remote)"
            )
        manifest.update(world_size=layout[0], rank_files=found)
    return {**manifest, "files": dict(sorted(files.items()))}


def read_manifest(ckpt_dir: Path) -> dict | None:
    """The parsed manifest, or None when it is absent or unreadable."""
    try:
        data = json.loads((Path(ckpt_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or data.get("hash") != HASH_NAME:
        return None
    return data


def verify_manifest(ckpt_dir: Path, *, rehash: bool = True) -> list[Problem]:
    """Everything wrong with ckpt_dir against its manifest (empty list = sound).

    rehash=False checks presence and sizes only (cheap: for listing and picking a checkpoint); True also re-hashes.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return [Problem("missing", str(ckpt_dir), "not a directory")]
    manifest_path = ckpt_dir / MANIFEST
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        why = "unreadable or not an opentau manifest" if manifest_path.exists() else "no manifest: the save never finished"
        return [Problem("missing" if not manifest_path.exists() else "altered", MANIFEST, why)]
    expected: dict = manifest["files"]
    put_back(ckpt_dir, expected)
    present = set(list_files(ckpt_dir))
    problems = []
    for rel in sorted(expected):
        entry = expected[rel]
        p = ckpt_dir / rel
        if rel not in present:
            problems.append(Problem("missing", rel))
            continue
        size = p.stat().st_size
        if size < entry["size"]:
            problems.append(Problem("truncated", rel, f"{size} of {entry['size']} bytes"))
        elif size != entry["size"]:
            problems.append(Problem("altered", rel, f"{size} bytes, expected {entry['size']}"))
        elif rehash and hash_file(p) != entry["hash"]:
            problems.append(Problem("altered", rel, "content hash differs"))
    for rel in sorted(present - set(expected)):
        problems.append(Problem("extra", rel, "not in the manifest"))
    layout = rank_layout(ckpt_dir)
    if layout is not None:  # also catches a manifest written over a save that missed a rank (before this check)
        for rank, what in rank_files(expected, *layout)[1]:
            problems.append(Problem("missing", what, f"rank {rank}'s own state; the run had {layout[0]} ranks"))
    return problems


def put_back(ckpt_dir: Path, expected: dict | None = None) -> list[str]:
    """Finish the rename of a writer killed after the manifest vouched for its file: a file the manifest lists that
    is missing or differs, while a hidden sibling of it holds exactly the listed bytes, gets that sibling renamed into
    place (a consolidation writes, vouches, then renames; replacing a file puts the old one aside first). Any
    command that checks the checkpoint restores it so. Returns the names put back."""
    ckpt_dir = Path(ckpt_dir)
    if expected is None:
        manifest = read_manifest(ckpt_dir)
        expected = manifest["files"] if manifest else {}
    restored = []
    try:
        entries = [e for e in os.scandir(ckpt_dir) if sibling_of(e.name) in expected and e.is_file(follow_symlinks=False)]
    except OSError:
        return restored
    for entry in entries:
        name = sibling_of(entry.name)
        want = expected[name]
        final = ckpt_dir / name
        try:
            if entry.stat().st_size != want["size"] or hash_file(Path(entry.path)) != want["hash"]:
                continue
            if final.is_file() and final.stat().st_size == want["size"] and hash_file(final) == want["hash"]:
                continue  # already in place: the sibling is a leftover its command removes
            os.replace(entry.path, final)
        except OSError:  # read-only, or another process put it back first
            continue
        restored.append(name)
    return restored


def clean_siblings(ckpt_dir: Path, names: set[str] | None = None) -> list[Path]:
    """Remove the hidden siblings at the top of `ckpt_dir` (of the files `names`, default any) that no live process
    is writing: leftovers of a killed writer, after put_back took what the manifest vouches for."""
    ckpt_dir = Path(ckpt_dir)
    put_back(ckpt_dir)
    removed = []
    try:
        entries = list(os.scandir(ckpt_dir))
    except OSError:
        return removed
    for entry in entries:
        name = sibling_of(entry.name)
        if name is None or (names is not None and name not in names) or not entry.is_file(follow_symlinks=False):
            continue
        pid = sibling_pid(entry.name)
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            continue
        try:
            Path(entry.path).unlink(missing_ok=True)
        except OSError:  # a read-only checkpoint: left as it is (it never passes as content)
            continue
        removed.append(Path(entry.path))
    return removed


def is_complete(ckpt_dir: Path) -> bool:
    """True if ckpt_dir has a manifest and exactly the files it lists, at their sizes (no re-hash: cheap)."""
    return not verify_manifest(ckpt_dir, rehash=False)


def add_to_manifest(ckpt_dir: Path, rel_paths: list[str]) -> Path:
    """Vouch for files added after the save (e.g. a consolidated model.safetensors) without re-hashing the rest."""
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        raise FileNotFoundError(f"{ckpt_dir / MANIFEST} is missing or unreadable")
    for rel in rel_paths:
        p = ckpt_dir / rel
        manifest["files"][Path(rel).as_posix()] = {"size": p.stat().st_size, "hash": hash_file(p)}
    return write_json_atomic(ckpt_dir / MANIFEST, manifest)


def remove_from_manifest(ckpt_dir: Path, rel_paths: list[str]) -> None:
    """Forget files deliberately removed (e.g. an old consolidated output replaced with --force)."""
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        return
    for rel in rel_paths:
        manifest["files"].pop(Path(rel).as_posix(), None)
    write_json_atomic(ckpt_dir / MANIFEST, manifest)
