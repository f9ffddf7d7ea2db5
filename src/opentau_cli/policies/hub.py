"""Where `policy.pretrained_path` and `policy.tokenizer_path` come from: a local file or directory, or a Hugging Face
repo id `org/name[@revision]` resolved through `huggingface_hub` (downloaded when online; with `HF_HUB_OFFLINE=1`
only the local Hugging Face cache is read).

`check_sources` is what the config rules run before anything is spawned; `resolve` is what loading runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from opentau_cli.errors import UserError
from opentau_cli.store.hub import cache_dir, hub_offline, hub_reachable, parse_repo_id

# What a policy checkpoint needs from a repo: weights (and shards' index), configs, LeRobot's normalizer
# files and openpi's assets/<robot>/norm_stats.json (fnmatch's * also matches "/").
WEIGHT_FILES = ["*.safetensors", "*.json"]
TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "*.model"]


def _patterns(field: str) -> list[str]:
    return TOKENIZER_FILES if field.endswith("tokenizer_path") else WEIGHT_FILES


class NotCached(NamedTuple):
    """A repo id that neither the Hugging Face cache nor (offline or unreachable) the Hub can provide."""

    field: str
    text: str
    repo_id: str
    revision: str | None


def _not_cached(missing: list[NotCached]) -> str:
    """One sentence for every repo the cache lacks while the Hub cannot be asked: what, where, and the ways out."""
    fields = " and ".join(f"{m.field}={m.text}" for m in missing)
    repos = " and ".join(m.repo_id + (f"@{m.revision}" if m.revision else "") for m in missing)
    downloads = " and ".join(f"`hf download {m.repo_id}" + (f" --revision {m.revision}`" if m.revision else "`") for m in missing)
    one = len(missing) == 1
    paths = "a local path" if one else "local paths"
    fill = f"fill the cache once with {downloads} on a machine with network (same HF_HUB_CACHE)"
    if hub_offline():
        how = f"HF_HUB_OFFLINE is set: unset it to download {'it' if one else 'them'} from the Hub, {fill}, or give {paths}."
    else:
        how = f"the Hugging Face Hub cannot be reached: {fill}, or give {paths}."
    return (f"{fields}: {'not a local path' if one else 'not local paths'}, and {repos} {'is' if one else 'are'} not in "
            f"the Hugging Face cache ({cache_dir()}) while {how}")


def _hub_error(field: str, text: str, repo_id: str, revision: str | None, exc: Exception) -> UserError:
    """One sentence saying why the hub could not provide `repo_id`, and what to do."""
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    where = f"{field}={text}: not a local path"
    if isinstance(exc, GatedRepoError):
        return UserError(f"{where}, and the Hugging Face repo {repo_id} is gated: accept its license on "
                         f"https://huggingface.co/{repo_id} and log in with `hf auth login`.")
    if isinstance(exc, RepositoryNotFoundError):
        return UserError(f"{where}, and there is no Hugging Face repo {repo_id} (or it is private: log in with `hf auth login`).")
    if isinstance(exc, RevisionNotFoundError):
        return UserError(f"{where}, and the Hugging Face repo {repo_id} has no revision '{revision}'.")
    if isinstance(exc, LocalEntryNotFoundError):
        return UserError(_not_cached([NotCached(field, text, repo_id, revision)]))
    return UserError(f"{where}, and downloading {repo_id} from the Hugging Face Hub failed ({type(exc).__name__}: {exc}).")


def resolve(text: str | Path, field: str = "policy.pretrained_path") -> Path:
    """The local path behind `text`: itself when it exists, else the snapshot directory of a Hugging Face repo id
    (downloaded unless offline). Raises UserError with one actionable sentence when neither works."""
    text = str(text)
    local = Path(text).expanduser()
    if local.exists():
        return local
    parsed = parse_repo_id(text)
    if parsed is None:
        what = "directory" if field.endswith("tokenizer_path") else "file or directory"
        raise UserError(f"{field}={text}: no such {what} (nor a Hugging Face repo id org/name[@revision]).")
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=_patterns(field),
                                   local_files_only=hub_offline() or not hub_reachable())
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        raise _hub_error(field, text, repo_id, revision, exc) from exc
    return Path(folder)


def check_source(text: str | Path, field: str = "policy.pretrained_path") -> str | NotCached | None:
    """Why `text` cannot serve as `field`: one sentence, or NotCached for a repo id that neither the cache nor the Hub
    can provide; None when it can. Downloads nothing: a local path must exist; a repo id must be in the Hugging Face
    cache, or (online only) exist on the Hub."""
    text = str(text)
    if Path(text).expanduser().exists():
        return None
    parsed = parse_repo_id(text)
    if parsed is None:
        return f"{field} '{text}' does not exist."
    repo_id, revision = parsed
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, revision=revision, allow_patterns=_patterns(field), local_files_only=True)
        return None
    except LocalEntryNotFoundError:
        if hub_offline() or not hub_reachable():
            return NotCached(field, text, repo_id, revision)
    try:
        HfApi().repo_info(repo_id, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        return None
    except HfHubHTTPError as exc:
        return str(_hub_error(field, text, repo_id, revision, exc))
    except Exception:  # the HTTP client's connection errors: neither the cache nor the Hub can provide it
        return NotCached(field, text, repo_id, revision)


def check_weights_source(text: str | Path, field: str = "policy.pretrained_path") -> str | None:
    """Why `text` cannot serve as `field` (one sentence, the one loading it would raise), or None when it can."""
    problem = check_source(text, field)
    return _not_cached([problem]) if isinstance(problem, NotCached) else problem


def check_sources(sources: dict[str, str | Path]) -> list[str]:
    """Why each of `sources` (field -> path or repo id) cannot serve, one sentence each; the repos that neither the
    cache nor the Hub can provide are named together in one sentence, with one remedy."""
    problems = [check_source(text, field) for field, text in sources.items()]
    missing = [p for p in problems if isinstance(p, NotCached)]
    return [p for p in problems if isinstance(p, str)] + ([_not_cached(missing)] if missing else [])


class Pinned(NamedTuple):
    """A model repo id resolved to one commit, its files in the Hugging Face cache."""

    repo_id: str
    revision: str  # as asked: a branch, tag or commit (main by default)
    commit: str
    path: Path  # the cache's snapshot directory of that commit


def pin(text: str | Path, field: str = "policy.pretrained_path") -> Pinned | None:
    """`text` when it is a repo id and not a local path: resolved to one commit and downloaded at that commit (the
    snapshot directory is named by it), so that every file a command reads is of one commit, whatever the branch
    does meanwhile. None for a local path."""
    text = str(text)
    if Path(text).expanduser().exists() or parse_repo_id(text) is None:
        return None
    repo_id, revision = parse_repo_id(text)
    folder = resolve(text, field)
    return Pinned(repo_id, revision or "main", folder.name, folder)
