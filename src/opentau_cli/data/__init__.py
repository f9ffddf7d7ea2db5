"""LeRobot datasets (v2.1 / v3.0), the synthetic demo, and the resumable rank-aware data stream (docs/ARCHITECTURE.md, "Data order").

Names are imported on first use so that `config validate` (which only needs `check_dataset`) does not load torch.
"""

import importlib

_WHERE = {
    "BatchStream": "sampler", "ResumableSampler": "sampler", "LeRobotDataset": "dataset", "TrainData": "build",
    "build_data": "build", "resolve_dataset_root": "synth", "split_episodes": "build", "check_dataset": "check",
    "write_synth": "synth", "describe_dataset": "info",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"opentau_cli.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'opentau_cli.data' has no attribute {name!r}")
