"""Where `policy.pretrained_path` and `policy.tokenizer_path` come from: a local file or directory, or a Hugging Face
repo id `org/name[@revision]` resolved through `huggingface_hub` (downloaded when online; with `HF_HUB_OFFLINE=1`
only the local Hugging Face cache is read).

`check_weights_source` is what the config rules run before anything is spawned; `resolve` is what loading runs.
"""

from __future__ import annotations

from pathlib import Path

from opentau_cli.errors import UserError

# What a policy checkpoint needs from a repo: weights (and shards' index), configs, LeRobot's normalizer
# files and openpi's assets/<robot>/norm_stats.json (fnmatch's * also matches "/").
WEIGHT_FILES = ["*.safetensors", "*.json"]
TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "*.model"]


def parse_repo_id(text: str) -> tuple[str, str | None] | None:
    """`org/name` or `org/name@revision` -> (repo_id, revision); None when `text` is not shaped like one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id, _, revision = text.partition("@")
    if repo_id.count("/") != 1 or (revision == "" and "@" in text):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def _patterns(field: str) -> list[str]:
    return TOKENIZER_FILES if field.endswith("tokenizer_path") else WEIGHT_FILES


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


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
        reason = "HF_HUB_OFFLINE is set" if _offline() else "the Hugging Face Hub cannot be reached"
        return UserError(f"{where}, and {repo_id}{'@' + revision if revision else ''} is not in the Hugging Face cache "
                         f"({_cache_dir()}) while {reason}: download it once with `hf download {repo_id}` on a machine "
                         "with network (same HF_HUB_CACHE), or give a local path.")
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
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=_patterns(field), local_files_only=_offline())
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        raise _hub_error(field, text, repo_id, revision, exc) from exc
    return Path(folder)


def check_weights_source(text: str | Path, field: str = "policy.pretrained_path") -> str | None:
    """Why `text` cannot serve as `field` (one sentence), or None when it can. Downloads nothing: a local path must
    exist; a repo id must be in the Hugging Face cache, or (online only) exist on the Hub."""
    text = str(text)
    if Path(text).expanduser().exists():
        return None
    parsed = parse_repo_id(text)
    if parsed is None:
        return f"{field} '{text}' does not exist."
    repo_id, revision = parsed
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, revision=revision, allow_patterns=_patterns(field), local_files_only=True)
        return None
    except LocalEntryNotFoundError as exc:
        if _offline():
            return str(_hub_error(field, text, repo_id, revision, exc))
    try:
        HfApi().repo_info(repo_id, revision=revision)
        return None
    except HfHubHTTPError as exc:
        return str(_hub_error(field, text, repo_id, revision, exc))
    except Exception as exc:  # the HTTP client's connection errors: neither the cache nor the Hub can provide it
        return str(_hub_error(field, text, repo_id, revision, LocalEntryNotFoundError(str(exc))))
