"""Profiling: per-phase step timers (phases.py) and the reports built from them."""

from opentau_cli.profiling.phases import PHASES, PhaseTimer

__all__ = ["PHASES", "PhaseTimer"]
