"""`opentau checkpoint export --push-to-hub` against a local server speaking the Hub's protocol (tests/hub_server.py),
driven by the real huggingface_hub client: one commit per push with the whole export, its model card and its eval
plot; a push that fails midway leaves the branch as it was; the token is never written to a file; `serve` and `eval`
take the pushed repo by id, pinned to its commit; every mistake is one line, exit 2, with nothing uploaded.

The client uploads through Xet storage whenever `hf_xet` is installed (it is a dependency of huggingface_hub), which
this server does not speak: the tests set HF_HUB_DISABLE_XET=1, huggingface_hub's documented switch, and the client
takes the Hub's LFS route (preupload, LFS batch, PUT, verify, commit). LeRobot's and openpi's own code loading a
pushed export by repo id: tests/test_peer_models.py."""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
import yaml

from conftest import opentau_bin, refused, run_cli, run_cli_in_process

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.usefixtures("one_thread_module")]

TOKEN = "hf_publish_test_write_token_5c1f09"
REPO = "alice/pi05-tiny-demo"
MARKER = ".opentau-output.json"  # the output convention's marker: a local export's, never pushed


@pytest.fixture(scope="module")
def hub():
    from hub_server import HubServer

    server = HubServer(tokens={TOKEN}).start()
    yield server
    server.stop()


def hub_env(server, home: Path, token: str = TOKEN) -> dict:
    """A subprocess's view of the local Hub: its endpoint, a token in HF_TOKEN, an HF_HOME and a TMPDIR of its own."""
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return {"HF_ENDPOINT": server.url, "HF_TOKEN": token, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(home / "hf_home"),
            "TMPDIR": str(home / "tmp"), "HF_HUB_OFFLINE": "0"}


@pytest.fixture
def hub_here(hub, monkeypatch, tmp_path):
    """This process's huggingface_hub on the local Hub (it reads its settings at import: patched there), with the
    token in HF_TOKEN and a cache of this test's own."""
    from huggingface_hub import constants

    from opentau_cli.store.hub import hub_reachable

    home = tmp_path / "hf_home"
    for name, value in (("ENDPOINT", hub.url), ("HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"),
                        ("HF_HUB_DISABLE_XET", True), ("HF_HUB_OFFLINE", False),
                        ("HF_HUB_CACHE", str(home / "hub")), ("HF_TOKEN_PATH", str(home / "token"))):
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_reachable.cache_clear()
    yield hub
    hub_reachable.cache_clear()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MARKER}


def _local_export(run: Path, step: int, out: Path) -> dict[str, bytes]:
    from opentau_cli.tools.export import export

    export(Path(f"{run}:{step}"), out, layout="lerobot")
    return _files(out)


@pytest.fixture(scope="module")
def pushed(ddp_reference, hub, tmp_path_factory):
    """`opentau eval RUN:3` (its default output, under the working directory), then `opentau checkpoint export RUN:3
    --layout lerobot --push-to-hub REPO`, both as the installed CLI in one working directory with its own HF_HOME and
    TMPDIR; and a local export of the same checkpoint."""
    work = tmp_path_factory.mktemp("publish")
    env = hub_env(hub, work)
    evaluated = run_cli(["eval", f"{ddp_reference}:3", "--episodes", "0,1", "--stride", "5"], cwd=work, env=env)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = run_cli(["checkpoint", "export", f"{ddp_reference}:3", "--layout", "lerobot", "--push-to-hub", REPO],
                     cwd=work, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (eval_dir,) = (work / "outputs" / "eval").iterdir()
    local = _local_export(ddp_reference, 3, tmp_path_factory.mktemp("local") / "export")
    return {"run": ddp_reference, "work": work, "result": result, "eval_dir": eval_dir, "local": local,
            "commit": hub.repo(REPO).refs["main"]}


def test_a_push_is_one_commit_of_the_whole_export_with_its_card_and_eval_plot_named_by_run_step_and_manifest(pushed, hub):
    repo = hub.repo(REPO)
    push, created = repo.log()  # newest first: the push, then the repo's creation
    assert set(created.files) == {".gitattributes"}
    assert set(push.files) == set(pushed["local"]) | {".gitattributes", "README.md", "eval/eval.png"}
    assert all(push.files[name] == data for name, data in pushed["local"].items())  # what a local export writes
    assert push.files["eval/eval.png"] == (pushed["eval_dir"] / "eval.png").read_bytes()
    manifest = pushed["run"] / "checkpoints" / "000003" / "manifest.json"
    digest = xxhash.xxh3_128(manifest.read_bytes()).hexdigest()
    assert push.message == f"opentau lerobot export of run step 3 (ema weights), checkpoint manifest xxh3-128 {digest}"
    assert [p for p in hub.requested("POST") if p.startswith(f"/api/models/{REPO}/commit/")] == [f"/api/models/{REPO}/commit/main"]
    assert pushed["result"].stdout.strip().splitlines()[-1] == f"Pin it: opentau serve {REPO}@{pushed['commit']}"


def test_the_model_card_carries_lerobots_hub_metadata_the_recipe_the_eval_and_how_to_load_it(pushed, hub):
    card = hub.repo(REPO).commits[pushed["commit"]]["README.md"].decode()
    meta = yaml.safe_load(card.split("---\n")[1])
    # The fields LeRobot's own cards carry (its PreTrainedPolicy.generate_model_card); trained from a seeded start on
    # the local demo data: no base model, no license to inherit, no Hub dataset.
    assert (meta["library_name"], meta["pipeline_tag"], meta["model_name"]) == ("lerobot", "robotics", "pi05")
    assert {"robotics", "lerobot", "pi05"} <= set(meta["tags"])
    assert meta["license"] == "unknown" and "base_model" not in meta and "datasets" not in meta
    report = json.loads((pushed["eval_dir"] / "eval.json").read_text())
    assert f"| action MSE | {report['policy']['mse']:.5g} | {report['mean_action']['mse']:.5g} |" in card
    assert f"held-out episodes {', '.join(map(str, report['episodes']))}" not in card  # two chosen ones, not held out
    assert "](eval/eval.png)" in card
    assert "| backend | DDP, 2 processes, mixed precision no |" in card
    assert "| batch | 8 per step: 4 per device x 1 accumulation x 2 processes |" in card
    assert "| EMA | decay 0.9 (these are the EMA weights) |" in card
    assert "| `demo` | a local dataset (not on the Hub) |" in card
    assert f'PI05Policy.from_pretrained("{REPO}")' in card and f"opentau serve {REPO} --port 8000" in card


def test_the_token_is_never_written_to_any_file(pushed, hub):
    """Every byte the eval and the push wrote locally (working directory, HF_HOME, TMPDIR), what they printed, and
    every file the Hub holds."""
    token = TOKEN.encode()
    written = [p for p in pushed["work"].rglob("*") if p.is_file()]
    assert written and not [p for p in written if token in p.read_bytes()]
    assert TOKEN not in pushed["result"].stdout + pushed["result"].stderr
    assert not any(token in data for data in hub.repo(REPO).commits[pushed["commit"]].values())
    assert list((pushed["work"] / "tmp").glob("opentau-push-*")) == []  # the scratch export is gone


def test_a_push_that_fails_midway_leaves_the_branch_as_it_was_and_a_rerun_completes_it(ddp_reference, hub_here, tmp_path):
    repo_id = "alice/half-pushed"
    first = run_cli_in_process(["checkpoint", "export", f"{ddp_reference}:3", "--layout", "lerobot", "--push-to-hub", repo_id],
                               cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    repo = hub_here.repo(repo_id)
    head, files = repo.refs["main"], dict(repo.commits[repo.refs["main"]])
    local = _local_export(ddp_reference, 6, tmp_path / "step6")
    weights = hashlib.sha256(local["model.safetensors"]).hexdigest()
    hub_here.refused_objects.add(weights)  # the storage refuses the new weights; the small files go through
    try:
        failed = run_cli_in_process(["checkpoint", "export", f"{ddp_reference}:6", "--layout", "lerobot", "--push-to-hub",
                                     repo_id], cwd=tmp_path)
    finally:
        hub_here.refused_objects.clear()
    said = failed.stderr.strip().splitlines()[-1]  # after the upload's progress lines
    assert failed.returncode == 1 and "Traceback" not in failed.stderr and said.startswith(f"Error: Pushing to {repo_id} failed (")
    assert "'model.safetensors'" in said and "403" in said and "the storage refused this object" in said and said.endswith(
        f"no commit was made and main still points at {head}: run the command again.")
    assert repo.refs["main"] == head and repo.commits[head] == files and len(repo.log()) == 2
    assert weights not in hub_here.objects

    again = run_cli_in_process(["checkpoint", "export", f"{ddp_reference}:6", "--layout", "lerobot", "--push-to-hub",
                                repo_id], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    latest = repo.log()[0]
    assert latest.parent == head and len(repo.log()) == 3
    assert {k: v for k, v in latest.files.items() if k in local} == local and "step 6" in latest.message


def test_serve_and_eval_take_the_pushed_repo_by_id_pinned_to_its_commit(pushed, hub_here, tmp_path):
    from opentau_cli.tools.serve import load_served

    commit = pushed["commit"]
    local_dir = tmp_path / "export"
    for name, data in pushed["local"].items():
        (local_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (local_dir / name).write_bytes(data)
    served, local = load_served(f"{REPO}@main"), load_served(local_dir)
    assert served.origin["hub"]["commit"] == commit and Path(served.origin["hub"]["cache"]).name == commit
    assert served.metadata()["source"] == f"{REPO}@{commit}"
    assert served.metadata()["observation_keys"] == local.metadata()["observation_keys"]
    obs = {"observation.images.top": np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8),
           "observation.state": np.array([0.5, 0.4, 0.0, 0.01], np.float32), "prompt": "Move the blue dot to the red target."}
    assert np.array_equal(served.infer(obs)["actions"], local.infer(obs)["actions"])

    reports, printed = {}, {}
    for name, source in (("hub", REPO), ("local", str(local_dir))):
        result = run_cli_in_process(["eval", source, "--episodes", "0,1", "--stride", "5", "--output", str(tmp_path / f"eval_{name}")])
        assert result.returncode == 0, result.stderr
        reports[name], printed[name] = json.loads((tmp_path / f"eval_{name}" / "eval.json").read_text()), result.stderr
    assert f"{REPO}: revision main is commit {commit} (Hugging Face cache: " in printed["hub"]
    assert reports["hub"]["hub"]["commit"] == commit and reports["hub"]["policy"] == reports["local"]["policy"]


def test_opentau_serve_prints_the_commit_a_repo_id_resolves_to(pushed, hub, tmp_path):
    env = {**os.environ, **hub_env(hub, tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([opentau_bin(), "serve", REPO, "--port", "0"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen, deadline = "", time.monotonic() + 180
    try:
        while time.monotonic() < deadline and "Serving " not in seen and proc.poll() is None:
            if select.select([proc.stderr], [], [], 1)[0]:
                seen += proc.stderr.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    commit = pushed["commit"]
    assert f"{REPO}: revision main is commit {commit}" in seen and f"Serving {REPO}@{commit} " in seen, seen


# ------------------------------------------------------------------------------------------- mistakes
def _unrelated(hub, tmp_path) -> str:
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "notes.txt").write_text("our own notes\n")
    (folder / "weights.bin").write_bytes(b"\0" * 64)
    hub.publish("alice/theirs", folder, kind="models")
    return "alice/theirs"


def _corrupt_copy(run: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "run" / "checkpoints" / "000003"
    shutil.copytree(run / "checkpoints" / "000003", ckpt)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte, same size: only a re-hash finds it
    weights.write_bytes(bytes(data))
    return ckpt


MISTAKES = {
    "a repo id that is not user/name": (lambda ctx: ["RUN:3", "--push-to-hub", "pi05-demo"], "not a Hugging Face repo id"),
    "a commit instead of a branch": (lambda ctx: ["RUN:3", "--push-to-hub", f"alice/x@{'a' * 40}"], "is a commit"),
    "no token": (lambda ctx: ["RUN:3", "--push-to-hub", "alice/x"], "no Hugging Face token"),
    "a token the Hub refuses": (lambda ctx: ["RUN:3", "--push-to-hub", "alice/x"], "The Hub refused the Hugging Face token"),
    "a repo holding unrelated files": (lambda ctx: ["RUN:3", "--push-to-hub", ctx["theirs"]],
                                       "holds 2 file(s) the export does not replace (notes.txt, weights.bin)"),
    "a checkpoint that fails verification": (lambda ctx: [str(ctx["corrupt"]), "--push-to-hub", "alice/x"],
                                             "fails verification (altered: model.safetensors"),
    "the eval of another checkpoint": (lambda ctx: ["RUN:6", "--push-to-hub", "alice/x", "--eval", str(ctx["eval_dir"])],
                                       "it evaluated"),
    "--private for a public repo": (lambda ctx: ["RUN:3", "--push-to-hub", REPO, "--private"], "exists and is public"),
    "neither --output nor --push-to-hub": (lambda ctx: ["RUN:3"], "Give --output DIR"),
    "a step the run does not have": (lambda ctx: ["RUN:4", "--push-to-hub", "alice/x"],
                                     "has no checkpoint of step 4 (its checkpoints' steps: 3, 6)"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_push_mistake_is_one_line_exit_2_and_uploads_nothing(mistake, pushed, hub_here, monkeypatch, tmp_path):
    args, says = MISTAKES[mistake]
    ctx = {"eval_dir": pushed["eval_dir"], "theirs": None, "corrupt": None}
    if mistake == "a repo holding unrelated files":
        ctx["theirs"] = _unrelated(hub_here, tmp_path)
    if mistake == "a checkpoint that fails verification":
        ctx["corrupt"] = _corrupt_copy(pushed["run"], tmp_path)
    if mistake == "no token":
        monkeypatch.delenv("HF_TOKEN")
    if mistake == "a token the Hub refuses":
        monkeypatch.setenv("HF_TOKEN", "hf_not_a_token_of_this_hub")
    argv = [a.replace("RUN", str(pushed["run"])) if a.startswith("RUN:") else a for a in args(ctx)]
    before, state = len(hub_here.log), {k: dict(r.refs) for k, r in hub_here.repos.items()}
    result = run_cli_in_process(["checkpoint", "export", *argv, "--layout", "lerobot"], cwd=tmp_path)
    refused(result, says)
    assert [(m, p) for m, p in hub_here.log[before:] if m in ("POST", "PUT")] == []
    assert {k: dict(r.refs) for k, r in hub_here.repos.items()} == state


def test_force_pushes_beside_unrelated_files_keeps_them_and_names_them(pushed, hub_here, tmp_path):
    repo_id = _unrelated(hub_here, tmp_path)
    theirs = dict(hub_here.repo(repo_id).commits[hub_here.repo(repo_id).refs["main"]])
    result = run_cli_in_process(["checkpoint", "export", f"{pushed['run']}:3", "--layout", "lerobot", "--push-to-hub",
                                 repo_id, "--force"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"Kept 2 file(s) of {repo_id} the export does not replace (--force never deletes): notes.txt, weights.bin." in result.stderr
    files = hub_here.repo(repo_id).commits[hub_here.repo(repo_id).refs["main"]]
    assert all(files[name] == data for name, data in theirs.items()) and set(pushed["local"]) <= set(files)


def test_private_creates_a_private_repo_and_eval_names_the_evaluation_for_the_card(pushed, hub_here, tmp_path):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    result = run_cli_in_process(["checkpoint", "export", f"{pushed['run']}:3", "--layout", "openpi", "--push-to-hub",
                                 "alice/private-demo@robot", "--private", "--eval", str(pushed["eval_dir"])], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    repo = hub_here.repo("alice/private-demo")
    assert repo.private and set(repo.refs) == {"main", "robot"} and repo.log("main")[0].files.keys() == {".gitattributes"}
    files = repo.commits[repo.refs["robot"]]
    assert "eval/eval.png" in files and "assets/demo/norm_stats.json" in files
    card = files["README.md"].decode()
    assert "## Evaluation" in card and "](eval/eval.png)" in card and 'asset id to "demo"' in card
    assert "hf download alice/private-demo --revision robot" in card
    with pytest.raises(RepositoryNotFoundError):  # hidden from whoever has no token
        HfApi(token=False).model_info("alice/private-demo")


def test_the_card_names_the_base_models_commit_and_license_and_the_hub_datasets_commits(hub_here, tmp_path):
    """A run started from a model on the Hub and trained on a Hub dataset: the card's metadata carries them, with the
    license the base model's own card names and the commits the run read."""
    from conftest import EXAMPLES
    from opentau_cli.config.load import load_config
    from opentau_cli.tools.model_card import CardFacts, base_model, render

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: gemma\nlibrary_name: lerobot\n---\n# a base\n")
    (base / "config.json").write_text("{}")
    commit = hub_here.publish("lerobot/pi05-tiny-base", base, kind="models")
    cfg = load_config(str(EXAMPLES / "pi05_tiny_config.json"), [
        "--policy.pretrained_path=lerobot/pi05-tiny-base", "--dataset.repo_id=lerobot/reach", "--dataset.revision=v2",
        "--policy.lora.rank=8", "--dataset.augment=openpi"])
    state = {"step": 40, "samples_seen": 2560, "world_size": 8, "backend": "deepspeed", "zero_stage": 2,
             "mixed_precision": "bf16", "dataset_revisions": {"reach": {"repo_id": "lerobot/reach", "commit": "c" * 40}}}
    found = base_model(cfg.policy.pretrained_path)
    assert (found.repo_id, found.commit, found.license) == ("lerobot/pi05-tiny-base", commit, "gemma")
    card = render(CardFacts(repo_id="bob/reach", branch="main", layout="openpi", config=cfg, state=state, run="reach",
                            checkpoint="000040", manifest_xxh3="d" * 32, weights="live", dataset="reach", base=found,
                            asset="reach", files=["model.safetensors"]))
    meta = yaml.safe_load(card.split("---\n")[1])
    assert (meta["base_model"], meta["license"], meta["datasets"]) == ("lerobot/pi05-tiny-base", "gemma", ["lerobot/reach"])
    assert meta["library_name"] == "openpi"
    assert f"[lerobot/pi05-tiny-base](https://huggingface.co/lerobot/pi05-tiny-base) at commit `{commit}`" in card
    assert f"| `reach` | [lerobot/reach](https://huggingface.co/datasets/lerobot/reach) | `{'c' * 40}` |" in card
    assert "| backend | DeepSpeed ZeRO-2, 8 processes, mixed precision bf16 |" in card
    assert "| LoRA | rank 8, alpha 16 (merged into the exported weights) |" in card
    assert "openpi's (crop, rotation, colour)" in card and 'asset id to "reach"' in card
