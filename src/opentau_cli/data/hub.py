"""LeRobot datasets named by Hugging Face repo id (`dataset.repo_id: org/name[@revision]`, also per mixture member).

`resolve` brings what a run reads into the Hugging Face cache and returns the snapshot directory: `meta/` first, then,
from its info.json templates, the data files of the selected episodes and the video files of the selected cameras,
never the rest of the repo. With HF_HUB_OFFLINE=1 (or no answer from the Hub) only the cache is read. The launcher
resolves once before anything is spawned and pins the commit into the config it launches with (`pin`), so every rank
reads the same snapshot from the cache (`dataset_root`, no network) and every checkpoint's train_config.json names
that commit. A resume stays on the commit its checkpoint recorded unless the command line names another revision
(`pin_for_resume`), and says so when the branch it started on has moved (launch.json records that branch). The repo
id parsing and the Hub probe are the ones `policy.pretrained_path` uses (policies/hub.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opentau_cli.config.model import DEMO_DATASET, MixtureMember, TrainConfig
from opentau_cli.errors import UserError

META_FILES = ["meta/*"]  # fnmatch's * also matches "/": meta/episodes/chunk-000/file-000.parquet too
REPO_TYPE = "dataset"
SHOWN_FILES = 3


@dataclass(frozen=True)
class HubDataset:
    """A dataset repo resolved into the Hugging Face cache."""

    repo_id: str
    revision: str  # as asked: branch, tag or commit
    root: Path  # <cache>/datasets--org--name/snapshots/<commit>

    @property
    def commit(self) -> str:
        return self.root.name


def repo_and_revision(member: MixtureMember, prefix: str = "dataset") -> tuple[str, str | None]:
    """(org/name, revision or None for main) from `repo_id` (with an optional @revision) and `revision`."""
    from opentau_cli.store.hub import parse_repo_id

    parsed = parse_repo_id(member.repo_id or "")
    if parsed is None:
        raise UserError(f"{prefix}.repo_id '{member.repo_id}' is not a Hugging Face dataset repo id (org/name[@revision]).")
    repo_id, at = parsed
    if at and member.revision and at != member.revision:
        raise UserError(f"{prefix}.repo_id '{member.repo_id}' names revision '{at}' but {prefix}.revision is "
                        f"'{member.revision}': give the revision once.")
    return repo_id, member.revision or at


def wanted_files(root: Path, member: MixtureMember, num_cameras: int) -> list[str]:
    """The files under `root` a run on `member` reads besides meta/: the data files of its episodes and the video
    files of its cameras (relative paths, from info.json's data_path / video_path templates). A mapping or episode
    list that the meta files refute yields what can be read: the data checks name the problem."""
    from opentau_cli.data.meta import camera_slots, read_meta

    meta = read_meta(root)
    selected = sorted(meta.episodes) if member.episodes is None else [e for e in member.episodes if e in meta.episodes]
    try:
        cameras = [k for k in camera_slots(meta, member.camera_keys, num_cameras) if k in meta.video_features]
    except UserError:
        cameras = []
    files: dict[str, None] = {}
    for ep in (meta.episodes[e] for e in selected):
        files[meta.data_path(ep).relative_to(root).as_posix()] = None
        for key in cameras:
            try:
                files[meta.video_path(ep, key)[0].relative_to(root).as_posix()] = None
            except UserError:
                continue
    return list(files)


def resolve(member: MixtureMember, num_cameras: int, prefix: str = "dataset", *, local_only: bool = False) -> HubDataset:
    """`member`'s repo in the Hugging Face cache with every file the run reads; downloads what is missing unless
    offline (HF_HUB_OFFLINE, an unreachable Hub, or `local_only`: a rank never asks the Hub). Raises UserError with
    one sentence when the Hub or the cache cannot provide it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    from opentau_cli.store.hub import hub_offline, hub_reachable

    repo_id, revision = repo_and_revision(member, prefix)
    cached_only = local_only or hub_offline() or not hub_reachable()
    try:
        root = Path(snapshot_download(repo_id, repo_type=REPO_TYPE, revision=revision, allow_patterns=META_FILES,
                                      local_files_only=cached_only))
    except IncompleteSnapshotError as exc:
        raise UserError(_not_cached(prefix, repo_id, revision, local_only, ["files of meta/"])) from exc
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        raise _hub_error(prefix, repo_id, revision, exc, local_only) from exc
    files = wanted_files(root, member, num_cameras)
    try:
        if files:  # by commit: the same snapshot even if the branch moves meanwhile
            snapshot_download(repo_id, repo_type=REPO_TYPE, revision=root.name, allow_patterns=files,
                              local_files_only=cached_only)
    except IncompleteSnapshotError:
        pass  # the snapshot lacks files the run reads: named below
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        raise _hub_error(prefix, repo_id, revision, exc, local_only) from exc
    missing = [f for f in files if not (root / f).exists()]
    if missing:
        raise UserError(_not_cached(prefix, repo_id, revision, local_only, missing))
    return HubDataset(repo_id, revision or "main", root)


def _shown(repo_id: str, revision: str | None) -> str:
    return repo_id + (f"@{revision}" if revision else "")


def _why_cache_only(repo_id: str, revision: str | None, local_only: bool) -> str:
    from huggingface_hub import constants

    from opentau_cli.store.hub import hub_offline

    download = f"`hf download {repo_id} --repo-type dataset" + (f" --revision {revision}`" if revision else "`")
    fill = (f"on a machine with network (same HF_HUB_CACHE) run `opentau config validate` on this config, which downloads "
            f"only what the run reads, or {download}")
    if local_only:
        return f"this process reads the cache only ({constants.HF_HUB_CACHE}): {fill}"
    if hub_offline():
        return f"HF_HUB_OFFLINE is set: unset it to download from the Hub, or {fill}"
    return f"the Hugging Face Hub cannot be reached: {fill}"


def _not_cached(prefix: str, repo_id: str, revision: str | None, local_only: bool, missing: list[str]) -> str:
    from huggingface_hub import constants

    more = f" and {len(missing) - SHOWN_FILES} more" if len(missing) > SHOWN_FILES else ""
    return (f"{prefix}.repo_id={_shown(repo_id, revision)}: {', '.join(missing[:SHOWN_FILES])}{more} "
            f"{'is' if len(missing) == 1 else 'are'} not in the Hugging Face cache ({constants.HF_HUB_CACHE}) while "
            f"{_why_cache_only(repo_id, revision, local_only)}.")


def _hub_error(prefix: str, repo_id: str, revision: str | None, exc: Exception, local_only: bool) -> UserError:
    """One sentence saying why neither the Hub nor the cache provides the dataset, and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    where = f"{prefix}.repo_id={_shown(repo_id, revision)}"
    if isinstance(exc, GatedRepoError):
        return UserError(f"{where}: the Hugging Face dataset {repo_id} is gated: accept its conditions on "
                         f"https://huggingface.co/datasets/{repo_id} and log in with `hf auth login`.")
    if isinstance(exc, RepositoryNotFoundError):
        return UserError(f"{where}: there is no Hugging Face dataset {repo_id} (or it is private: log in with `hf auth login`).")
    if isinstance(exc, RevisionNotFoundError):
        return UserError(f"{where}: the Hugging Face dataset {repo_id} has no revision '{revision}' (a branch, tag or commit).")
    if isinstance(exc, LocalEntryNotFoundError):
        storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=REPO_TYPE)
        what = (f"revision '{revision or 'main'}' of the Hugging Face dataset {repo_id} is" if storage.is_dir()
                else f"the Hugging Face dataset {repo_id} is")
        return UserError(f"{where}: {what} not in the Hugging Face cache ({constants.HF_HUB_CACHE}) while "
                         f"{_why_cache_only(repo_id, revision, local_only)}.")
    return UserError(f"{where}: downloading from the Hugging Face Hub failed ({type(exc).__name__}: {exc}).")


def dataset_root(member: MixtureMember, num_cameras: int, prefix: str = "dataset") -> Path:
    """The local directory a rank reads `member` from: its root (the demo generated on first use), or its snapshot in
    the Hugging Face cache, which the launcher filled (never the network here)."""
    from opentau_cli.data.synth import resolve_dataset_root

    if member.repo_id:
        return resolve(member, num_cameras, prefix, local_only=True).root
    return resolve_dataset_root(member.root or DEMO_DATASET)


def pin(cfg: TrainConfig, index: int | None, resolved: HubDataset) -> None:
    """Name the resolved commit in `cfg` (dataset, or dataset.mixture[index]): what the launch writes for its ranks
    and every checkpoint's train_config.json, so all of them read this snapshot."""
    target = cfg.dataset if index is None else cfg.dataset.mixture[index]
    target.repo_id = resolved.repo_id
    target.revision = resolved.commit


def revisions(members: list[MixtureMember], roots: list[Path]) -> dict[str, dict]:
    """What training_state.json records of the Hub datasets a run reads: {name: {repo_id, commit}}."""
    out = {}
    for member, root in zip(members, roots):
        if member.repo_id:
            out[member.label] = {"repo_id": member.repo_id.partition("@")[0], "commit": Path(root).name}
    return out


RESUME_KEYS = ("dataset.repo_id", "dataset.revision", "dataset.root", "dataset.mixture")


def asked_revisions(cfg: TrainConfig) -> dict[str, str]:
    """{member label: the revision its Hub dataset is asked at (branch, tag or commit; main by default)}, read before
    the data check pins the commits (`pin`). The launch records it (launch.json `dataset_branches`), so that a resume,
    which reads the recorded commit, can say that the branch has moved since."""
    out = {}
    for member in cfg.dataset.members():
        if member.repo_id:
            try:
                out[member.label] = repo_and_revision(member)[1] or "main"
            except UserError:  # the data check names it
                continue
    return out


def told_revision(overrides: dict) -> bool:
    """Whether the command line names the dataset or its revision (then a resume reads what it names)."""
    return any(key == k or key.startswith(k + ".") for key in overrides for k in RESUME_KEYS)


def _is_commit(revision: str) -> bool:
    return len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def branch_head(repo_id: str, branch: str) -> tuple[str, bool] | None:
    """(The commit `branch` of the dataset points at, whether the Hub said so now), from the Hub, or offline from the
    cache's record of the last download (`refs/<branch>`); None when neither knows."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.file_download import repo_folder_name

    from opentau_cli.store.hub import hub_offline, hub_reachable

    if not hub_offline() and hub_reachable():
        try:
            return HfApi().dataset_info(repo_id, revision=branch).sha, True
        except Exception:  # the Hub's answer, whatever it is, changes nothing here: the resume reads its commit
            return None
    ref = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=REPO_TYPE) / "refs" / branch
    try:
        return ref.read_text().strip() or None, False
    except (OSError, ValueError):
        return None


def _moved_line(prefix: str, repo_id: str, commit: str, branch: str | None, index: int | None) -> str | None:
    """The line that says a resume stays on `commit` although `branch` (what the run was started on) has moved."""
    if not branch or _is_commit(branch):
        return None
    head = branch_head(repo_id, branch)
    if head is None or head[0] == commit:
        return None
    when = "now points at" if head[1] else "pointed at, when this machine last downloaded it,"
    how = f"pass --dataset.revision={branch}" if index is None else f"pass --dataset.mixture.{index}.revision={branch}"
    return (f"{prefix}: resuming on {repo_id}@{commit}, the commit the checkpoint trained on, although {branch} "
            f"{when} {head[0]}; {how} to train on that.")


def pin_for_resume(ckpt: Path, cfg: TrainConfig, state: dict, overrides: dict,
                   branches: dict[str, str] | None = None) -> list[str]:
    """A resume reads the dataset commits its checkpoint recorded (`state`: training_state.json): each Hub dataset of
    `cfg` is pinned to its recorded commit, and when the revision the run was started on (`branches`: launch.json's
    `dataset_branches`) has moved since, a line says so. Another dataset or revision only when the command line
    names it (`--dataset.revision=...`, `--dataset.repo_id=...`): then the line that says what changed. Anything
    else that differs from the checkpoint is refused, naming it."""
    recorded = state.get("dataset_revisions") or {}
    branches = branches or {}
    told = told_revision(overrides)
    members = cfg.dataset.members()
    notes, refused = [], []
    for i, member in enumerate(members):
        index = i if cfg.dataset.mixture is not None else None
        prefix = "dataset" if index is None else f"dataset.mixture[{i}]"
        # One dataset: whatever it is named now, it continues the recorded one; a mixture's members by name.
        was = recorded.get(member.label) if index is not None else next(iter(recorded.values()), None)
        now = repo_and_revision(member, prefix) if member.repo_id else None
        if was is None and now is None:
            continue
        old = f"{was['repo_id']}@{was['commit']}" if was else "a local dataset"
        if told:
            if was is None or now is None or now[0] != was["repo_id"] or (now[1] or "main") != was["commit"]:
                new = _shown(*now) if now else f"the local dataset {member.root}"
                notes.append(f"{prefix} changes from {old} (the checkpoint's) to {new}, as the command line says.")
            continue
        if was is None or now is None or now[0] != was["repo_id"]:
            new = _shown(*now) if now else f"the local dataset {member.root}"
            refused.append(f"{prefix}: the checkpoint trained on {old}, this resume names {new}")
            continue
        if now[1] != was["commit"]:
            target = cfg.dataset if index is None else cfg.dataset.mixture[index]
            target.repo_id, target.revision = was["repo_id"], was["commit"]
            notes.append(f"{prefix}: resuming on {was['repo_id']}@{was['commit']}, the commit the checkpoint trained on "
                         f"(not {now[1] or 'main'}'s head now); " + ("pass --dataset.revision=... to train on another."
                                                                      if index is None else "name another revision in "
                                                                      "--dataset.mixture to train on it."))
            continue
        branch = branches.get(member.label) if index is not None else next(iter(branches.values()), None)
        moved = _moved_line(prefix, was["repo_id"], was["commit"], branch, index)
        if moved:
            notes.append(moved)
    if refused:
        raise UserError(f"Checkpoint '{ckpt}' was trained on other data ({'; '.join(refused)}): resume with the "
                        "checkpoint's dataset, or name the new one on the command line (--dataset.repo_id=... / "
                        "--dataset.revision=...) to continue on it.")
    return notes
