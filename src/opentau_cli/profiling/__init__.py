"""Profiling: the phase timer TRAIN's step drives (phases.py), FLOP counting, and the reports built from them."""
