"""Reaching the Hugging Face Hub: repo ids, offline mode, and whether the Hub answers at all. What a policy or a
dataset fetches from it is policies/hub.py's and data/hub.py's."""

from __future__ import annotations

import functools


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


# One quick request says whether the Hub answers at all: without network, checks and loads go straight to the cache
# instead of waiting out the hub client's timeouts and retries (tens of seconds) for each repo.
HUB_PROBE_TIMEOUT = 3.0  # seconds


@functools.cache
def hub_reachable() -> bool:
    """Whether the Hugging Face Hub answers one HEAD request (asked once per process)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT)
    except Exception:  # the HTTP client's connection, proxy and timeout errors
        return False
    return True


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (as huggingface_hub read it): only the cache is read."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
