"""Accelerate's own launcher (`accelerate launch`, its `main`) as opentau starts it: `python -m
opentau_cli.process.accelerate_launcher ARGS` takes the same arguments as `python -m accelerate.commands.launch ARGS`.

Three differences: the launcher dies with the opentau command that started it (runtime.die_with_parent); it imports
torch with the garbage collector paused and freezes what it made, as every rank does (docs/ARCHITECTURE.md,
"Start-up"), which also spares its exit a last pass over those objects (about a second of CPU per launch); and
OPENTAU_TORCHRUN_ARGS (JSON) sets torchrun arguments that `accelerate launch` has no flag for: the c10d rendezvous
endpoint of a one-machine launch with restarts (else torchrun's fixed default port, shared by every run on the
machine) and elastic `nnodes` MIN:MAX (docs/ARCHITECTURE.md, "Restarts").
"""

from __future__ import annotations

import json
import os
import signal

from opentau_cli.process.runtime import die_with_parent, import_paused

TORCHRUN_ARGS = "OPENTAU_TORCHRUN_ARGS"


def main() -> None:
    die_with_parent()  # with `opentau train` / `resume`; its ranks die with it in turn (runtime.run_rank)
    # A scheduler that signals every process of a job (SLURM's job-step signal, `--signal=USR1@T` without B:) reaches
    # this launcher too, whose default action on SIGUSR1 is to die, taking the ranks that are saving with it. The
    # ranks take the notice themselves (docs/ARCHITECTURE.md, "Schedulers"); a handler, unlike SIG_IGN, is not
    # inherited by what this launcher starts.
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: None)
    import_paused("accelerate.commands.launch")
    import accelerate.commands.launch as launch

    extra = json.loads(os.environ.pop(TORCHRUN_ARGS, "") or "{}")
    if extra:
        build = launch._filter_args  # how Accelerate turns its arguments into torchrun's (multi-GPU and DeepSpeed)

        def with_extra(args, parser, default_args=[]):  # noqa: B006 (Accelerate's signature)
            torchrun_args = build(args, parser, default_args)
            for key, value in extra.items():
                setattr(torchrun_args, key, value)
            return torchrun_args

        launch._filter_args = with_extra
    launch.main()


if __name__ == "__main__":
    main()
