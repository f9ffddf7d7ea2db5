"""Test-only: hold the launcher's upload of one checkpoint at a known moment, and record every remote commit.

Put this directory on PYTHONPATH and set TEST_UPLOAD_DIR=DIR. Every commit appends {"name", "t"} to DIR/commits.jsonl.
With TEST_UPLOAD_HOLD=NAME (a checkpoint's name) or #N (the launch's N-th upload), that upload stops after its first
file is stored: it writes the checkpoint's name to DIR/held and waits until DIR/release exists (the test meanwhile
stops the store, kills the run, ...). With TEST_UPLOAD_PACE=NAME, a rank's save of any later checkpoint first waits
(up to 300 s) until NAME is committed: the uploader follows `last`, so without it a fast run can publish the next
checkpoint before the first upload starts and NAME is (rightly) never uploaded. The hook wraps store/remote_run.py's
RemoteRun and train/manager.py's CheckpointManager.save when those modules are imported; other processes are untouched.
"""

from __future__ import annotations

import os


def _wrap(module) -> None:
    import json
    import time
    from pathlib import Path

    where = Path(os.environ["TEST_UPLOAD_DIR"])
    hold = os.environ.get("TEST_UPLOAD_HOLD") or ""
    upload, commit = module.RemoteRun.upload, module.RemoteRun.commit
    uploads = []

    def held_upload(self, name, files, manifest, *, progress=lambda n: None, **kwargs):
        if name not in uploads:
            uploads.append(name)
        chosen = hold == f"#{uploads.index(name) + 1}" if hold.startswith("#") else hold == name
        if not chosen or (where / "held").exists():
            return upload(self, name, files, manifest, progress=progress, **kwargs)
        first = [True]

        def after_each(n):
            progress(n)
            if first[0]:
                first[0] = False
                (where / "held").write_text(name)
                while not (where / "release").exists():
                    time.sleep(0.05)

        return upload(self, name, files, manifest, progress=after_each, **kwargs)

    def recorded_commit(self, name, *args, **kwargs):
        commit(self, name, *args, **kwargs)
        with open(where / "commits.jsonl", "a") as f:
            f.write(json.dumps({"name": name, "t": time.time()}) + "\n")

    module.RemoteRun.upload, module.RemoteRun.commit = held_upload, recorded_commit


def _pace(module) -> None:
    import time
    from pathlib import Path

    commits = Path(os.environ["TEST_UPLOAD_DIR"]) / "commits.jsonl"
    first = os.environ["TEST_UPLOAD_PACE"]
    save = module.CheckpointManager.save

    def paced_save(self, step, *args, **kwargs):
        deadline = time.time() + 300
        while step > int(first) and time.time() < deadline and not (commits.exists() and f'"{first}"' in commits.read_text()):
            time.sleep(0.1)
        return save(self, step, *args, **kwargs)

    module.CheckpointManager.save = paced_save


def _install() -> None:
    import importlib.abc
    import sys

    wrappers = {"opentau_cli.store.remote_run": _wrap}
    if os.environ.get("TEST_UPLOAD_PACE"):
        wrappers["opentau_cli.train.manager"] = _pace

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name not in wrappers:
                return None
            wrap = wrappers.pop(name)
            import importlib.util

            sys.meta_path.remove(self)  # find the real spec, then listen again for the other module
            try:
                spec = importlib.util.find_spec(name)
            finally:
                if wrappers:
                    sys.meta_path.insert(0, self)
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                wrap(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


if os.environ.get("TEST_UPLOAD_DIR"):
    _install()
