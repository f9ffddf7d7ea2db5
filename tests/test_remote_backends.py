"""Remote checkpoints under the sharded backends (tests/test_remote_e2e.py has the single-process and DDP runs, the
faults and the tools): ZeRO-2, ZeRO-3 and FSDP2 runs upload their checkpoints, and a machine with an empty disk
resumes the store's step 2 (`URL:2 --rollback=true`) with losses == the uninterrupted run's; consolidation reads a
ZeRO-2 checkpoint from the store into a directory of the user's, never into the store."""

from __future__ import annotations

import pytest

from conftest import refused, run_cli_in_process
from remote_runs import backend_runs, ok

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]


@pytest.fixture(scope="module")
def backends(tmp_path_factory, s3_server):
    return backend_runs(tmp_path_factory, s3_server)


@pytest.mark.parametrize("backend", ["zero2", "zero3", "fsdp2"])
def test_a_sharded_run_resumed_from_the_store_on_an_empty_disk_logs_the_uninterrupted_losses(backends, backend):
    b = backends(backend)
    assert b.committed_after_a == ["000002", "000004"]
    assert sorted(b.full) == [1, 2, 3, 4] and sorted(b.resumed) == [1, 2, 3, 4]
    assert b.resumed == b.full  # exact: steps 3 and 4 logged again after the resume, 1 and 2 from the store's history


def test_consolidate_writes_a_zero2_checkpoint_of_the_store_into_a_directory_and_never_into_the_store(backends, s3, tmp_path, monkeypatch):
    zero2 = backends("zero2")
    monkeypatch.setenv("OPENTAU_CACHE_DIR", str(tmp_path / "cache"))
    merged = run_cli_in_process(["checkpoint", "consolidate", f"{zero2.url}:4", "--output", str(tmp_path / "merged")])
    ok(merged)
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    refused(run_cli_in_process(["checkpoint", "consolidate", f"{zero2.url}:4"]), "pass --output DIR")
