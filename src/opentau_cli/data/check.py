"""`check_dataset`: what can be known from the meta files alone, reported before any process starts."""

from __future__ import annotations

import difflib
from pathlib import Path

from opentau_cli.config.model import DEMO_DATASET, TrainConfig
from opentau_cli.data.meta import DatasetMeta, camera_slots, layout_version, read_meta
from opentau_cli.data.synth import demo_info, demo_root
from opentau_cli.data.video import INSTALL_HINT, pyav_available
from opentau_cli.errors import UserError


def _missing_key(what: str, key: str, meta: DatasetMeta) -> str:
    close = difflib.get_close_matches(key, list(meta.features), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (features: {', '.join(meta.features)})"
    return f"{what} '{key}' is not a feature in {meta.root / 'meta/info.json'}{hint}."


def check_dataset(cfg: TrainConfig) -> list[str]:
    """Problems with cfg.dataset against the dataset's meta files; [] when it looks usable. Reads no data file."""
    d, p = cfg.dataset, cfg.policy
    if d.root == DEMO_DATASET and not (demo_root() / "meta" / "info.json").is_file():
        # The demo is generated on first use; check against the info it will have rather than writing it now.
        root = demo_root()
        info = demo_info()
        meta = DatasetMeta(root=root, info=info, version=layout_version(info, root), episodes={}, tasks={}, stats=None)
        known_eps = set(range(info["total_episodes"]))
    else:
        root = demo_root() if d.root == DEMO_DATASET else Path(d.root)
        if not root.is_dir():
            return []  # rules.py already reports a dataset.root that is not a directory
        try:
            meta = read_meta(root)
        except UserError as e:
            return [str(e)]
        known_eps = set(meta.episodes)

    errors = []
    for what, key, limit_name, limit in (
        ("dataset.state_key", d.state_key, "policy.max_state_dim", p.max_state_dim),
        ("dataset.action_key", d.action_key, "policy.max_action_dim", p.max_action_dim),
    ):
        if key not in meta.features:
            errors.append(_missing_key(what, key, meta))
        elif meta.width(key) > limit:
            errors.append(
                f"{root / 'meta/info.json'}: '{key}' is {meta.width(key)} wide but {limit_name} is {limit}; "
                f"set --{limit_name}={meta.width(key)} or more."
            )
    try:
        slots = camera_slots(meta, d.camera_keys, d.num_cameras)
    except UserError as e:
        errors.append(str(e))
        slots = []
    videos = [f for f in slots if f and meta.features[f].get("dtype") == "video"]
    if videos and not pyav_available():
        errors.append(f"{root / 'meta/info.json'}: cameras {', '.join(videos)} are mp4 video, which needs PyAV: {INSTALL_HINT}.")
    if d.episodes is not None:
        missing = sorted(set(d.episodes) - known_eps)
        if missing:
            errors.append(f"dataset.episodes {missing} are not in {root / 'meta'} (it has {len(known_eps)} episodes).")
    return errors
