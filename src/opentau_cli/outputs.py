"""Where a command writes what the user asked for: one convention for `checkpoint export --output`,
`checkpoint consolidate --output`, `eval --output` and `dataset synth OUT` (docs/ARCHITECTURE.md, "Outputs").

- Missing parent directories are created.
- An existing target that is not an empty directory is refused (one sentence, exit 2) unless `--force`.
- The result is written into a hidden temporary sibling (`.<name>.tmp-<pid>`) and renamed into place, so the target
  is only ever absent, the old one, or complete; `--force` replaces the old target only once the new one is complete.
- Files get the mode `open()` gives them under the umask (`follow_umask`): some writers (safetensors' `save_file`)
  create their files 0600 through a private temp file, which would leave a model unreadable to the team.

Imports nothing heavy.
"""

from __future__ import annotations

import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from opentau_cli.errors import UserError


def check_target(target: Path, *, force: bool) -> None:
    """Refuse, before any work, a target that exists and is not an empty directory, unless `force`."""
    target = Path(target)
    if force or not (target.exists() or target.is_symlink()):
        return
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        return
    raise UserError(f"{target} already exists and is not empty: choose a new path, or pass --force to replace it.")


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
def publishing(target: Path, *, force: bool) -> Iterator[Path]:
    """Yield a hidden temporary sibling path of `target` (the caller makes it a directory or a file); when the block
    succeeds, rename it into place (replacing an empty directory, or with `force` any old target, which is removed
    only after the new one is in place); when it fails, remove it and the parent directories this call made."""
    target = Path(target)
    check_target(target, force=force)
    made = make_parents(target.parent)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    _remove(staging)
    try:
        yield staging
        follow_umask(staging)
        old = None
        if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            target.rmdir()
        elif target.exists() or target.is_symlink():
            check_target(target, force=force)  # appeared while we worked
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
