"""Test-only: the peak resident memory of each rank of a real `opentau train` launch, measured from the outside of
the product's own accounting (the kernel's VmHWM / VmRSS of the process, /proc/self/status).

Put this directory on PYTHONPATH and set TEST_MEMORY_RECORD=DIR: each rank writes DIR/rank<N>.json with
- `rss_before_policy`: its resident bytes just before the policy is built (train/trainer.py build_policy_model),
  after the imports, the Accelerator and the data are made;
- `hwm_before_policy`: its high-water mark at that moment (what start-up alone reached);
- `hwm_built`: its high-water mark once the policy is built and, under FSDP2, sharded (train/fsdp.py
  shard_for_launch), before the optimizer is made: the build's peak;
- `hwm_steps`: its high-water mark after each training step (the last one is the peak of the training steps, before
  the final checkpoint save);
- `hwm_exit`: its high-water mark when the rank leaves (runtime.exit_rank, before os._exit).
Python processes without the variable are untouched.
"""

from __future__ import annotations

import os


def status_bytes(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _install(directory: str) -> None:
    import json
    from pathlib import Path

    from opentau_cli.process import runtime

    record: dict = {"hwm_steps": []}
    rank = os.environ.get("RANK", "0")
    paused = runtime.import_paused

    def import_paused(*modules):
        paused(*modules)
        if modules != runtime.RANK_IMPORTS:  # the rank's own imports (run_rank), not a package's paused import
            return
        from opentau_cli.train import fsdp, trainer

        if getattr(trainer, "_memory_hook", False):
            return
        trainer._memory_hook = True
        build, step, shard = trainer.build_policy_model, trainer.Trainer.train_step, fsdp.shard_for_launch

        def build_policy_model(*args, **kwargs):
            record["rss_before_policy"] = status_bytes("VmRSS")
            record["hwm_before_policy"] = status_bytes("VmHWM")
            model = build(*args, **kwargs)
            record["hwm_built"] = status_bytes("VmHWM")
            return model

        def shard_for_launch(*args, **kwargs):
            model = shard(*args, **kwargs)
            record["hwm_built"] = status_bytes("VmHWM")
            return model

        def train_step(self, *args, **kwargs):
            result = step(self, *args, **kwargs)
            record["hwm_steps"].append(status_bytes("VmHWM"))
            return result

        trainer.build_policy_model, trainer.Trainer.train_step = build_policy_model, train_step
        fsdp.shard_for_launch = shard_for_launch  # trainer.py calls it as fsdp.shard_for_launch

    exit_rank = runtime.exit_rank

    def recorded_exit(code):
        if "rss_before_policy" in record:
            record["hwm_exit"] = status_bytes("VmHWM")
            Path(directory, f"rank{rank}.json").write_text(json.dumps(record))
        exit_rank(code)

    runtime.import_paused, runtime.exit_rank = import_paused, recorded_exit


if os.environ.get("TEST_MEMORY_RECORD"):
    _install(os.environ["TEST_MEMORY_RECORD"])
