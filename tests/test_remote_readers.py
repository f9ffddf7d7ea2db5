"""What a reader of a run in object storage trusts (docs/ARCHITECTURE.md, "Remote checkpoints"), against a real S3
server (SeaweedFS, this module's own: one test stops it). One real tiny run stores checkpoints 000002 and 000004;
each case copies the store's objects to a prefix of its own with a plain boto3 client (not opentau's code) and damages
that copy the way the case says:
- `last` deleted or garbled, or the newest manifest deleted: `opentau resume URL`, `URL:STEP` and `URL:STEP
  --rollback=true` continue from the newest committed checkpoint (or STEP), a launch repairs `last`, and `checkpoint
  list` / `verify` say what is wrong by name;
- a file corrupted (same size, bytes flipped) or truncated: resume exits 2 before anything is created locally, in one
  sentence naming the checkpoint, the file and `URL:STEP --rollback=true` of the newest intact one;
- offline tools given a URL record the URL and step (eval.json, serve's metadata, the model card), never the cache;
  `verify URL` and `inspect URL:STEP` use the verified cache, also while the store is stopped;
- nested `remote_options` the client takes are taken; a key it refuses is said once.
In each case every checkpoint the store holds with a manifest has its writer's manifest, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import SINGLE_PROCESS_ENV, own_cache, refused, run_cli, run_cli_in_process, start_s3_server
from opentau_cli.store.layout import CHECKPOINTS, MANIFEST
from remote_runs import HOOKS, TINY, ok

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """This module's own S3 server: stopping it touches no other module's."""
    server = start_s3_server(tmp_path_factory, "readers_s3")
    yield server
    server.kill()


def client(server):
    """A plain boto3 client on the store: the test's own hands, not the product's code."""
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint, region_name=server.env["AWS_REGION"],
                        aws_access_key_id=server.env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"])


def keys(server, prefix: str) -> list[str]:
    pages = client(server).get_paginator("list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix + "/")
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def read(server, key: str) -> bytes:
    return client(server).get_object(Bucket=server.bucket, Key=key)["Body"].read()


def put(server, key: str, data: bytes) -> None:
    client(server).put_object(Bucket=server.bucket, Key=key, Body=data)


def delete(server, key: str) -> None:
    client(server).delete_object(Bucket=server.bucket, Key=key)


@pytest.fixture(scope="module")
def run(store, tmp_path_factory):
    """`opentau train` of the tiny preset, 4 steps saving at 2 and 4, into checkpoint.remote (its save of 4 waits
    until 2 is committed, tests/hooks' TEST_UPLOAD_PACE): the store holds 000002 and 000004 with `last` on 000004."""
    root = tmp_path_factory.mktemp("readers")
    out = root / "run"
    url = store.url("runs/base")
    env = {**SINGLE_PROCESS_ENV, **store.env, "HOME": str(root / "home"), "HF_HOME": str(root / "hf"),
           "OPENTAU_CACHE_DIR": own_cache(root / "cache"), "PYTHONPATH": HOOKS, "TEST_UPLOAD_DIR": str(root),
           "TEST_UPLOAD_PACE": "000002"}
    result = run_cli(["train", f"--config_path={TINY}", f"--output_dir={out}", "--steps", "4", "--save_freq", "2",
                      "--log_freq", "1", "--batch_size", "8", "--scheduler.warmup_steps", "2",
                      f"--checkpoint.remote={url}"], cwd=root, env=env)
    ok(result)
    assert keys(store, "runs/base") and read(store, "runs/base/checkpoints/last") == b"000004\n"
    manifests = {name: (out / CHECKPOINTS / name / MANIFEST).read_bytes() for name in ("000002", "000004")}
    return {"url": url, "root": root, "out": out, "env": env, "manifests": manifests}


def copy_of(store, run, case: str) -> str:
    """The stored run copied object by object to runs/<case> (a plain copy: the checksums the store keeps go along)."""
    s3 = client(store)
    for key in keys(store, "runs/base"):
        s3.copy_object(Bucket=store.bucket, Key=f"runs/{case}/" + key.removeprefix("runs/base/"),
                       CopySource={"Bucket": store.bucket, "Key": key})
    return store.url(f"runs/{case}")


def stored_manifests(store, prefix: str) -> dict[str, bytes]:
    return {key.split("/")[-2]: read(store, key) for key in keys(store, prefix + "/checkpoints")
            if key.endswith("/" + MANIFEST) and key.count("/") == 4}


def assert_every_stored_checkpoint_is_its_writers(store, prefix: str, written: dict[str, bytes]) -> None:
    """Every checkpoint the store holds with a manifest holds the manifest its writer wrote (none replaced)."""
    stored = stored_manifests(store, prefix)
    assert stored and {name: written[name] for name in stored} == stored


def moved(url: str) -> str:
    """The copy's own URL for the resumed run's uploads (its train_config.json names the store it was copied from)."""
    return f"--checkpoint.remote={url}"


def cli(run, args: list[str], **env):
    """An opentau command that launches nothing, in this process, on this module's store and the run's cache."""
    return run_cli_in_process(args, env={**run["env"], **env})


@pytest.mark.parametrize("damage", ["last deleted", "last garbled"])
def test_a_missing_or_garbled_last_strands_nothing_and_every_resume_form_continues(store, run, damage, tmp_path):
    case = damage.replace(" ", "-")
    url = copy_of(store, run, case)
    if damage == "last deleted":
        delete(store, f"runs/{case}/checkpoints/last")
    else:
        put(store, f"runs/{case}/checkpoints/last", b"\x00\xffnot a checkpoint\n")
    listed = cli(run, ["checkpoint", "list", url, "--json"])
    ok(listed)
    assert [(r["name"], r["state"], r["marks"]) for r in json.loads(listed.stdout)] == [
        ("000002", "committed", []), ("000004", "committed", [])]
    listed = cli(run, ["checkpoint", "list", url])
    assert ("Note: checkpoints/last is missing or holds no checkpoint name; readers continue from 000004, the newest "
            f"committed checkpoint; `opentau resume {url}` repairs it.") in listed.stdout
    shown = cli(run, ["checkpoint", "inspect", url, "--json"])
    ok(shown)
    assert {k: v for k, v in json.loads(shown.stdout).items() if k != "run_dir"} == {
        "url": url, "last": None, "best": None, "resumes_from": "000004", "committed": ["000002", "000004"],
        "damaged": [], "partial": []}
    verified = cli(run, ["checkpoint", "verify", url])
    assert verified.returncode == 1
    assert (f"FAIL {url}: checkpoints/last is missing or holds no checkpoint name; readers continue from 000004, the "
            f"newest committed checkpoint (`opentau resume {url}` repairs it).") in verified.stdout
    assert verified.stdout.count("OK  ") == 2
    # Every resume form continues: the newest (000004), a step (000004), an older step with --rollback=true (000002);
    # --steps at the checkpoint's step: downloaded, planned, nothing to train.
    for target, steps, extra, name in ((url, 4, [], "000004"), (f"{url}:4", 4, [], "000004"),
                                       (f"{url}:2", 2, ["--rollback=true"], "000002")):
        out = tmp_path / f"{name}-{len(extra)}-{target[-2:]}"
        resumed = cli(run, ["resume", target, f"--output_dir={out}", f"--steps={steps}", moved(url), *extra])
        ok(resumed)
        assert f"Downloading checkpoint {name} of {url}" in resumed.stderr and "Nothing to do" in resumed.stderr
        assert (out / CHECKPOINTS / name / MANIFEST).read_bytes() == run["manifests"][name]
    assert_every_stored_checkpoint_is_its_writers(store, f"runs/{case}", run["manifests"])


def test_a_resume_that_launches_repairs_last_and_goes_on_storing_with_nested_client_options(store, run, tmp_path):
    case = "repaired"
    url = copy_of(store, run, case)
    put(store, f"runs/{case}/checkpoints/last", b"garbage\n")
    out = tmp_path / "resumed"
    # botocore Config's own arguments, nested: the client takes them for every request of the resume and its uploads.
    options = json.dumps({"config_kwargs": {"connect_timeout": 5, "read_timeout": 60}})
    result = run_cli(["resume", url, f"--output_dir={out}", "--steps=6", moved(url), f"--checkpoint.remote_options={options}"],
                     cwd=run["root"], env={**run["env"], "PYTHONPATH": ""})
    ok(result)
    assert f"Downloading checkpoint 000004 of {url}" in result.stderr
    (log,) = out.glob("logs/*/uploads.log")
    assert f"Repaired {url}/checkpoints/last: it names 000004 again." in log.read_text()
    assert read(store, f"runs/{case}/checkpoints/last") == b"000006\n"
    written = {**run["manifests"], "000006": (out / CHECKPOINTS / "000006" / MANIFEST).read_bytes()}
    assert stored_manifests(store, f"runs/{case}") == written


def test_a_deleted_newest_manifest_leaves_the_previous_checkpoint_to_continue_and_is_named(store, run, tmp_path):
    case = "manifest-deleted"
    url = copy_of(store, run, case)
    delete(store, f"runs/{case}/checkpoints/000004/{MANIFEST}")
    listed = cli(run, ["checkpoint", "list", url, "--json"])
    ok(listed)
    assert [(r["name"], r["state"]) for r in json.loads(listed.stdout)] == [("000002", "committed"), ("000004", "partial")]
    verified = cli(run, ["checkpoint", "verify", url])
    assert verified.returncode == 1
    assert f"FAIL {url}/checkpoints/000004" in verified.stdout and f"OK   {url}/checkpoints/000002" in verified.stdout
    assert f"FAIL {url}: checkpoints/last names 000004, which is not committed (no manifest)" in verified.stdout
    out = tmp_path / "resumed"
    resumed = cli(run, ["resume", url, f"--output_dir={out}", "--steps=2", moved(url)])
    ok(resumed)
    assert f"Downloading checkpoint 000002 of {url}" in resumed.stderr
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir() if p.name[0].isdigit()) == ["000002"]
    assert_every_stored_checkpoint_is_its_writers(store, f"runs/{case}", run["manifests"])


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
def test_a_damaged_object_is_said_once_before_anything_is_created_locally(store, run, damage, tmp_path):
    case = damage
    url = copy_of(store, run, case)
    key = f"runs/{case}/checkpoints/000004/model.safetensors"
    data = bytearray(read(store, key))
    if damage == "corrupted":
        data[len(data) // 2: len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 64])
    else:
        data = data[:1000]
    put(store, key, bytes(data))
    what = ("does not match its manifest's hash" if damage == "corrupted" else
            f"holds 1000 bytes where its manifest says {len(read(store, key.replace(case, 'base')))}")
    sentence = (f"Checkpoint 000004 in {url} is damaged (checkpoints/000004/model.safetensors {what}) and nothing was "
                f"written locally: continue from the newest intact one with `opentau resume {url}:2 --rollback=true` "
                f"(the newer ones move into {url}/rolled_back/<time>/; nothing is deleted).")
    parent = tmp_path / "new"
    for target, command in ((url, run_cli), (f"{url}:4", run_cli_in_process)):
        out = parent / "run"
        result = command(["resume", target, f"--output_dir={out}", moved(url)], cwd=tmp_path, env=run["env"])
        assert result.returncode == 2  # after the one line saying what it downloads, the one sentence
        assert result.stderr.strip().splitlines()[-1] == f"Error: {sentence}" and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == (2 if damage == "corrupted" else 1)
        assert not parent.exists()  # not the run directory, its parents or a hidden sibling
    listed = cli(run, ["checkpoint", "list", url, "--json"])
    states = {r["name"]: r["state"] for r in json.loads(listed.stdout)}
    # Sizes show a truncated file at once; other bytes at the same size only a download (verify) shows.
    assert states == {"000002": "committed", "000004": "committed" if damage == "corrupted" else "damaged"}
    verified = cli(run, ["checkpoint", "verify", url])
    assert verified.returncode == 1
    assert f"FAIL {url}/checkpoints/000004\n     model.safetensors {what}" in verified.stdout
    # The way on works: the newest intact checkpoint, the damaged one moved aside by the launch (not run here).
    way_on = cli(run, ["resume", f"{url}:2", f"--output_dir={tmp_path / 'way-on'}", "--steps=2", "--rollback=true",
                       moved(url)])
    ok(way_on)
    assert_every_stored_checkpoint_is_its_writers(store, f"runs/{case}", run["manifests"])


def test_offline_tools_given_a_url_record_the_url_and_step_never_the_cache(store, run, tmp_path, monkeypatch):
    from hub_server import HubServer
    from huggingface_hub import constants

    from opentau_cli.cli.common import local_source
    from opentau_cli.store.hub import hub_reachable
    from opentau_cli.tools.serve import load_served

    url, cache = run["url"], Path(run["env"]["OPENTAU_CACHE_DIR"])
    for name, value in run["env"].items():
        monkeypatch.setenv(name, value)
    evaluated = cli(run, ["eval", f"{url}:4", "--output", str(tmp_path / "eval"), "--stride", "8"])
    ok(evaluated)
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["checkpoint"] == {"path": f"{url}/checkpoints/000004", "step": 4, "url": url,
                                    "resolved_from": f"{url}:4"}
    # `URL:best` is recorded as the step it resolves to (the store's `best`, as checkpoint.keep_best writes it).
    best = copy_of(store, run, "best")
    put(store, "runs/best/checkpoints/best", b"000002\n")
    served = load_served(local_source(f"{best}:best")).metadata()  # what `opentau serve URL:best` sends on connect
    assert served["source"] == f"{best}:2" and served["step"] == 2
    assert served["checkpoint"] == {"path": f"{best}/checkpoints/000002", "step": 2, "url": best,
                                    "resolved_from": f"{best}:2"}
    exported = cli(run, ["checkpoint", "export", f"{url}:4", "--output", str(tmp_path / "export")])
    ok(exported)
    assert f"from {url}/checkpoints/000004" in exported.stdout
    token = "hf_readers_test_token_51ab"
    hub = HubServer(tokens={token}).start()
    try:
        for name, value in (("ENDPOINT", hub.url), ("HF_HUB_DISABLE_XET", True), ("HF_HUB_OFFLINE", False),
                            ("HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"),
                            ("HF_HUB_CACHE", str(tmp_path / "hf" / "hub")), ("HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))):
            monkeypatch.setattr(constants, name, value)
        monkeypatch.setenv("HF_TOKEN", token)
        hub_reachable.cache_clear()
        pushed = cli(run, ["checkpoint", "export", f"{url}:4", "--layout", "lerobot", "--push-to-hub", "alice/pi05-from-store"],
                     HF_TOKEN=token)
        ok(pushed)
        repo = hub.repo("alice/pi05-from-store")
        card = repo.commits[repo.refs["main"]]["README.md"].decode()
    finally:
        hub_reachable.cache_clear()
        hub.stop()
    assert yaml.safe_load(card.split("---\n")[1])["library_name"] == "lerobot"
    assert f"step 4 of run `{url}` (checkpoint `000004`" in card
    for text in (json.dumps(report), json.dumps(served), card, (tmp_path / "export" / ".opentau-output.json").read_text(),
                 (tmp_path / "eval" / ".opentau-output.json").read_text()):
        assert str(cache) not in text and "/remote/" not in text.replace(url, "")
    assert_every_stored_checkpoint_is_its_writers(store, "runs/base", run["manifests"])
    assert_every_stored_checkpoint_is_its_writers(store, "runs/best", run["manifests"])


def test_verify_and_inspect_use_the_verified_cache_and_work_while_the_store_is_stopped(store, run, tmp_path):
    url = run["url"]
    env = {"OPENTAU_CACHE_DIR": str(tmp_path / "cache")}
    first = cli(run, ["checkpoint", "verify", url], **env)
    ok(first)
    assert first.stdout.count("OK  ") == 2 and first.stderr.count("Downloading checkpoint") == 2
    again = cli(run, ["checkpoint", "verify", url], **env)
    ok(again)
    assert again.stdout.count("OK  ") == 2 and "Downloading" not in again.stderr  # verified objects, unchanged
    store.stop()
    try:
        away = cli(run, ["checkpoint", "verify", url], **env)
        ok(away)
        assert away.stdout.count("OK  ") == 2
        assert "re-hashed the copies in this machine's cache" in away.stdout and "cannot be reached" in away.stdout
        shown = cli(run, ["checkpoint", "inspect", f"{url}:4", "--json"], **env)
        ok(shown)
        assert json.loads(shown.stdout)["step"] == 4 and "using checkpoint 000004 as verified from it" in shown.stderr
        never = cli(run, ["checkpoint", "inspect", f"{url}:4", "--json"], OPENTAU_CACHE_DIR=str(tmp_path / "empty"))
        refused(never, "cannot be reached", "holds no verified copy")
    finally:
        store.start()
    assert_every_stored_checkpoint_is_its_writers(store, "runs/base", run["manifests"])


def test_a_client_option_the_client_refuses_is_said_once(store, run, tmp_path):
    options = json.dumps({"config_kwargs": {"connect_timeot": 5}})
    result = cli(run, ["config", "validate", TINY, f"--checkpoint.remote={store.url('runs/options')}",
                       f"--checkpoint.remote_options={options}", f"--output_dir={tmp_path / 'run'}"])
    refused(result, "Unknown config_kwargs for", "connect_timeot", "connect_timeout")
