"""Exports act in the peers' own code as opentau acts: a pi05_small-sized checkpoint with drawn weights (adaRMS gates
off zero) and the demo dataset's statistics, exported in the LeRobot and openpi layouts, then LeRobot 0.4.4's
`PI05Policy.from_pretrained` with its own processors, and openpi's PyTorch `PI0Pytorch` loaded strictly with its own
normalization, return opentau's `sample_actions` chunk for the same observation and noise (fp32): the checkpoint's
policy's, and the export's as `opentau eval` / `opentau serve` load it.

Both peers' pi05 models need openpi's transformers_replace files, which only openpi's GitHub source holds (no package
registry has it): the venv (scripts/peer_envs.sh lerobot-openpi) and these tests take it from OPENPI_SRC, else from the
pinned copy beside the checkout (../shared/peers/openpi-15a9616); under CI a missing source or venv fails.

The same checkpoint is also pushed in both layouts with `opentau checkpoint export --push-to-hub` to a local server
speaking the Hub's protocol (tests/hub_server.py), and the peers' code fetches it by repo id from there: LeRobot's
`from_pretrained` with the repo id and the pushed commit, openpi's loader on the folder the peer venv's huggingface_hub
downloads (`snapshot_download`, as `hf download` does). Each peer runs once on the local export and the pushed one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import EXAMPLES, run_cli
from peer_envs import byte_level_tokenizer, openpi_source, peer_python, sizes_for_peers

pytestmark = pytest.mark.full

HERE = Path(__file__).parent
TOLERANCE = 1e-4  # fp32, two implementations of the same maths
TOKEN = "hf_peer_models_write_token"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The checkpoint, its two exports, one observation + noise, and opentau's own action chunk for them."""
    openpi_root, commit = openpi_source()
    python = peer_python("lerobot-0.4.4-openpi", commit)
    from opentau_cli.config.load import load_config, parse_overrides
    from opentau_cli.data import build_data
    from opentau_cli.data.normalization import QUANTILE, normalize
    from opentau_cli.policies import build_policy
    from opentau_cli.policies.layouts import LEROBOT, OPENPI
    from opentau_cli.policies.pi05.tokenization import clean_task, state_bins
    from opentau_cli.store.layout import MODEL_WEIGHTS, TRAIN_CONFIG, TRAINING_STATE
    from opentau_cli.store.manifest import write_manifest
    from opentau_cli.tools.export import export
    from opentau_cli.tools.serve import load_served

    root = tmp_path_factory.mktemp("peer_models")
    tokenizer = byte_level_tokenizer(root / "tokenizer")
    # openpi's model reads 224 px images from 3 cameras (fixed in its code); the demo data's one camera fills slot 0.
    cfg = load_config(str(EXAMPLES / "pi05_tiny_config.json"), [
        f"--output_dir={root / 'run'}", "--policy.preset=pi05_small", "--policy.image_resolution=[224,224]",
        "--dataset.num_cameras=3", "--policy.max_state_dim=32", "--policy.max_action_dim=32", "--policy.tokenizer_max_length=96",
        f"--policy.tokenizer_path={tokenizer}"])
    dataset_stats = build_data(cfg).stats
    torch.manual_seed(7)
    policy = build_policy(cfg.policy, dataset_stats)
    with torch.no_grad():  # every weight drawn off its initial value: the expert's adaRMS gates start at zero
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    policy.eval()
    ckpt = root / "run" / "checkpoints" / "000001"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous().clone() for k, v in policy.state_dict().items()}, str(ckpt / MODEL_WEIGHTS))
    (ckpt / TRAIN_CONFIG).write_text(json.dumps(cfg.to_json_dict()))
    (ckpt / TRAINING_STATE).write_text(json.dumps({"step": 1}))
    write_manifest(ckpt)  # a push verifies the checkpoint first
    exports = {layout: export(ckpt, root / f"export_{layout}", layout=layout).output for layout in (LEROBOT, OPENPI)}

    generator = torch.Generator().manual_seed(3)
    images = torch.zeros(3, 3, 224, 224)
    images[0] = torch.rand(3, 224, 224, generator=generator)
    state_stats = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in dataset_stats["state"].items()}
    low, high = state_stats["q01"], state_stats["q99"]
    state = low + torch.rand(len(low), generator=generator) * (high - low)  # a state inside the data's range
    noise = torch.randn(1, cfg.policy.chunk_size, cfg.policy.max_action_dim, generator=generator)
    task = "pick up the red_cube"
    batch = {"images": images[None], "image_masks": torch.tensor([[True, False, False]]), "state": state[None], "task": [task]}
    # opentau's chunk: the checkpoint's policy, and each export as `opentau eval` / `opentau serve` load it
    as_served = parse_overrides([f"--policy.tokenizer_path={tokenizer}", "--dataset.num_cameras=3"])
    with torch.no_grad():
        ours = policy.sample_actions(batch, noise)[0]
        served = {layout: load_served(path, overrides=as_served, device="cpu").policy.sample_actions(batch, noise)[0]
                  for layout, path in exports.items()}
    # openpi's prompt: the task, then the quantile-normalized state's 256-level bins (the real dims)
    bins = state_bins(normalize(state[None], state_stats, QUANTILE))[0]
    prompt = f"Task: {clean_task(task)}, State: {' '.join(map(str, bins))};\nAction: "
    given = root / "in.npz"
    np.savez(given, images=images.numpy(), image_masks=np.array([True, False, False]), state=state.numpy(), task=np.array(task),
             noise=noise.numpy(), num_steps=np.array(cfg.policy.num_inference_steps))
    sizes = root / "sizes.json"
    sizes.write_text(json.dumps(sizes_for_peers(cfg.policy.preset)))
    return {"python": python, "openpi": openpi_root, "exports": exports, "tokenizer": tokenizer, "sizes": sizes, "given": given,
            "ours": ours, "served": served, "prompt": prompt, "root": root, "ckpt": ckpt}


@pytest.fixture(scope="module")
def hub(case):
    """The checkpoint pushed in each layout by the CLI to a local Hub server (its own HF_HOME), and what the peers
    need to fetch it from there: the repo ids at the pushed commits and their environment (another HF_HOME)."""
    from hub_server import HubServer
    from opentau_cli.policies.layouts import LEROBOT, OPENPI

    server = HubServer(tokens={TOKEN}).start()
    root = case["root"]
    env = {"HF_ENDPOINT": server.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(root / "push_hf_home")}
    repos = {}
    for layout in (LEROBOT, OPENPI):
        repo = f"alice/pi05-small-{layout}"
        pushed = run_cli(["checkpoint", "export", str(case["ckpt"]), "--layout", layout, "--push-to-hub", repo],
                         env=env, cwd=root)
        assert pushed.returncode == 0, pushed.stderr[-3000:]
        repos[layout] = f"{repo}@{server.repo(repo).refs['main']}"
    yield {"server": server, "repos": repos,
           "env": {"HF_ENDPOINT": server.url, "HF_HOME": str(root / "peer_hf_home"), "HF_HUB_OFFLINE": "0"}}
    server.stop()


@pytest.fixture(scope="module")
def lerobot_acts(case, hub) -> dict:
    """LeRobot's chunks for the local LeRobot export and for the pushed one, by repo id (one run of its code)."""
    from opentau_cli.policies.layouts import LEROBOT

    return _run(case, "lerobot_policy_driver.py", f"{case['exports'][LEROBOT]},{hub['repos'][LEROBOT]}", case["tokenizer"],
                case["sizes"], case["given"], env=hub["env"])


@pytest.fixture(scope="module")
def openpi_acts(case, hub) -> dict:
    """openpi's chunks for the local openpi export and for the pushed one, downloaded by repo id (one run)."""
    from opentau_cli.policies.layouts import OPENPI

    return _run(case, "openpi_model_driver.py", case["openpi"], f"{case['exports'][OPENPI]},{hub['repos'][OPENPI]}",
                case["tokenizer"], case["sizes"], case["given"], env=hub["env"])


def _run(case, driver: str, *args, env: dict | None = None) -> dict:
    import os

    out = case["root"] / f"{driver}.json"
    proc = subprocess.run([case["python"], str(HERE / driver), *map(str, args), str(out)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    return json.loads(out.read_text())


def _text(case, ids: list) -> str:
    """The prompt a peer tokenized: BOS, the text, padding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(case["tokenizer"]))
    length = max(i for i, token in enumerate(ids) if token != tok.pad_token_id) + 1
    assert ids[0] == tok.bos_token_id
    return tok.decode(ids[1:length])


def _same_chunk(theirs: list, ours: torch.Tensor, record, what: str) -> float:
    theirs = torch.tensor(theirs).reshape(ours.shape)
    difference = (theirs - ours).abs().max().item()
    record(f"peer max abs difference, {what}", f"{difference:.3g}")  # printed at the end of the run (conftest)
    assert difference <= TOLERANCE, f"max abs difference {difference:.3g} > {TOLERANCE}"
    return difference


def test_lerobots_pi05_policy_with_its_processors_acts_as_opentau_on_the_lerobot_export(case, lerobot_acts, record_property):
    from opentau_cli.policies.layouts import LEROBOT

    got = lerobot_acts[str(case["exports"][LEROBOT])]
    assert got["cameras"] == ["observation.images.top"]
    (ids,) = got["input_ids"]
    assert _text(case, ids) == case["prompt"]
    _same_chunk(got["actions"], case["ours"], record_property, "LeRobot vs opentau's checkpoint")
    _same_chunk(got["actions"], case["served"][LEROBOT], record_property, "LeRobot vs opentau serving the LeRobot export")


def test_lerobots_from_pretrained_loads_the_pushed_lerobot_export_by_repo_id_and_acts_as_on_the_local_one(case, hub, lerobot_acts):
    from opentau_cli.policies.layouts import LEROBOT, LEROBOT_NORMALIZER

    repo, commit = hub["repos"][LEROBOT].split("@")
    assert lerobot_acts[hub["repos"][LEROBOT]] == lerobot_acts[str(case["exports"][LEROBOT])]  # the same files: ==
    fetched = {tuple(p.split("/resolve/", 1)[1].split("/", 1)) for p in hub["server"].requested("GET")
               if p.startswith(f"/{repo}/resolve/")}
    # LeRobot 0.4.4's PI05Policy.from_pretrained fetches the weights at the default branch whatever its `revision`
    # says (it looks for the revision in **kwargs, where the named argument never is); main is the pushed commit here.
    assert fetched == {(commit, "config.json"), ("main", "model.safetensors"), (commit, "policy_preprocessor.json"),
                       (commit, "policy_postprocessor.json"), (commit, LEROBOT_NORMALIZER),
                       (commit, "policy_postprocessor_step_0_unnormalizer_processor.safetensors")}
    assert hub["server"].repo(repo).refs["main"] == commit


def test_openpis_pytorch_model_loads_the_openpi_export_strictly_and_acts_as_opentau_with_its_normalization(case, openpi_acts, record_property):
    from opentau_cli.policies.layouts import OPENPI

    got = openpi_acts[str(case["exports"][OPENPI])]
    assert _text(case, got["input_ids"]) == case["prompt"]
    _same_chunk(got["actions"], case["ours"], record_property, "openpi vs opentau's checkpoint")
    _same_chunk(got["actions"], case["served"][OPENPI], record_property, "openpi vs opentau serving the openpi export")


def test_openpi_loads_the_pushed_openpi_export_downloaded_by_repo_id_and_acts_as_on_the_local_one(case, hub, openpi_acts):
    from opentau_cli.policies.layouts import OPENPI

    local, pushed = openpi_acts[str(case["exports"][OPENPI])], openpi_acts[hub["repos"][OPENPI]]
    assert pushed["actions"] == local["actions"] and pushed["input_ids"] == local["input_ids"]
    # The download holds the export's files and the card; the local export's marker of the output convention stays home.
    assert sorted(set(local["files"]) - {".opentau-output.json"} | {"README.md"}) == sorted(set(pushed["files"]) - {".gitattributes"})
