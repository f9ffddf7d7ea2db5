"""Test-only: SIGKILL a whole real `opentau train` launch at a chosen moment of a checkpoint save.

Put this directory on PYTHONPATH and set TEST_KILL_AT=MOMENT@STEP (TEST_KILL_RANK=N picks the rank
that acts, default 0). When that rank reaches MOMENT during the save of STEP, it SIGKILLs the launcher, Accelerate's
agent, every other rank and itself, as a node failure would. The launcher must lead its own session (the test starts
it with start_new_session=True): that is how the hook finds the top of the run. Python processes without the variable
are untouched; with it, nothing happens until `opentau_cli.checkpoint.manager` is imported.
"""

from __future__ import annotations

import os

MOMENTS = {
    "mid_file": "this rank's ZeRO optimizer shard half written (the other rank may still be writing)",
    "before_metadata": "every rank's save_state done, train_config.json / training_state.json not yet written",
    "before_manifest_rename": "manifest fully written to its temp file, not yet renamed into place",
    "before_publish": "manifest in place, the .tmp- directory not yet renamed to its step",
    "before_last": "published, checkpoints/last not yet repointed",
    "mid_retention": "a newer checkpoint published, the oldest one half deleted by keep_last",
}


def _kill_the_run() -> None:
    import signal

    import psutil

    me = psutil.Process()
    top = next((p for p in me.parents() if os.getpgid(p.pid) == p.pid), None)
    victims = ([top] + top.children(recursive=True)) if top else []
    for p in [p for p in victims if p.pid != me.pid]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(manager, moment: str, step: int) -> None:
    """Patch the save path of this process so that it kills the run at `moment` of the save of `step`."""
    import shutil
    from pathlib import Path

    import torch

    saving = {"step": None}
    real_save_ckpt = manager.CheckpointManager.save

    def save_ckpt(self, s, **kw):
        saving["step"] = s
        try:
            return real_save_ckpt(self, s, **kw)
        finally:
            saving["step"] = None

    manager.CheckpointManager.save = save_ckpt

    def now() -> bool:
        return saving["step"] == step

    if moment == "mid_file":
        real_torch_save = torch.save

        def torch_save(obj, f, *a, **k):
            real_torch_save(obj, f, *a, **k)
            if now() and "optim_states" in str(f):
                with open(f, "r+b") as fh:
                    fh.truncate(os.path.getsize(f) // 2)
                _kill_the_run()

        torch.save = torch_save
    elif moment == "before_metadata":
        real_write_json = manager.write_json_atomic
        manager.write_json_atomic = lambda *a, **k: _kill_the_run() if now() else real_write_json(*a, **k)
    elif moment in ("before_manifest_rename", "before_publish"):
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            if now() and ((moment == "before_manifest_rename" and str(dst).endswith("manifest.json")) or
                          (moment == "before_publish" and Path(src).name.startswith(".tmp-"))):
                _kill_the_run()
            return real_replace(src, dst, *a, **k)

        os.replace = replace
    elif moment == "before_last":
        real_point_last = manager.point_last
        manager.point_last = lambda *a, **k: _kill_the_run() if now() else real_point_last(*a, **k)
    elif moment == "mid_retention":
        real_rmtree = shutil.rmtree

        def rmtree(path, *a, **k):
            if now() and Path(path).name.startswith(".old-"):
                files = sorted(f for f in Path(path).rglob("*") if f.is_file())
                for f in files[: len(files) // 2]:
                    f.unlink()
                _kill_the_run()
            return real_rmtree(path, *a, **k)

        shutil.rmtree = rmtree
    else:
        raise SystemExit(f"TEST_KILL_AT: unknown moment {moment!r}; one of {', '.join(MOMENTS)}")


def _install(spec_text: str) -> None:
    import importlib.abc
    import importlib.util
    import sys

    moment, _, step = spec_text.partition("@")
    if os.environ.get("RANK", "0") != os.environ.get("TEST_KILL_RANK", "0"):
        return

    class ArmOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "opentau_cli.checkpoint.manager":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                _arm(module, moment, int(step))

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, ArmOnImport())


if os.environ.get("TEST_KILL_AT"):
    _install(os.environ["TEST_KILL_AT"])
