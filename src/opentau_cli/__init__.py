"""opentau: train pi05 robot policies with Accelerate; safe checkpoints, exact resume, streaming consolidation."""

__version__ = "0.1.0"
