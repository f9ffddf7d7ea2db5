"""Named moments of a checkpoint save (and of the offline tools' writes), where fault tests strike (tests/save_faults.py kills the run there).

A save calls `fault_point(name, path)` at each moment below; it does nothing unless a test has put a hook in
`hooks`, so a moment is found by its name, never by patching functions or matching file names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

# In the order one save reaches them.
POINTS = {
    "state_saved": "this rank's accelerator.save_state has returned (path: the save's temp dir)",
    "json_synced": "a JSON file is written and fsynced under a temp name, not yet renamed (path: its final name)",
    "publishing": "manifest in place, every file synced, the temp dir not yet renamed to its step (path: the temp dir)",
    "published": "the temp dir is renamed to its step, `last` not yet repointed (path: the step dir)",
    "retiring": "a checkpoint is renamed to its deletion temp name, not yet deleted (path: that dir)",
}
# The offline tools' writes (consolidate, export, eval's output), in the order one write reaches them.
TOOL_POINTS = {
    "tensor_written": "one more tensor is in the hidden file being written (path: the file's final name)",
    "vouched": "consolidation into a checkpoint: the manifest vouches for the new files, still under their hidden "
               "names (path: the checkpoint)",
    "output_staged": "a command's output is complete in its hidden sibling, not yet renamed into place (path: the target)",
}

hooks: list[Callable[[str, Path], None]] = []


def fault_point(name: str, path: Path) -> None:
    for hook in hooks:
        hook(name, path)
