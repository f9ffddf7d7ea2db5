"""`opentau profile --dataloader-only`: the input pipeline's ceiling in samples/s, with no model built.

It builds the same data `train` builds (DATA's `build_data`, this rank's shard) and only pulls batches, so a user
can compare the result with the training samples/s: if they are close, data starves training.
"""

from __future__ import annotations

import sys
import time

from opentau_cli.config.model import TrainConfig
from opentau_cli.profiling.stats import percentile

POLICY_MODULE = "opentau_cli.policies"


def profile_dataloader(cfg: TrainConfig, *, steps: int, warmup: int, rank: int = 0, world_size: int = 1) -> dict:
    """Time `warmup + steps` batches from this rank's BatchStream; the first `warmup` (worker start-up) are dropped."""
    from opentau_cli.data import build_data

    data = build_data(cfg, rank, world_size)
    stream = data.stream
    waits: list[float] = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        next(stream)
        if i >= warmup:
            waits.append(time.perf_counter() - start)
    stream.close()
    elapsed = sum(waits)
    batch = cfg.per_device_batch_size or cfg.batch_size
    mean = elapsed / len(waits)
    return {
        "mode": "dataloader_only",
        "model_built": False,
        # Proof for the user (and the tests) that no policy code was even imported.
        "policy_imported": POLICY_MODULE in sys.modules,
        "dataset": cfg.dataset.root if cfg.dataset.mixture is None else "mixture",
        "datasets": [{"name": name, "weight": weight} for name, weight in zip(data.names, data.weights)],
        "rank": rank,
        "world_size": world_size,
        "batch_size": batch,
        "num_workers": cfg.dataset.num_workers,
        "measured_batches": len(waits),
        "batches_per_s": len(waits) / elapsed if elapsed > 0 else float("inf"),
        "samples_per_s": len(waits) * batch / elapsed if elapsed > 0 else float("inf"),
        "batch_wait": {
            "mean_s": mean,
            "median_s": percentile(waits, 50),
            "p95_s": percentile(waits, 95),
        },
    }
