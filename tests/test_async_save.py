"""checkpoint.async_save: a save blocks training only while the state is copied into host memory; writing runs in a
writer process, the manifest and the publish in a background thread, and every promise of the synchronous save still holds
(tests/test_checkpoint_faults.py runs its SIGKILL and disk-full matrix in both modes).

In-process tests drive the real CheckpointManager over a real single-process CPU Accelerator; the end-to-end tests
launch the installed CLI on 2 processes (DeepSpeed ZeRO-2 and DDP)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import EXAMPLES, opentau_bin, own_cache, run_cli, run_cli_in_process
from opentau_cli.errors import RunError
from opentau_cli.store import faults
from opentau_cli.store.layout import (
    CHECKPOINTS, LAST, METRICS, TRAINING_STATE, ds_shard_glob, leftover_of, read_last, step_of,
)
from opentau_cli.store.manifest import hash_file, is_complete, verify_manifest
from opentau_cli.store.runs import latest
from opentau_cli.train.async_save import HostStaging, snapshot
from opentau_cli.train.manager import CheckpointManager

pytestmark = [pytest.mark.full, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]  # slow: starts first (conftest.py)


class Parts:
    """A model, AdamW and a schedule prepared by a real single-process CPU Accelerator, and one training step whose
    input is drawn from the global RNG (so a restored RNG state shows in the next step)."""

    def __init__(self):
        from accelerate import Accelerator

        self.acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
        self.model, self.optimizer, self.scheduler = self.acc.prepare(model, optimizer, scheduler)

    def step(self) -> None:
        loss = self.model(torch.randn(8, 64)).pow(2).mean()
        self.acc.backward(loss)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def manager(self, run_dir: Path, **kw) -> CheckpointManager:
        return CheckpointManager(self.acc, run_dir, total_steps=100, run_id="r1", async_save=True, **kw)


@pytest.fixture
def parts():
    from accelerate.state import AcceleratorState, GradientState

    made = Parts()
    made.step()  # AdamW's state exists from the first step on
    yield made
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def hooks(monkeypatch):
    """The save's named fault points (opentau_cli.store.faults), for this test only."""
    installed: list = []
    monkeypatch.setattr(faults, "hooks", installed)
    return installed


def save(m: CheckpointManager, step: int) -> Path:
    return m.save(step, config={"steps": 100, "resume": False}, state={"step": step})


def files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_async_files_are_save_states_files_as_of_the_snapshot_even_when_written_after_the_next_step(parts, tmp_path):
    parts.acc.save_state(str(tmp_path / "sync"), safe_serialization=True)
    writes = snapshot(parts.acc, tmp_path / "async", HostStaging(), {})
    parts.step()  # the live weights, AdamW moments, schedule and RNG move on before anything is written
    for write in writes:
        write()
    sync, written = files(tmp_path / "sync"), files(tmp_path / "async")
    assert sorted(written) == sorted(sync)  # Accelerate's own file names
    for name in sync:
        if name.endswith(".safetensors"):
            assert written[name] == sync[name], name  # byte for byte
        else:  # torch.save's zip names its records after the file (here "archive"): the same objects inside
            assert_same(torch.load(tmp_path / "async" / name, weights_only=False),
                        torch.load(tmp_path / "sync" / name, weights_only=False), name)


def assert_same(a, b, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif type(a).__module__ == "numpy":
        assert (a == b).all(), where
    else:
        assert a == b, where


def test_load_state_of_an_async_checkpoint_continues_exactly_as_the_run_did(parts, tmp_path):
    m = parts.manager(tmp_path / "run")
    ckpt = save(m, 1)
    parts.step()
    continued = parts.weights()  # one step after the snapshot
    parts.step()
    m.wait()
    assert verify_manifest(ckpt) == [] and read_last(ckpt.parent) == ckpt.name
    m.load(ckpt)  # accelerator.load_state: weights, AdamW, schedule, RNG of the snapshot
    parts.step()
    for a, b in zip(parts.weights(), continued):
        assert torch.equal(a, b)


def test_the_next_save_waits_until_the_one_in_flight_is_published(parts, tmp_path, hooks):
    release = threading.Event()
    hooks.append(lambda name, path: release.wait(60) if name == "state_saved" and "000001" in path.name else None)
    m = parts.manager(tmp_path / "run")
    first = save(m, 1)  # its writer now waits at state_saved
    assert not is_complete(first)
    threading.Timer(0.5, release.set).start()
    save(m, 2)  # returns only once step 1 is published
    assert is_complete(first) and verify_manifest(first) == []
    saving = [p for p in first.parent.iterdir() if leftover_of(p.name) is not None]
    assert len(saving) <= 1  # at most one save in flight
    m.wait()
    assert read_last(first.parent) == "000002"


def test_a_failed_background_write_stops_the_run_at_a_later_step_and_keeps_the_previous_checkpoint(parts, tmp_path, hooks):
    def disk_full(name: str, path: Path) -> None:
        if name == "state_saved" and "000002" in path.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    hooks.append(disk_full)
    m = parts.manager(tmp_path / "run")
    save(m, 1)
    save(m, 2)
    with pytest.raises(RunError) as e:
        for _ in range(10_000):  # the train loop polls after every step; the failure shows at the first poll after it
            parts.step()
            m.poll()
    message = str(e.value)
    assert "step 2" in message and "disk is full" in message and "000001 is intact" in message
    root = tmp_path / "run" / CHECKPOINTS
    assert sorted(p.name for p in root.iterdir()) == ["000001", LAST]  # the temp dir of step 2 is gone
    assert verify_manifest(root / "000001") == [] and read_last(root) == "000001"


def test_every_named_fault_point_is_reached_in_the_background_writer_in_order(parts, tmp_path, hooks):
    m = parts.manager(tmp_path / "run", keep_last=1)
    save(m, 10)
    m.wait()
    reached = []
    hooks.append(lambda name, path: reached.append((name, threading.current_thread().name)))
    save(m, 10)  # over an existing step: the stale one is hidden, then deleted
    save(m, 20)  # keep_last=1: step 10 is hidden, then deleted
    m.wait()
    first, second = reached[:7], reached[7:]
    assert [name for name, _ in first] == [name for name, _ in second] == [
        "state_saved", "json_synced", "json_synced", "json_synced", "publishing", "published", "retiring"]
    assert list(dict.fromkeys(name for name, _ in reached)) == list(faults.POINTS)
    assert {thread for _, thread in first} == {"checkpoint-10"} and {thread for _, thread in second} == {"checkpoint-20"}


def test_the_snapshot_is_one_exact_size_buffer_reused_by_every_save_and_its_size_is_what_is_reported(parts, tmp_path):
    import mmap

    staging = HostStaging()
    shared = torch.ones(3)
    weights, opt = parts.model.state_dict(), parts.optimizer.state_dict()

    def take() -> tuple:  # one snapshot of two files, as snapshot() takes them
        staging.begin()
        files = staging.copy({"w": weights, "tied": [shared, shared]}), staging.copy(opt)
        staging.end()
        return files[0].value, files[1].value

    first, first_opt = take()
    tensors = list(weights.values()) + [t for s in opt["state"].values() for t in s.values()] + [shared]
    assert {t.dtype for t in tensors} == {torch.float32}  # no alignment padding between fp32 tensors
    copied = sum(t.numel() * t.element_size() for t in tensors)  # the tied tensor once
    pages = -(-copied // mmap.PAGESIZE) * mmap.PAGESIZE
    arena = staging._arena
    assert staging.tensor_bytes == copied and arena.size == len(arena.map) == pages
    assert staging.nbytes == pages + HostStaging.BOUNCE  # the one buffer and the writer's one aligned buffer
    assert f"buffer of {copied} bytes of tensors rounded up to {pages} (whole pages)" in staging.describe()
    base = torch.frombuffer(arena.map, dtype=torch.uint8).data_ptr()
    copies = list(first["w"].values()) + [t for s in first_opt["state"].values() for t in s.values()]
    assert all(base <= t.data_ptr() < base + copied for t in copies)  # both files' copies lie in that one buffer
    assert first["tied"][0] is first["tied"][1]  # one tensor saved twice is one copy, as torch.save stores it
    parts.step()
    second, _ = take()
    assert staging._arena is arena  # the same buffer, filled again
    for key, t in first["w"].items():
        assert second["w"][key].data_ptr() == t.data_ptr() != weights[key].data_ptr()
        assert torch.equal(second["w"][key], parts.model.state_dict()[key])


def test_on_cuda_the_one_buffer_is_pinned_whole_once_and_unpinned_when_replaced(monkeypatch):
    """No GPU here: cudaHostRegister / Unregister are recorded, what they are asked for is checked (address, size)."""
    from opentau_cli.train import async_save

    calls = []
    monkeypatch.setattr(async_save, "_pin", lambda buf, size: calls.append(("pin", async_save._address(buf), size)) or True)

    class Cudart:
        def cudaHostUnregister(self, address):
            calls.append(("unpin", address))

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    staging = HostStaging(pin=True)
    for state in ({"a": torch.ones(1000)}, {"a": torch.ones(1000)}, {"a": torch.ones(5000)}):
        staging.begin()
        staging.copy(state)
        staging.end()
    first = ("pin", calls[0][1], 4096)
    assert calls[0] == first and calls[1] == ("unpin", first[1])  # one pinned buffer, reused by the second save
    assert calls[2][0] == "pin" and calls[2][2] == 20480 and len(calls) == 3 and staging._arena.pinned
    assert "one pinned buffer of 20000 bytes of tensors rounded up to 20480" in staging.describe()


def test_a_writer_process_that_died_fails_the_save_and_keeps_the_previous_checkpoint(parts, tmp_path):
    m = parts.manager(tmp_path / "run")
    save(m, 1)
    m.wait()
    writer = m._staging._writer  # the files were written by a process of their own
    assert writer is not None and writer._proc.pid != os.getpid() and m._staging.stats
    writer._proc.kill()
    writer._proc.wait()
    save(m, 2)
    with pytest.raises(RunError) as e:
        m.wait()
    assert "step 2" in str(e.value) and "writer process ended" in str(e.value) and "000001 is intact" in str(e.value)
    root = tmp_path / "run" / CHECKPOINTS
    assert sorted(p.name for p in root.iterdir()) == ["000001", LAST] and verify_manifest(root / "000001") == []


@pytest.mark.parametrize("o_direct", [True, False])
def test_uncached_files_hold_exactly_the_bytes_written_with_or_without_o_direct(tmp_path, monkeypatch, o_direct):
    from opentau_cli.train.async_save import UncachedFile

    if not o_direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)  # as on a system without it: the ordinary way
    pieces = [os.urandom(n) for n in (1, 4095, 4097, HostStaging.BOUNCE + 3, 0, 10)]
    with UncachedFile(tmp_path / "f.bin", HostStaging().bounce) as f:
        for piece in pieces:
            f.write(memoryview(piece))
        assert f._direct == (o_direct and hasattr(os, "O_DIRECT"))
    assert (tmp_path / "f.bin").read_bytes() == b"".join(pieces)
    assert f.result() == (tmp_path / "f.bin", len(b"".join(pieces)), hash_file(tmp_path / "f.bin"))  # as the manifest


def test_the_report_names_the_host_memory_once_and_each_published_checkpoint(parts, tmp_path):
    lines = []
    m = parts.manager(tmp_path / "run", report=lines.append)
    save(m, 1)
    save(m, 2)
    m.wait()
    staging = m._staging
    assert len(lines) == 3 and lines[0] == (
        f"Asynchronous saves: rank 0 copies the state into {staging.nbytes / 2**20:.0f} MiB of host memory: one buffer "
        f"of {staging.tensor_bytes} bytes of tensors rounded up to {staging._arena.size} (whole pages), and a 16 MiB "
        "write buffer, kept for the next saves."), lines
    assert lines[1:] == [f"Saved checkpoint {tmp_path / 'run' / CHECKPOINTS / n}" for n in ("000001", "000002")]


# End to end: the installed CLI on 2 CPU processes, the pi05_tiny preset, async_save on.

TINY = str(EXAMPLES / "pi05_tiny_config.json")
ZERO2 = str(EXAMPLES / "accelerate_cpu_deepspeed_config.yaml")
DDP = str(EXAMPLES / "accelerate_cpu_ddp_config.yaml")
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
STEPS = 6
ZERO2_STEPS = 3


def train_args(out: Path, accelerate_config: str, *extra: str) -> list[str]:
    return ["train", f"--config_path={TINY}", f"--output_dir={out}", f"--accelerate-config={accelerate_config}",
            "--steps", str(STEPS), "--save_freq", "2", "--log_freq", "1", "--batch_size", "4",
            "--scheduler.warmup_steps", "2", "--checkpoint.async_save=true", *extra]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def step_dirs(ckpts: Path) -> list[str]:
    return sorted(d.name for d in ckpts.iterdir() if step_of(d.name) is not None)


def launch(args: list[str], env: dict, **hook: str) -> subprocess.CompletedProcess:
    """The CLI as its own session (the kill hook finds the launcher by that), with the hook's variables if any."""
    full = {**os.environ, **env, **({"PYTHONPATH": str(HOOKS), **hook} if hook else {})}
    full.pop("OPENTAU_DEBUG", None)
    return subprocess.run([opentau_bin(), *args], env=full, capture_output=True, text=True, timeout=900,
                          start_new_session=True)


@pytest.fixture(scope="module")
def e2e_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_e2e")
    # Its own demo dataset: runs compared with each other read the same data whatever happens to the shared cache.
    return tmp, {"HF_HOME": str(tmp / "hf_home"), "OPENTAU_CACHE_DIR": own_cache(tmp / "cache")}


def logged(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every train record in the order written: a resumed run appends to its predecessor's."""
    records = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def zero2(e2e_env):
    """A ZeRO-2 run of 3 steps saving after each, with async saves, SIGKILLed whole while rank 1's background writer
    has just written its shard of step 2 (cut in half), as it was on disk then; then its resume from step 1, which
    runs to the end. (As few steps as show it: two launches of 2 ranks are most of its cost.)"""
    tmp, env = e2e_env
    killed = tmp / "killed"
    proc = launch(train_args(killed, ZERO2, "--steps", str(ZERO2_STEPS), "--save_freq", "1", "--checkpoint.keep_last",
                             "2"), env, TEST_KILL_AT="mid_file@2", TEST_KILL_RANK="1")
    assert proc.returncode == -signal.SIGKILL, f"not killed\n{proc.stderr[-3000:]}"
    ckpts = killed / CHECKPOINTS
    after_kill = {
        "steps": step_dirs(ckpts),
        "sound": [d for d in step_dirs(ckpts) if is_complete(ckpts / d) and verify_manifest(ckpts / d) == []],
        "latest": latest(killed),
        "leftovers": {leftover_of(p.name): p for p in ckpts.iterdir() if p.name.startswith(".")},
        "verify": run_cli_in_process(["checkpoint", "verify", str(killed)], env=env).returncode,  # launches nothing
        "logged": logged(killed),
    }
    after_kill["cut_shard"] = [p.name for p in after_kill["leftovers"].get(("save", "000002"), tmp).rglob(
        ds_shard_glob("optim", rank=1))]
    resumed = run_cli(["resume", str(killed)], env=env)
    ok(resumed)
    return {"killed": killed, "after_kill": after_kill, "resumed": resumed}


@pytest.mark.e2e
def test_async_zero2_run_publishes_every_save_with_both_ranks_shards_and_the_last_before_it_exits(zero2):
    ckpts = zero2["killed"] / CHECKPOINTS  # the resumed run's saves 2 and 3 (its last), beside its source 1
    assert step_dirs(ckpts) == ["000001", "000002", "000003"] and read_last(ckpts) == "000003"
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]  # the killed save's leftover removed
    for name in step_dirs(ckpts):
        assert verify_manifest(ckpts / name) == [], name
        assert json.loads((ckpts / name / TRAINING_STATE).read_text())["step"] == int(name)
        for rank in (0, 1):
            assert list((ckpts / name).rglob(ds_shard_glob("optim", rank))), (name, rank)
    assert sorted(losses(zero2["killed"])) == list(range(1, ZERO2_STEPS + 1))


@pytest.mark.e2e
def test_sigkill_during_a_background_write_keeps_previous_checkpoints_and_the_resume_is_exact(zero2):
    after = zero2["after_kill"]
    # Save 2 was being written (rank 1's shard cut in half in its temp dir); save 1 was published before it began.
    assert list(after["leftovers"]) == [("save", "000002")] and after["cut_shard"], after
    assert after["steps"] == after["sound"] == ["000001"] and after["latest"].name == "000001"
    assert after["verify"] == 0
    # The killed run logged steps 1-2 (the kill came in save 2); the resume from step 1 cuts the log back to step 1
    # and logs 2-3 again: its step 2 is the killed run's, to the bit (same ranks, same backend).
    before = dict(after["logged"])
    assert [step for step, _ in after["logged"]] == [1, 2]
    resumed = dict(logged(zero2["killed"]))
    assert [step for step, _ in logged(zero2["killed"])] == [1, 2, 3]
    assert resumed[2] == before[2]
    ckpts = zero2["killed"] / CHECKPOINTS
    # keep_last=2, and the checkpoint the run resumed from is never deleted; leftovers removed.
    assert sorted(p.name for p in ckpts.iterdir()) == ["000001", "000002", "000003", LAST]


@pytest.mark.e2e
def test_sigterm_while_a_save_is_in_the_background_waits_for_it_and_for_the_preemption_save(e2e_env):
    tmp, env = e2e_env
    run = tmp / "preempted"
    # SIGTERM reaches the launcher while rank 0's writer is in the middle of save 2 (its part written, no records yet).
    proc = launch(train_args(run, DDP, "--steps", "12"), env, TEST_KILL_AT="before_metadata@2", TEST_KILL_SIGNAL="SIGTERM")
    ok(proc)
    assert "Preempted" in proc.stdout + proc.stderr
    ckpts = run / CHECKPOINTS
    saved = step_dirs(ckpts)
    assert saved[0] == "000002" and 2 < int(saved[-1]) < 12, saved
    for name in saved:  # both published before the processes left
        assert verify_manifest(ckpts / name) == [], name
    assert json.loads((ckpts / saved[-1] / TRAINING_STATE).read_text())["step"] == int(saved[-1])
    assert read_last(ckpts) == saved[-1] and not [p for p in ckpts.iterdir() if p.name.startswith(".")]


def test_the_benchmark_arithmetic_on_canned_numbers():
    """benchmarks/bench_async_save.py: time lost per save, the ratios of each round, and CPU seconds per GB."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_async_save import cpu_per_gb, lost_per_save, swung_rounds

    seg = {"none": [(10.0, 0, 0, 0), (12.0, 0, 0, 0), (11.0, 0, 0, 0)],
           "sync": [(14.0, 2, 0, 0), (16.0, 2, 0, 0), (13.0, 2, 0, 0)],
           "async": [(11.0, 0.5, 0, 0), (12.5, 0.5, 0, 0), (13.5, 0.5, 0, 0)]}
    paired, lost, per_round = lost_per_save(seg)
    assert paired == {"sync": [4.0, 4.0, 2.0], "async": [1.0, 0.5, 2.5]}
    assert lost == {"sync": 4.0, "async": 1.0}
    assert per_round == [0.25, 0.125, 1.25]
    assert swung_rounds(seg, lost["sync"]) == []  # no-save segments 10, 12, 11: within 4 s of their median 11
    assert swung_rounds(seg, 0.75) == [1, 2]  # a save costing 0.75 s: rounds 1 and 2 moved 1 s
    rows = dict(cpu_per_gb({"cpu": {"sync": [(1.5, 5e8), (2.5, 5e8)], "async": [(0.25, 5e8)]},
                            "writer": [{"bytes": 5e8, "cpu": 1.0, "hash": 0.125, "copy": 0.125, "write": 0.25}] * 2}))
    assert rows["save CPU per GB, sync (training thread: serialize, write, hash for the manifest)"] == "4.00 CPU-s/GB"
    assert rows["save CPU per GB, async copy into host memory (training thread, blocks the loop)"] == "0.50 CPU-s/GB"
    assert rows["save CPU per GB, async writer process"] == (
        "2.00 CPU-s/GB: hashing 0.25, copying into the write buffer 0.25, write and sync calls 0.50, serializing and "
        "the rest 1.00 (1.00 GB in 2 files)")
