"""Accelerate's own launcher (`accelerate launch`, its `main`) as opentau starts it: `python -m
opentau_cli.accelerate_launcher ARGS` takes the same arguments as `python -m accelerate.commands.launch ARGS`.

Two differences: the launcher dies with the opentau command that started it (runtime.die_with_parent), and it imports torch with the garbage collector paused and freezes what it made,
as every rank does (docs/ARCHITECTURE.md, "Start-up"), which also spares its exit a last pass over those objects;
about a second of CPU per launch.
"""

from __future__ import annotations

from opentau_cli.runtime import die_with_parent, import_paused


def main() -> None:
    die_with_parent()  # with `opentau train` / `resume`; its ranks die with it in turn (runtime.run_rank)
    import_paused("accelerate.commands.launch")
    from accelerate.commands.launch import main as accelerate_launch

    accelerate_launch()


if __name__ == "__main__":
    main()
