"""The shared config: model, loading (JSON < env < overrides), Accelerate YAML, validation rules."""

from opentau_cli.config.accelerate import AccelerateSetup, read_accelerate_config, resolve_accelerate_config
from opentau_cli.config.load import load_config, parse_overrides
from opentau_cli.config.model import DEMO_DATASET, TrainConfig
from opentau_cli.config.rules import Validated, validate

__all__ = [
    "AccelerateSetup",
    "DEMO_DATASET",
    "TrainConfig",
    "Validated",
    "load_config",
    "parse_overrides",
    "read_accelerate_config",
    "resolve_accelerate_config",
    "validate",
]
