"""Closed-loop evaluation in simulators and expert demonstrations recorded from them (docs/ARCHITECTURE.md,
"Closed-loop evaluation")."""
