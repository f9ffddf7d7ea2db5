"""A dataset in object storage through the installed CLI, against a real S3 server (SeaweedFS) of this module's own:
2-rank DDP runs of the tiny preset on a video dataset held in the store and the same files on local disk.

Four launches, shared by every assertion (module-scoped): the uninterrupted run from local disk; the run from the
store, with the cache capped below the dataset, during which the store goes away twice (tests/hooks picks the
moment a rank or data worker fetches a file, this test stops the server): for 5 s (training waits, then continues),
and two steps later until the run gives up (dataset.remote_wait_seconds: one sentence, a checkpoint, exit 1); its resume on 2 ranks
once the store is back; and a resume of the same checkpoint on 1 process (--reshard=true). Every launch records the
frames it reads (tests/hooks). A fifth launch reads the real g1 dataset from the store with one video cut short.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import EXAMPLES, SINGLE_PROCESS_ENV, own_cache, run_cli
from s3_server import ACCESS_KEY, SECRET_KEY, S3Server
from test_data_remote import on_disk, upload

from opentau_cli.data import write_synth
from opentau_cli.store.layout import CHECKPOINTS, LOGS, METRICS

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

TINY = str(EXAMPLES / "pi05_tiny_config.json")
DDP = str(EXAMPLES / "accelerate_cpu_ddp_config.yaml")
HOOKS = Path(__file__).parent / "hooks"  # the fault-injection helper: its variables choose the hooks
STEPS, PER_DEVICE, RANKS = 12, 4, 2
WAIT = 15  # dataset.remote_wait_seconds of the run from the store
CAP_GB = 0.0003  # its meta/ and about half of the data and video files: files are evicted and fetched again
SINGLE_YAML = "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\nnum_machines: 1\nmixed_precision: 'no'\n"


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / METRICS).read_text().splitlines()) if r.get("kind") == "train"}


def steps_read(record: Path, ranks: int, per_device: int, first: int, count: int) -> dict[int, list[int]]:
    """The frames each optimizer step read, all ranks together (sorted), for `count` steps from step `first`; a data
    worker reads ahead of training, so a record may run past the last step trained."""
    per_rank = [[int(x) for x in (record / f"rank{r}.txt").read_text().split()] for r in range(ranks)]
    return {first + s: sorted(i for p in per_rank for i in p[s * per_device:(s + 1) * per_device]) for s in range(count)}


class Runs:
    def __init__(self, tmp: Path, server: S3Server):
        """`server`: the session's (tests/conftest.py s3_server), taken away and brought back by this module's runs;
        the tests of one pytest worker run one at a time, so nothing else uses it meanwhile."""
        self.tmp, self.server = tmp, server
        try:
            self.launch()
        finally:
            if self.server.proc.poll() is not None:  # the store comes back for the modules after this one
                self.server.start()

    def launch(self) -> None:
        tmp = self.tmp
        self.dataset = write_synth(tmp / "reach", episodes=40, steps_per_episode=10, video=True, seed=5)
        self.url = upload(self.server, self.dataset, f"e2e-{os.getpid()}/reach")
        self.cache = tmp / "opentau_cache"
        common = [f"--config_path={TINY}", f"--accelerate-config={DDP}", "--steps", str(STEPS), "--save_freq", "6",
                  "--log_freq", "1", "--batch_size", str(PER_DEVICE), "--dataset.num_workers=1",
                  "--scheduler.warmup_steps=2", "--validation.val_split=0", "--validation.val_freq=0"]
        self.ref = tmp / "ref"
        self.reference = self.cli(["train", *common, f"--dataset.root={self.dataset}", f"--output_dir={self.ref}"], "ref")
        self.run = tmp / "store"
        self.peak = [0]
        self.outages = []
        self.stopped = self.cli_with_outages(["train", *common, f"--dataset.root={self.url}", f"--output_dir={self.run}",
                                              f"--dataset.remote_wait_seconds={WAIT}", f"--dataset.cache_max_gb={CAP_GB}"])
        self.stopped_at = int(os.readlink(self.run / CHECKPOINTS / "last"))  # its checkpoint when it gave up
        self.stopped_losses = losses(self.run)
        if self.server.proc.poll() is not None:  # the store comes back
            self.server.start()
        self.copy = tmp / "store_copy"
        shutil.copytree(self.run, self.copy, symlinks=True)
        self.resumed = self.cli(["resume", str(self.run)], "resumed")
        single = tmp / "single.yaml"
        single.write_text(SINGLE_YAML)
        self.resharded = self.cli(["resume", str(self.copy), "--reshard=true", f"--accelerate-config={single}"],
                                  "resharded", env=SINGLE_PROCESS_ENV)

    def env(self, record: str, outage: Path | None = None) -> dict:
        out = self.tmp / "samples" / record
        out.mkdir(parents=True)
        return {**self.server.env, "OPENTAU_CACHE_DIR": own_cache(self.cache), "HF_HOME": str(self.tmp / "hf_home"),
                "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
                "TEST_RECORD_SAMPLES": str(out), "TEST_OUTAGE_DIR": str(outage or "")}

    def cli(self, args: list[str], record: str, env: dict | None = None):
        return run_cli(args, env={**self.env(record), **(env or {})})

    def cli_with_outages(self, args: list[str]):
        """The run from the store; meanwhile the store goes away after step 1 for 5 s, and after step 4 for good
        (until the run has ended), each time at the moment a process of the run fetches a file; the disk the cache
        takes is measured all along."""
        hook = self.tmp / "outage"
        hook.mkdir()
        done = threading.Event()

        def steps() -> int:
            try:
                return max((r["step"] for r in map(json.loads, (self.run / METRICS).read_text().splitlines())
                            if r.get("kind") == "train"), default=0)
            except (OSError, ValueError):
                return 0

        def outage(after: int, seconds: float | None) -> None:
            while steps() < after and not done.is_set():
                time.sleep(0.1)
            (hook / "arm").touch()
            while not (hook / "request").exists() and not done.is_set():
                time.sleep(0.02)
            if done.is_set():
                return
            (hook / "request").unlink()
            self.server.kill()  # gone at once; a clean stop leaves the restarted store slow for seconds
            self.outages.append(steps())
            (hook / "down").touch()
            if seconds is not None:
                time.sleep(seconds)
                (hook / "down").unlink()
                self.server.start()

        def read_again() -> bool:
            return any("the store answers again" in log.read_text() for log in (self.run / LOGS).glob("*/rank*.log"))

        def orchestrate():
            outage(1, 5)
            while not read_again() and not done.is_set():  # the fetch that met the first outage got its file
                time.sleep(0.1)
            outage(steps() + 2, None)  # and the run went on for two more steps

        def measure():
            while not done.is_set():
                self.peak[0] = max(self.peak[0], on_disk(self.cache / "datasets") if (self.cache / "datasets").exists() else 0)
                time.sleep(0.005)

        threads = [threading.Thread(target=orchestrate), threading.Thread(target=measure)]
        for t in threads:
            t.start()
        try:
            return run_cli(args, env=self.env("store", hook))
        finally:
            done.set()
            for t in threads:
                t.join()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, s3_server):
    return Runs(tmp_path_factory.mktemp("remote_data_e2e"), s3_server)


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def test_the_store_away_for_a_while_is_waited_for_and_away_too_long_stops_the_run_with_one_sentence_and_a_checkpoint(runs):
    _ok(runs.reference)
    assert len(runs.outages) == 2, runs.outages  # both outages met a fetch of the run
    failed = runs.stopped
    assert failed.returncode == 1, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    step = runs.stopped_at
    assert f"The store of {runs.url} did not answer for" in errors[0] and "(dataset.remote_wait_seconds)" in errors[0]
    assert f"step {step} is saved; continue with `opentau resume {runs.run}` once the store answers" in errors[0]
    assert runs.outages[1] <= step < STEPS  # saved at the last step trained, after the store went away for good
    logs = "".join(p.read_text() for p in (runs.run / LOGS).glob("*/rank*.log"))
    assert f"retrying for up to {WAIT:g} s (dataset.remote_wait_seconds) while training waits" in logs
    assert "the store answers again" in logs  # the first outage: waited for, then read
    assert sorted(runs.stopped_losses) == list(range(1, step + 1))  # no step skipped, none past the checkpoint


def test_the_run_from_the_store_and_its_resume_log_the_losses_of_the_same_run_from_local_disk(runs):
    _ok(runs.resumed)
    assert losses(runs.run) == losses(runs.ref)  # == : the same samples in the same order, resumed exactly
    assert sorted(losses(runs.ref)) == list(range(1, STEPS + 1))


def test_a_resume_on_another_world_size_reads_exactly_the_samples_of_the_uninterrupted_run(runs):
    _ok(runs.resharded)
    step = runs.stopped_at
    samples = runs.tmp / "samples"
    reference = steps_read(samples / "ref", RANKS, PER_DEVICE, 1, STEPS)
    after = steps_read(samples / "resharded", 1, PER_DEVICE * RANKS, step + 1, STEPS - step)
    assert after == {s: reference[s] for s in range(step + 1, STEPS + 1)}
    assert "per-device batch 4 x accumulation 1 -> per-device batch 8 x accumulation 1" in runs.resharded.stderr
    assert sorted(losses(runs.copy)) == list(range(1, STEPS + 1))


def test_the_cache_never_held_more_than_its_cap_and_no_file_the_runs_wrote_holds_a_credential(runs):
    """Every byte under the module's folder: the runs' directories (logs, checkpoints, configs), the cache, the Hugging
    Face home and what the hooks recorded; the credentials reached the runs by the environment only."""
    cap = round(CAP_GB * (1 << 30))
    assert on_disk(runs.dataset / "data") + on_disk(runs.dataset / "videos") > cap  # the files never all fit
    assert 0 < runs.peak[0] <= cap, runs.peak[0]
    read = 0
    for path in runs.tmp.rglob("*"):
        if path.is_file() and not path.is_symlink():
            body = path.read_bytes()
            read += len(body)
            assert SECRET_KEY.encode() not in body and ACCESS_KEY.encode() not in body, path
    assert read > on_disk(runs.run / CHECKPOINTS) / 2  # the checkpoints' bytes were among those read


def test_a_video_in_the_store_that_fails_to_decode_is_named_by_url_and_never_taken_as_an_end_of_data(runs, g1, tmp_path):
    damaged = tmp_path / "g1"
    shutil.copytree(g1, damaged)
    video = damaged / "videos" / "chunk-000" / "observation.images.cam_high" / "episode_000001.mp4"
    video.chmod(0o644)
    video.write_bytes(video.read_bytes()[:300_000])
    url = upload(runs.server, damaged, f"e2e-{os.getpid()}/g1_damaged")
    out = tmp_path / "run"
    failed = run_cli(["train", f"--config_path={TINY}", f"--dataset.root={url}", f"--output_dir={out}",
                      "--dataset.episodes=[0,1]", "--validation.val_split=0", "--validation.val_freq=0", "--batch_size=4",
                      "--steps=3", "--log_freq=1", "--policy.max_state_dim=32", "--policy.max_action_dim=32"],
                     env={**runs.env("g1"), **SINGLE_PROCESS_ENV})
    assert failed.returncode == 2, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert f"{url}/videos/chunk-000/observation.images.cam_high/episode_000001.mp4" in errors[0]
    assert "damaged" in errors[0] and not (out / CHECKPOINTS).exists()


def test_a_resume_refuses_the_dataset_changed_in_the_store_unless_told_and_the_checkpoint_records_every_version(
        runs, tmp_path):
    """After the other tests (it rewrites a file in the store, then puts it back): the versions recorded in the
    checkpoint are the store's (a plain client's listing); a resume checks them before anything starts."""
    import boto3
    from botocore.config import Config
    from conftest import refused, run_cli_in_process

    from opentau_cli.store.layout import TRAINING_STATE

    client = boto3.client("s3", endpoint_url=runs.server.endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1", config=Config(retries={"max_attempts": 1}))
    prefix = runs.url.split("/", 3)[3]
    listing = {o["Key"].split(f"{prefix}/", 1)[1]: o for o in client.list_objects_v2(
        Bucket=runs.server.bucket, Prefix=f"{prefix}/")["Contents"]}
    state = json.loads((runs.run / CHECKPOINTS / f"{STEPS:06d}" / TRAINING_STATE).read_text())
    (record,) = state["dataset_fingerprints"].values()
    assert record["url"] == runs.url and record["files"] == 80  # 40 data files and 40 videos in the store
    assert record["bytes"] == sum(o["Size"] for k, o in listing.items() if k.startswith(("data/", "videos/")))
    assert len(record["versions"]) == 80 + sum(k.startswith("meta/") for k in listing)  # every file the run reads
    for rel, version in record["versions"].items():
        assert (version["etag"], version["size"]) == (listing[rel]["ETag"], listing[rel]["Size"]), rel
        assert version["last_modified"] == listing[rel]["LastModified"].isoformat(), rel

    env = {**runs.server.env, "OPENTAU_CACHE_DIR": own_cache(runs.cache), "HF_HOME": str(runs.tmp / "hf_home")}
    same = run_cli_in_process(["resume", str(runs.run)], env=env)
    assert same.returncode == 0 and "Nothing to do" in same.stderr and "changed" not in same.stderr, same.stderr
    rel = "data/chunk-000/episode_000007.parquet"
    original = client.get_object(Bucket=runs.server.bucket, Key=f"{prefix}/{rel}")["Body"].read()
    client.put_object(Bucket=runs.server.bucket, Key=f"{prefix}/{rel}", Body=original)  # same bytes, a new upload
    try:
        rewritten = run_cli_in_process(["resume", str(runs.run)], env=env)
        assert rewritten.returncode == 0, rewritten.stderr  # the same content: the same ETag, nothing changed
        import io

        import pyarrow.parquet as pq

        other = io.BytesIO()  # the same rows written again another way: a valid file, other bytes
        pq.write_table(pq.read_table(io.BytesIO(original)), other, compression="gzip")
        client.put_object(Bucket=runs.server.bucket, Key=f"{prefix}/{rel}", Body=other.getvalue())
        refused(run_cli_in_process(["resume", str(runs.run)], env=env),
                f"{runs.url} changed since checkpoint {STEPS:06d} was saved", f"1 of the files it read has another "
                f"version in the store ({rel})", "--dataset-changed=true")
        told = run_cli_in_process(["resume", str(runs.run), "--dataset-changed=true"], env=env)
        assert told.returncode == 0 and "resuming on it as it is now (--dataset-changed=true)" in told.stderr, told.stderr
    finally:
        client.put_object(Bucket=runs.server.bucket, Key=f"{prefix}/{rel}", Body=original)
