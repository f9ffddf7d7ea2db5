"""Where a command writes what the user asked for: one convention for `checkpoint export --output`,
`checkpoint consolidate --output`, `eval --output` and `dataset synth OUT` (docs/ARCHITECTURE.md, "Outputs").

- An output never overlaps a run: a target that is, lies inside or contains a run directory, a `checkpoints/`
  folder or a checkpoint (read from disk: store/layout.py `run_part`), or that is, lies inside or contains the
  source the command reads, is refused (one sentence, exit 2), with or without `--force`.
- Missing parent directories are created.
- An existing target that is not an empty directory is refused; `--force` replaces only an earlier output of the
  same command: a directory `publishing` wrote carries a marker (`.opentau-output.json`, naming the command), a
  safetensors file the producer opentau records in its header. Anything else stays refused, `--force` or not.
- The result is written into a hidden temporary sibling (`.<name>.tmp-<pid>`) and renamed into place, so the target
  is only ever absent, the old one, or complete; `--force` replaces the old target only once the new one is complete.
- Files get the mode `open()` gives them under the umask (`follow_umask`): some writers (safetensors' `save_file`)
  create their files 0600 through a private temp file, which would leave a model unreadable to the team.

Imports nothing heavy.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from opentau_cli.errors import UserError
from opentau_cli.store.faults import fault_point
from opentau_cli.store.layout import run_part

MARKER = ".opentau-output.json"  # in every directory `publishing` writes: {"command": ..., "source": ...}
_WALK_LIMIT = 10_000  # directories looked at for a run inside an existing target (beyond: refused as not ours anyway)


def check_target(target: Path, *, force: bool, source: Path | str | None = None, command: str | None = None) -> None:
    """Refuse, before any work, a target that overlaps a run or `source` (the run, checkpoint or model the command
    reads: check_overlap), and one that exists and is not an empty directory unless `force` and it is an earlier
    output of `command` (e.g. "checkpoint export"; None: of any opentau command)."""
    target = Path(target)
    check_overlap(target, source)
    remove_leftovers(target)
    if not (target.exists() or target.is_symlink()):
        return
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        return
    ours = written_by(target, command)
    name = f"`opentau {command}`" if command else "opentau"
    if not force:
        also = f", or pass --force to replace this earlier output of {name}" if ours else ""
        raise UserError(f"{target} already exists and is not empty: choose a new path{also}.")
    if not ours:
        raise UserError(f"{target} already exists and was not written by {name}: --force replaces only an earlier "
                        f"output of the same command; choose a new path.")


def check_overlap(target: Path, source: Path | str | None = None) -> None:
    """Refuse a target that is, lies inside or contains a run, its `checkpoints/` folder or a checkpoint (the `last`
    / `best` links included), or that is, lies inside or contains `source`."""
    target = Path(target)
    forms = _forms(target)
    for form in forms:
        for at in (form, *form.parents):
            what = run_part(at)
            if what is not None:
                where = "is" if at == form else "lies inside"
                raise UserError(f"{target} {where} {what} {at}: an output never goes into a run or its checkpoints; "
                                f"choose a path outside it.")
    inside = _run_inside(target)
    if inside is not None:
        raise UserError(f"{target} contains {inside[0]} {inside[1]}: an output never replaces a run or its "
                        f"checkpoints; choose a new path.")
    if source is not None and Path(source).exists():
        for src in _forms(Path(source)):
            for form in forms:
                if form == src or src in form.parents or form in src.parents:
                    raise UserError(f"{target} overlaps {source}, which this command reads: choose an output path "
                                    f"outside it.")


def written_by(target: Path, command: str | None = None) -> bool:
    """Whether `target` is an earlier output of `command` (None: of any opentau command): a directory with the marker
    `publishing` writes, a safetensors file (or a sharded one's index) whose header names the opentau producer."""
    target = Path(target)
    if target.is_symlink():
        return False
    if target.is_dir():
        try:
            recorded = json.loads((target / MARKER).read_text()).get("command")
        except (OSError, ValueError, AttributeError):
            return False
        return command is None or recorded == command
    if target.name.endswith(".index.json"):  # a sharded safetensors output: its shards say who wrote them
        try:
            shards = sorted(set(json.loads(target.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return bool(shards) and all(written_by(target.with_name(Path(s).name), command) for s in shards)
    producer = _safetensors_producer(target)
    if producer is None or not producer.startswith("opentau "):
        return False
    return command is None or producer == f"opentau {command}"


def _safetensors_producer(path: Path) -> str | None:
    """The `producer` a safetensors file records in its header's metadata (read by hand: 8-byte length, JSON)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    producer = meta.get("producer") if isinstance(meta, dict) else None
    return producer if isinstance(producer, str) else None


def _forms(path: Path) -> list[Path]:
    """The path as given (made absolute) and with its symlinks resolved: a link into a run is refused as the run."""
    plain = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    return [plain] if plain == real else [plain, real]


def _run_inside(target: Path) -> tuple[str, Path] | None:
    """(what, where) of the first run, checkpoints folder or checkpoint inside the directory `target`; links are not
    followed (replacing the target removes a link, never what it points at)."""
    if not target.is_dir() or target.is_symlink():
        return None
    seen = 0
    for root, dirs, _ in os.walk(target):
        for d in dirs:
            what = run_part(Path(root, d)) if not Path(root, d).is_symlink() else None
            if what is not None:
                return what, Path(root, d)
        seen += len(dirs)
        if seen > _WALK_LIMIT:
            return None
    return None


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    return path


def writable_parent(target: Path) -> Path:
    """The directory the target's temporary sibling will be written in (or its nearest existing ancestor, when the
    parents are still to be made), checked for write access; for free-space checks."""
    target = Path(target)
    where = _nearest_existing(target.parent)
    if not where.is_dir():
        raise UserError(f"{target}: {where} is not a directory.")
    if not os.access(where, os.W_OK | os.X_OK):
        raise UserError(f"{target}: {where} is not writable.")
    return where


@contextmanager
def publishing(target: Path, *, force: bool, source: Path | str | None = None,
               command: str | None = None, recorded: str | None = None) -> Iterator[Path]:
    """Yield a hidden temporary sibling path of `target` (the caller makes it a directory or a file); when the block
    succeeds, mark a directory as `command`'s output (MARKER, naming `recorded` as its source, by default `source`: a
    cached copy of a remote checkpoint is named by its URL) and rename it into place (replacing an empty
    directory, or with `force` an earlier output of `command`, which is removed only after the new one is in place);
    when it fails, remove it and the parent directories this call made. Refuses what check_target refuses."""
    target = Path(target)
    check_target(target, force=force, source=source, command=command)
    made = make_parents(target.parent)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    _remove(staging)
    try:
        yield staging
        if staging.is_dir() and not staging.is_symlink():
            named = recorded if recorded is not None else None if source is None else str(source)
            (staging / MARKER).write_text(json.dumps({"command": command, "source": named}) + "\n")
        follow_umask(staging)
        fault_point("output_staged", target)
        old = None
        if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            target.rmdir()
        elif target.exists() or target.is_symlink():
            check_target(target, force=force, source=source, command=command)  # appeared while we worked
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            _remove(old)
            os.replace(target, old)
        try:
            os.replace(staging, target)
        except BaseException:
            if old is not None:
                os.replace(old, target)  # the old target back in its place: nothing lost
            raise
        if old is not None:
            _remove(old)
    except BaseException:
        _remove(staging)
        remove_made(made)
        raise


def remove_leftovers(target: Path) -> list[Path]:
    """What a killed run of a command left beside `target`: its hidden sibling (`.<name>.tmp-<pid>`, being written) and,
    with --force, the earlier output it set aside (`.<name>.old-<pid>`), of processes that are gone. An earlier
    output set aside whose replacement never arrived is put back first: nothing the user had is lost."""
    target = Path(target)
    parent = target.parent
    if not parent.is_dir():
        return []
    found = []
    for kind in ("tmp", "old"):
        for path in parent.glob(f".{_glob_escape(target.name)}.{kind}-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                found.append((kind, path))
    removed = []
    for kind, path in found:
        if kind == "old" and not (target.exists() or target.is_symlink()):
            os.replace(path, target)
            continue
        _remove(path)
        removed.append(path)
    return removed


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_parents(parent: Path) -> list[Path]:
    """Create `parent` and its missing ancestors; returns those it created, outermost first."""
    missing = []
    p = Path(parent)
    while not p.exists():
        missing.append(p)
        p = p.parent
    try:
        Path(parent).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the directory {parent} ({e.strerror or e}).") from None
    return list(reversed(missing))


def remove_made(made: list[Path]) -> None:
    """Undo make_parents after a failure: remove the directories it made, innermost first, while they are empty."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            break


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def umask() -> int:
    """The process umask, read without changing it (os.umask can only be read by setting it, which races threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode `open()` gives a new file: 0o666 less the umask."""
    return 0o666 & ~umask()


def follow_umask(path: Path) -> None:
    """Give every regular file under `path` (or `path` itself) at least the mode `open()` would have given it; bits
    a file has beyond that (an executable script's) are kept. A file this process may not chmod is left as it is."""
    path = Path(path)
    wanted = file_mode()
    files = [path] if path.is_file() else [Path(root, n) for root, _, names in os.walk(path) for n in names]
    for f in files:
        try:
            st = f.lstat()
            if stat.S_ISREG(st.st_mode) and (stat.S_IMODE(st.st_mode) | wanted) != stat.S_IMODE(st.st_mode):
                os.chmod(f, stat.S_IMODE(st.st_mode) | wanted)
        except OSError:
            continue
