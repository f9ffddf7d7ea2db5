"""The shared config: model, loading (JSON < env < overrides), Accelerate YAML, validation rules.

This package imports no other opentau package but `errors`: the data and policy checks are handed to the rules
from above (`opentau_cli.plan.run_plan`)."""

from opentau_cli.config.accelerate import (
    AccelerateSetup, read_accelerate_config, resolve_accelerate_config, setup_from_dict, with_machine,
)
from opentau_cli.config.load import load_config, parse_overrides
from opentau_cli.config.model import DEMO_DATASET, TrainConfig
from opentau_cli.config.rules import Machine, Validated, validate

__all__ = [
    "AccelerateSetup",
    "DEMO_DATASET",
    "Machine",
    "TrainConfig",
    "Validated",
    "load_config",
    "parse_overrides",
    "read_accelerate_config",
    "resolve_accelerate_config",
    "setup_from_dict",
    "validate",
    "with_machine",
]
