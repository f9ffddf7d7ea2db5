"""LeRobot datasets (v2.1 / v3.0), the synthetic demo, and the resumable rank-aware data stream (DESIGN interface 4)."""

from opentau_cli.data.build import TrainData, build_data, resolve_dataset_root, split_episodes
from opentau_cli.data.check import check_dataset
from opentau_cli.data.dataset import LeRobotDataset
from opentau_cli.data.sampler import BatchStream, ResumableSampler
from opentau_cli.data.synth import write_synth

__all__ = [
    "BatchStream", "LeRobotDataset", "ResumableSampler", "TrainData", "build_data", "check_dataset",
    "resolve_dataset_root", "split_episodes", "write_synth",
]
