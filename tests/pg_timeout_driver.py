"""One rank of a 1-process launch: builds the Accelerator as the trainer does for BACKEND (argv[1]) with
distributed.timeout_minutes=MINUTES (argv[2]) and prints the timeout of the process group torch created."""

import sys

from opentau_cli.config import TrainConfig
from opentau_cli.config.accelerate import AccelerateSetup
from opentau_cli.train.trainer import make_accelerator, process_group_timeout

backend, minutes = sys.argv[1], int(sys.argv[2])
cfg = TrainConfig(distributed={"timeout_minutes": minutes})
make_accelerator(cfg, AccelerateSetup(backend=backend, zero_stage=2 if backend == "deepspeed" else None))
print(f"PROCESS_GROUP_TIMEOUT_S={process_group_timeout().total_seconds():g}")
