"""The per-rank training code: build (Accelerator, data, policy, optimizer), the step, the loop, validation, metrics.

`trainer.py` builds a rank's `Trainer` and runs one step (`opentau profile` runs the same step with a timer,
`timing.py`); `worker.py` is the loop `accelerate launch` starts; `metrics.py` is rank 0's log. Import the modules
themselves: this package imports nothing, so the launcher can use it without torch.
"""
