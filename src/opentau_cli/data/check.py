"""`check_dataset`: what can be known from the meta files and the file system alone, reported before any process starts.

Per dataset (the single `dataset.root`, or each member of `dataset.mixture`): the meta files, the mapped features and
their widths, the camera mapping and PyAV for video, the selected episodes and their row / time ranges, the fps of
every video against the dataset's, a stat of every data and video file the selected episodes read, the footer
of each of their parquet data files, and that each selected camera's video decodes (the first frame of its first
selected episode). Across a mixture: names, and one fps for all. Each problem is one line naming the file or key.
A dataset in object storage goes through the same checks on its cached meta/ and the store's listing of the files
the run reads (data/remote.py), its problems named by URL.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from opentau_cli.config.model import DEMO_DATASET, DatasetConfig, DatasetSource, MixtureMember, TrainConfig
from opentau_cli.data.meta import DatasetMeta, camera_slots, layout_version, read_meta
from opentau_cli.data.files import LOCAL
from opentau_cli.data.synth import demo_info, demo_root
from opentau_cli.data.video import INSTALL_HINT, pyav_available
from opentau_cli.errors import UserError
from opentau_cli.store.storage import is_url

NUMERIC = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
SHOWN_FILES = 3  # missing files named in one line, the rest counted


def _missing_key(what: str, key: str, meta: DatasetMeta) -> str:
    close = difflib.get_close_matches(key, list(meta.features), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (features: {', '.join(meta.features)})"
    return f"{what} '{key}' is not a feature in {meta.root / 'meta/info.json'}{hint}."


def check_dataset(cfg: TrainConfig) -> list[str]:
    """Problems with cfg.dataset against the datasets' meta files and files; [] when they look usable."""
    d = cfg.dataset
    errors = _check_mixture_fields(d)
    if errors:
        return errors
    prefixes = [f"dataset.mixture[{i}]" for i in range(len(d.mixture))] if d.mixture is not None else ["dataset"]
    fps: dict[str, float] = {}
    for i, (prefix, member) in enumerate(zip(prefixes, d.members())):
        meta, files = _meta_of(prefix, member, errors, cfg, None if d.mixture is None else i)
        if meta is None:
            continue
        fps[member.label] = meta.fps
        problems = _check_member(prefix, member, meta, files, cfg)
        errors.extend(files.shown(line) if files is not None else line for line in problems)
    if len(set(fps.values())) > 1:
        listed = ", ".join(f"{name} {rate:g}" for name, rate in fps.items())
        errors.append(
            f"dataset.mixture: the datasets record at different fps ({listed}): an action chunk of policy.chunk_size steps "
            "would span different times; mix datasets of one fps (resample the others with LeRobot's tools)."
        )
    return errors


def _check_mixture_fields(d: DatasetConfig) -> list[str]:
    if d.mixture is None:
        return []
    errors = []
    defaults = DatasetConfig()
    for name in DatasetSource.model_fields:
        if getattr(d, name) != getattr(defaults, name):
            errors.append(f"dataset.{name} is set next to dataset.mixture, which it does not apply to: "
                          f"set {name} in each mixture member instead.")
    labels = [m.label for m in d.mixture]
    for label in sorted({x for x in labels if labels.count(x) > 1}):
        errors.append(f"dataset.mixture has several members named '{label}': give each a distinct `name`.")
    return errors


def _meta_of(prefix: str, member: MixtureMember, errors: list[str], cfg: TrainConfig,
             index: int | None) -> tuple[DatasetMeta | None, object]:
    """The member's meta and how its files are reached (data/remote.py LOCAL or RemoteFiles), None when they are not
    there to check (the demo is generated on first use). A Hub dataset is resolved here, once per launch: what the
    run reads is brought into the Hugging Face cache, checked there, and its commit pinned in `cfg` (data/hub.py); a
    dataset in object storage likewise, its meta/ into this machine's cache and the versions of what the run reads
    pinned (data/remote.py)."""
    if member.repo_id is not None or member.root is None:
        return _hub_meta_of(prefix, member, errors, cfg, index)
    if is_url(member.root):
        return _remote_meta_of(prefix, member, errors, cfg, index)
    if member.root == DEMO_DATASET and not (demo_root() / "meta" / "info.json").is_file():
        # Check against the info it will have rather than writing it now.
        info = demo_info()
        episodes = dict.fromkeys(range(info["total_episodes"]))  # indices only: nothing to stat yet
        return DatasetMeta(root=demo_root(), info=info, version=layout_version(info, demo_root()), episodes=episodes,
                           tasks={}, stats=None), None
    root = demo_root() if member.root == DEMO_DATASET else Path(member.root).expanduser()
    if not root.is_dir():
        if prefix != "dataset":  # rules.py reports a dataset.root that is not a directory
            errors.append(f"{prefix}.root '{member.root}' is not a directory (a local LeRobot dataset, or '{DEMO_DATASET}').")
        return None, None
    try:
        return read_meta(root), LOCAL
    except UserError as e:
        errors.append(str(e))
        return None, None


def _remote_meta_of(prefix: str, member: MixtureMember, errors: list[str], cfg: TrainConfig,
                    index: int | None) -> tuple[DatasetMeta | None, object]:
    from opentau_cli.config.rules import secret_options
    from opentau_cli.data import remote

    if secret_options(member.remote_options):  # refused by the config rules, and never sent to a store
        return None, None
    try:
        resolved = remote.resolve(member, cfg.dataset, prefix)
        meta = read_meta(resolved.root)
    except UserError as e:
        errors.append(str(e))
        return None, None
    remote.pin(cfg, index, resolved)
    return meta, resolved.files


def _hub_meta_of(prefix: str, member: MixtureMember, errors: list[str], cfg: TrainConfig,
                 index: int | None) -> tuple[DatasetMeta | None, object]:
    from opentau_cli.data import hub

    if member.repo_id is None:
        errors.append(f"{prefix} names no dataset: give root (a local LeRobot dataset) or repo_id (org/name on the Hugging Face Hub).")
        return None, None
    if member.root is not None:
        errors.append(f"{prefix}.root and {prefix}.repo_id are both set: give one (a local dataset, or one on the Hugging Face Hub).")
        return None, None
    try:
        resolved = hub.resolve(member, cfg.dataset.num_cameras, prefix)
        meta = read_meta(resolved.root)
    except UserError as e:
        errors.append(str(e))
        return None, None
    hub.pin(cfg, index, resolved)
    return meta, LOCAL


def _check_member(prefix: str, member: MixtureMember, meta: DatasetMeta, files, cfg: TrainConfig) -> list[str]:
    p = cfg.policy
    info_json = meta.root / "meta" / "info.json"
    errors = []
    for field, key, limit_name, limit in (
        ("state_key", member.state_key, "policy.max_state_dim", p.max_state_dim),
        ("action_key", member.action_key, "policy.max_action_dim", p.max_action_dim),
    ):
        if key not in meta.features:
            errors.append(_missing_key(f"{prefix}.{field}", key, meta))
        elif meta.features[key].get("dtype") not in NUMERIC:
            errors.append(f"{info_json}: '{key}' ({prefix}.{field}) is {meta.features[key].get('dtype')}, not numbers; "
                          "map a numeric feature.")
        elif meta.width(key) > limit:
            errors.append(f"{info_json}: '{key}' is {meta.width(key)} wide but {limit_name} is {limit}; "
                          f"set --{limit_name}={meta.width(key)} or more.")
    try:
        slots = camera_slots(meta, member.camera_keys, cfg.dataset.num_cameras, f"{prefix}.camera_keys")
    except UserError as e:
        errors.append(str(e))
        slots = []
    videos = [f for f in slots if f and meta.features[f].get("dtype") == "video"]
    if videos and not pyav_available():
        errors.append(f"{info_json}: cameras {', '.join(videos)} are mp4 video, which needs PyAV: {INSTALL_HINT}.")
    for key in videos:
        rate = meta.features[key].get("info", {}).get("video.fps")
        if rate is not None and abs(float(rate) - meta.fps) > 1e-3:
            errors.append(f"{info_json}: video '{key}' is encoded at {float(rate):g} fps but the dataset records at "
                          f"{meta.fps:g}: its frames would not line up with the data; re-encode it at {meta.fps:g} fps.")
    selected = sorted(meta.episodes) if member.episodes is None else sorted(set(member.episodes))
    missing = sorted(set(selected) - set(meta.episodes))
    if missing:
        errors.append(f"{prefix}.episodes {missing} are not in {meta.root / 'meta'} (it has {len(meta.episodes)} episodes).")
    split = cfg.validation.val_split
    if split > 0 and max(1, round(len(selected) * split)) >= len(selected):
        errors.append(f"validation.val_split={split} holds out every one of the {len(selected)} episodes of {meta.root}: "
                      "lower it, or select more episodes.")
    if files is not None:
        chosen = [meta.episodes[e] for e in selected if e in meta.episodes]
        errors.extend(_check_ranges(meta, chosen, videos))
        found = _check_files(prefix, meta, chosen, videos, files)
        errors.extend(found)
        if not found and not errors:
            errors.extend(_check_decoding(meta, chosen, videos, files))
    return errors


def _check_ranges(meta: DatasetMeta, episodes: list, videos: list[str]) -> list[str]:
    """Each episode's length against the rows and the stretch of video that meta/episodes gives it (v3.0)."""
    where = meta.root / "meta" / "episodes"
    for ep in episodes:
        if ep.length < 1:
            return [f"{where}: episode {ep.index} has length {ep.length}; remove it or leave it out with dataset.episodes."]
        if ep.rows is not None and ep.rows[1] - ep.rows[0] != ep.length:
            return [f"{where}: episode {ep.index} has length {ep.length} but rows {ep.rows[0]}..{ep.rows[1]} "
                    f"({ep.rows[1] - ep.rows[0]}); the meta files disagree: rebuild them with LeRobot's tools."]
        for key in videos:
            start, end = ep.video_files.get(key, (0, 0, 0.0))[2], ep.video_ends.get(key)
            if end is not None and (end - start) * meta.fps + 0.5 < ep.length:
                return [f"{where}: episode {ep.index} of video '{key}' spans {end - start:.3f}s, shorter than its "
                        f"{ep.length} frames at {meta.fps:g} fps; the video or the meta files are damaged."]
    return []


def _check_files(prefix: str, meta: DatasetMeta, episodes: list, videos: list[str], files) -> list[str]:
    """A stat of every data and video file the episodes read (in object storage: the store's listing), and each data
    file's parquet footer: absent, empty and unreadable ones, one line per kind."""
    wanted: dict[Path, tuple[str, list[int]]] = {}  # path -> (the info.json template laying it out, episodes reading it)
    for ep in episodes:
        wanted.setdefault(meta.data_path(ep), ("data_path", []))[1].append(ep.index)
        for key in videos:
            try:
                path, _ = meta.video_path(ep, key)
            except UserError as e:
                return [str(e)]
            wanted.setdefault(path, ("video_path", []))[1].append(ep.index)
    found: dict[tuple[str, str], list] = {}  # (missing | empty, data_path | video_path) -> files
    for path, (layout, eps) in wanted.items():
        size = files.size(path)
        if size is None:
            found.setdefault(("missing", layout), []).append((path, eps))
        elif size == 0:
            found.setdefault(("empty", layout), []).append((path, eps))
        elif layout == "data_path" and not _parquet_footer_reads(path, files):
            found.setdefault(("truncated or damaged (its parquet footer does not read)", layout), []).append((path, eps))
    return [_files_line(prefix, meta, paths, state, layout) for (state, layout), paths in found.items()]


def _check_decoding(meta: DatasetMeta, episodes: list, videos: list[str], files) -> list[str]:
    """Each selected camera's video decodes: the first frame of its first selected episode, as training reads it
    (what the codec, PyAV's decoders and the file's header say, found before launch instead of in a rank)."""
    from opentau_cli.data.video import VideoFrames

    frames = VideoFrames(cache_mb=1, max_open=1)
    errors = []
    for key in videos if episodes else []:
        try:
            path, start = meta.video_path(episodes[0], key)
            frames.get(path, start, meta.fps, (8, 8), files)
        except UserError as e:
            errors.append(str(e))
    frames.close()
    return errors


def _parquet_footer_reads(path: Path, files) -> bool:
    """Whether the parquet file's footer (its schema and row groups) reads: a truncated or damaged file fails here,
    before launch, instead of in a rank mid-run. The footer only: a few KB, however large the file (a file in object
    storage is fetched into the cache, where the ranks read it next)."""
    import pyarrow.parquet as pq

    try:
        with files.open(path) as local:
            pq.read_metadata(local)
    except UserError:
        raise
    except Exception:  # pyarrow's ArrowInvalid / OSError: what a bad footer raises is pyarrow's business
        return False
    return True


def _files_line(prefix: str, meta: DatasetMeta, files: list, state: str, layout: str) -> str:
    others = [str(p.relative_to(meta.root)) for p, _ in files[1:SHOWN_FILES]]
    more = len(files) - SHOWN_FILES
    also = (f" (and {', '.join(others)}" + (f" and {more} more" if more > 0 else "") + ")") if others else ""
    episodes = sorted({e for _, eps in files for e in eps})
    what = "data" if layout == "data_path" else "video"
    return (f"{files[0][0]} is {state}{also}: meta/info.json's {layout} puts the {what} of "
            f"episode{'s' if len(episodes) > 1 else ''} {_ranges(episodes)} there; restore the dataset's files, "
            f"or train without those episodes (list the others in {prefix}.episodes).")


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
