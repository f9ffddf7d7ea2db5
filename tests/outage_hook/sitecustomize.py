"""Test-only: take the S3 server of a test away at a moment when a real `opentau train` reads a dataset file.

Put this directory on PYTHONPATH and set TEST_OUTAGE_DIR=DIR. Whenever DIR/arm exists, the next download of a dataset
file by any process of the launch (a rank or a data worker) claims the outage: it creates DIR/request, then waits
until the test has stopped the server (DIR/down) and goes on with the download, which then meets the store gone.
What happens from there (retries, waiting, giving up) is the product's own. Python processes without the variable
are untouched. Python reads one sitecustomize: this one also installs tests/sample_hook's (TEST_RECORD_SAMPLES).
"""

from __future__ import annotations

import os
import time


def _install(directory: str) -> None:
    from opentau_cli.data.remote import RemoteFiles

    download = RemoteFiles._download

    def outage_first(self, rel, pin, out):
        arm = os.path.join(directory, "arm")
        if os.path.exists(arm):
            try:
                os.rename(arm, os.path.join(directory, f"claimed-{os.getpid()}"))  # one process claims each arming
            except OSError:
                pass
            else:
                with open(os.path.join(directory, "request"), "w") as f:
                    f.write(rel)
                while not os.path.exists(os.path.join(directory, "down")):
                    time.sleep(0.05)
        return download(self, rel, pin, out)

    RemoteFiles._download = outage_first


if os.environ.get("TEST_OUTAGE_DIR"):
    _install(os.environ["TEST_OUTAGE_DIR"])
if os.environ.get("TEST_RECORD_SAMPLES"):
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_hook",
                                "sitecustomize.py"))
