"""Several machines that share no disk, only the store (docs/ARCHITECTURE.md, "Remote checkpoints"): one run on two
"machines" on loopback, each with a run directory (and HOME, cache) of its own, elastic (distributed.machines 1:2),
with checkpoint.remote on the test S3 server. Each machine keeps and uploads its own ranks' part of every checkpoint;
machine 0 commits once every part is in the store. Machine 1 is lost with its disk mid-run: machine 0's group re-forms
alone from the store's last checkpoint (the lost machine's part downloaded); machine 1 comes back with an empty disk
(`opentau resume URL --machine_rank 1`), downloads what its ranks need and is admitted. One launch serves every
assertion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    DDP_REFERENCE_ARGS,
    DDP_REFERENCE_SAVE,
    DDP_REFERENCE_STEPS,
    EXAMPLES,
    elastic_machines_args,
    own_cache,
)
from test_elastic_machines import start, train_losses

from opentau_cli.store.layout import CHECKPOINTS, LOGS, MANIFEST

STEPS, SAVE = DDP_REFERENCE_STEPS, DDP_REFERENCE_SAVE  # 6, 3
LEAVES_AT = 5
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow]


def machine_env(root: Path, server) -> dict:
    """A machine of its own: HOME and opentau's cache on its disk, the store's endpoint and keys in its environment."""
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **server.env, "HOME": str(root / "home"), "HF_HOME": str(root / "home" / "hf"),
           "OPENTAU_CACHE_DIR": own_cache(root / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("OPENTAU_DEBUG", None)
    return env


@pytest.fixture(scope="module")
def machines(tmp_path_factory, ddp_reference, s3_server):
    from opentau_cli.store.remote_run import RemoteRun
    from opentau_cli.store.storage import open_storage

    tmp = tmp_path_factory.mktemp("machines")
    url = s3_server.url("runs/machines")
    disk0, disk1 = tmp / "disk0", tmp / "disk1"
    run0, run1 = disk0 / "run", disk1 / "run"
    settings = [*elastic_machines_args(), f"--checkpoint.remote={url}", "--checkpoint.remote_drain_seconds=60"]
    hook = {"PYTHONPATH": str(HOOKS), "TEST_FAULT_RANK": "any"}
    env0 = machine_env(disk0, s3_server)
    os.environ.update(s3_server.env)  # this process reads the store too (the variables are the session server's)
    machine0 = start(["train", f"--output_dir={run0}", *DDP_REFERENCE_ARGS, *settings, "--machine_rank=0"],
                     {**env0, **hook, "TEST_FAULT": f"hold@{LEAVES_AT}:1"}, tmp / "machine0")
    time.sleep(1)  # machine 0 first: it hosts the rendezvous
    # Machine 1 is lost as step 5 starts, once checkpoint 3 is committed in the store (both machines' parts of it
    # uploaded: on two busy cores the niced uploads may lag the steps).
    committed = tmp / "checkpoint-3-committed"
    machine1 = start(["train", f"--output_dir={run1}", *DDP_REFERENCE_ARGS, *settings, "--machine_rank=1"],
                     {**machine_env(disk1, s3_server), **hook, "TEST_FAULT": f"machine@{LEAVES_AT}:0",
                      "TEST_FAULT_AFTER": str(committed)}, tmp / "machine1")
    remote = RemoteRun(open_storage(url))
    deadline = time.monotonic() + 600
    while remote.last() != f"{SAVE:06d}" and machine1.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    committed.touch()
    left = machine1.wait(timeout=600)

    def part(run: Path) -> list[str]:
        return sorted(p.relative_to(run / CHECKPOINTS / f"{SAVE:06d}").as_posix()
                      for p in (run / CHECKPOINTS / f"{SAVE:06d}").rglob("*") if p.is_file())

    part0, part1 = part(run0), part(run1)  # each machine's part of checkpoint 3, before machine 0 downloads the rest
    shutil.rmtree(disk1)  # machine 1 is lost with its disk
    restarts = run0 / LOGS / "restarts.jsonl"
    deadline = time.monotonic() + 300
    while not restarts.is_file() and machine0.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    # Machine 1 comes back with an empty disk (another HOME, cache, run directory) and joins from the store.
    back_env = machine_env(tmp / "disk1-new", s3_server)
    back = start(["resume", url, f"--output_dir={tmp / 'disk1-new' / 'run'}",
                  f"--accelerate-config={EXAMPLES / 'accelerate_cpu_ddp_config.yaml'}", *settings, "--machine_rank=1"],
                 back_env, tmp / "machine1_back")
    done = machine0.wait(timeout=900), back.wait(timeout=900)
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout.split()
    logs = {name: "\n".join(p.read_text() for p in sorted(root.glob(f"{LOGS}/*/uploads.log")))
            for name, root in (("machine0", run0), ("machine1_back", tmp / "disk1-new" / "run"))}
    return {"tmp": tmp, "url": url, "run0": run0, "run1_back": tmp / "disk1-new" / "run", "left": left, "done": done,
            "leftover": leftover, "part0": part0, "part1": part1, "uploads": logs, "reference": dict(train_losses(ddp_reference)),
            "console": (tmp / "machine0.out").read_text() + (tmp / "machine0.err").read_text(),
            "back_err": (tmp / "machine1_back.out").read_text() + (tmp / "machine1_back.err").read_text(),
            "restarts": [json.loads(line) for line in restarts.read_text().splitlines()] if restarts.is_file() else []}


def test_a_machine_lost_with_its_disk_and_back_with_an_empty_one_leaves_every_step_logged_once(machines):
    assert machines["left"] == -9  # machine 1's command was SIGKILLed with its agent and ranks
    assert machines["done"] == (0, 0), machines["console"][-3000:] + machines["back_err"][-3000:]
    assert [step for step, _ in train_losses(machines["run0"])] == list(range(1, STEPS + 1))
    assert machines["leftover"] == []


def test_the_losses_before_the_loss_equal_the_uninterrupted_runs(machines):
    losses = dict(train_losses(machines["run0"]))
    assert [losses[s] for s in range(1, SAVE + 1)] == [machines["reference"][s] for s in range(1, SAVE + 1)]


def test_each_machine_keeps_and_uploads_its_own_part_and_machine_0_commits_the_whole(machines, s3, tmp_path):
    from opentau_cli.store.manifest import verify_manifest
    from opentau_cli.store.remote_run import RemoteRun
    from opentau_cli.store.storage import open_storage

    # Before machine 1 was lost, each machine held its own rank's part of checkpoint 3 (and the same manifest): the
    # two parts make the whole, and only the store held all of it.
    part0, part1 = set(machines["part0"]) - {MANIFEST}, set(machines["part1"]) - {MANIFEST}
    remote = RemoteRun(open_storage(machines["url"]))
    assert MANIFEST in machines["part0"] and MANIFEST in machines["part1"]
    assert part0 and part1 and not part0 & part1
    assert part0 | part1 == set(remote.manifest(f"{SAVE:06d}")["files"])
    uploads = machines["uploads"]["machine0"] + machines["uploads"]["machine1_back"]
    assert "This machine's part of checkpoint" in uploads and f"Checkpoint {STEPS:06d} is stored in" in uploads
    assert remote.last() == f"{STEPS:06d}"
    whole = remote.fetch(f"{STEPS:06d}", tmp_path / "copy")
    assert verify_manifest(whole) == []  # every rank's file of every machine, each at its hash
    manifest = json.loads((whole / MANIFEST).read_text())
    assert sorted(manifest["rank_files"]) == ["0", "1"]


def test_the_group_re_forms_alone_from_the_store_then_with_the_machine_that_came_back(machines):
    first, second = machines["restarts"][:2]
    assert (first["machine"], first["world_before"], first["world"], first["resumed_from"]) == (1, 2, 1, f"{SAVE:06d}")
    assert (second["regroup"], second["world_before"], second["world"]) == ("machines joined: 2 processes now, 1 before", 1, 2)
    assert second["resumed_from"] == f"{LEAVES_AT:06d}"
    assert "Downloading checkpoint" in machines["back_err"]


def test_a_machine_joining_a_group_of_the_same_world_downloads_the_ema_its_ranks_load(ddp_reference):
    """The same world re-formed (machine 1 back before the smaller group saved): machine 1's rank loads the DDP run's
    whole EMA, which rank 0 wrote, so it is among the files machine 1 downloads; rank 0's RNG state is not."""
    from opentau_cli.store.remote_run import files_for

    manifest = json.loads((ddp_reference / CHECKPOINTS / f"{SAVE:06d}" / MANIFEST).read_text())
    chosen = {rel for rel in manifest["files"] if files_for(manifest, {1})(rel)}
    assert "ema.safetensors" in manifest["files"]
    assert "ema.safetensors" in chosen
    assert "random_states_1.pkl" in chosen and "random_states_0.pkl" not in chosen
