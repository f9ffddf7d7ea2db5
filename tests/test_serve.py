"""`opentau serve`: a tiny run's checkpoint served over openpi's websocket policy protocol and driven by the real
`openpi-client` package (its own venv, numpy<2) as robot code drives it: the served chunk equals the policy's own
sample_actions for the training pipeline's sample of the same frame and seed; malformed requests get an error naming
the problem and the server keeps serving; the API key refuses other clients; SIGTERM closes cleanly (exit 0).
In-process: the request checks and the message format."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from conftest import EXAMPLES, opentau_bin, run_cli
from peer_envs import peer_python

pytestmark = pytest.mark.full

TINY = str(EXAMPLES / "pi05_tiny_config.json")
CLIENT = ("openpi-client", "0.1.2")
DRIVER = os.path.join(os.path.dirname(__file__), "openpi_client_driver.py")
CAMERA, STATE = "observation.images.top", "observation.state"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve") / "run"
    trained = run_cli(["train", f"--config_path={TINY}", f"--output_dir={run}", "--steps=2", "--save_freq=2",
                       "--validation.val_freq=0"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    return run


def _first_frame(run):
    """(the raw camera image, state and task of episode 0's first frame, and the training pipeline's sample of it)."""
    import pyarrow.parquet as pq

    from opentau_cli.config.load import load_config
    from opentau_cli.data.build import make_dataset
    from opentau_cli.data.mixture import select_member
    from opentau_cli.data.synth import resolve_dataset_root

    cfg = load_config(run / "checkpoints" / "last" / "train_config.json", {})
    member = select_member(cfg, None)
    root = resolve_dataset_root(member.root)
    sample = make_dataset(cfg, member, root, [0])[0]
    row = pq.read_table(root / "data" / "chunk-000" / "episode_000000.parquet").slice(0, 1).to_pylist()[0]
    from opentau_cli.data.images import decode_image

    image = np.asarray(decode_image(row[CAMERA]["bytes"]).convert("RGB"))
    return image, np.asarray(row[STATE], dtype=np.float32), sample["task"], sample


def _start(args, env):
    proc = subprocess.Popen([opentau_bin(), "serve", *args], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline, seen = time.monotonic() + 180, ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 1)
        if ready:
            line = proc.stderr.readline()
            seen += line
            if line.startswith("Serving ") or not line:
                break
        if proc.poll() is not None:
            break
    assert "Serving " in seen, seen + (proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(seen.split("ws://127.0.0.1:")[1].split(";")[0].split(" ")[0])


def test_the_real_openpi_client_drives_a_served_checkpoint(tiny_run, tmp_path):
    from opentau_cli.data.sampler import collate
    from opentau_cli.tools.inference import from_checkpoint

    python = peer_python(*CLIENT)
    image, state, task, sample = _first_frame(tiny_run)
    obs_path, out_path = tmp_path / "obs.npz", tmp_path / "out.json"
    np.savez(obs_path, **{CAMERA: image, STATE: state, "prompt": np.array(task)})
    # One thread, as this test process computes its reference (another thread count may sum in another order).
    server, port = _start([str(tiny_run), "--port", "0"], {"OPENTAU_SERVE_API_KEY": "s3cret", "OMP_NUM_THREADS": "1"})
    try:
        client = subprocess.run([python, DRIVER, str(port), "s3cret", str(obs_path), str(out_path)],
                                capture_output=True, text=True, timeout=300)
        assert client.returncode == 0, client.stderr[-3000:]
    finally:
        server.send_signal(signal.SIGTERM)
        rest = server.communicate(timeout=60)[1]
    assert server.returncode == 0, rest
    assert "Server stopped." in rest and "Traceback" not in rest
    got = json.loads(out_path.read_text())

    # The metadata lists the observation keys: the training dataset's feature names.
    meta = got["metadata"]
    assert meta["observation_keys"] == [CAMERA, STATE, "prompt"]
    assert meta["state_dim"] == 4 and meta["action_dim"] == 2 and meta["action_horizon"] == 10 and meta["seed"] == 0

    # The same chunk as the policy samples for the training pipeline's sample of that frame, with the same seed.
    _, _, policy, _ = from_checkpoint(tiny_run, {}, None)
    policy.eval()
    batch = collate([sample])
    expected = {}
    for seed in (0, 7):
        noise = torch.randn(1, policy.cfg.chunk_size, policy.cfg.max_action_dim, generator=torch.Generator().manual_seed(seed))
        expected[seed] = policy.sample_actions(batch, noise=noise)[0].numpy().tolist()
    assert got["dtype"] == "float32"
    assert got["actions"] == expected[0] and got["seed_7"] == expected[7] and got["actions"] != got["seed_7"]
    assert got["timing"]["infer_ms"] > 0 and got["again_timing"]["prev_total_ms"] > 0

    # Malformed requests: one error naming the problem each, and the connection keeps serving.
    errors = got["errors"]
    assert f"missing camera '{CAMERA}'" in errors["missing_camera"]
    assert f"state '{STATE}' has shape [3]" in errors["state_width"] and "4 state dims" in errors["state_width"]
    assert f"state '{STATE}' must be a numeric array" in errors["state_dtype"] and "<U1" in errors["state_dtype"]
    assert f"camera '{CAMERA}' has dtype int64" in errors["image_dtype"]
    assert all("Traceback" not in e for e in errors.values())
    assert got["again"] == expected[0]

    # The key: a client without it, or with another, is refused at the handshake (HTTP 401).
    assert "401" in got["no_key"] and "401" in got["wrong_key"]


# ------------------------------------------------------------------------------------------- in-process
@pytest.fixture(scope="module")
def served():
    from opentau_cli.config.load import load_config
    from opentau_cli.policies import build_policy
    from opentau_cli.tools.serve import ServedPolicy

    cfg = load_config(TINY, [])
    torch.manual_seed(0)
    policy = build_policy(cfg.policy).eval()
    return ServedPolicy(policy, [CAMERA, None], STATE, "tiny")


def _obs(**change):
    obs = {CAMERA: np.zeros((48, 64, 3), np.uint8), STATE: np.zeros(8, np.float32), "prompt": "reach"}
    obs.update(change)
    return {k: v for k, v in obs.items() if v is not None}


@pytest.mark.parametrize("change, message", [
    ({CAMERA: None}, f"missing camera '{CAMERA}'"),
    ({STATE: None}, f"missing state '{STATE}'"),
    ({STATE: np.zeros(3, np.float32)}, "has shape [3]; the policy was trained on 8 state dims"),
    ({STATE: np.zeros((1, 8), np.float32)}, "has shape [1, 8]"),
    ({STATE: np.array([True] * 8)}, "not dtype bool"),
    ({STATE: np.full(8, np.nan, np.float32)}, "NaN or infinity"),
    ({CAMERA: np.zeros((48, 64), np.uint8)}, "has shape [48, 64]; expected (H, W, 3) or (3, H, W)"),
    ({CAMERA: np.zeros((48, 64, 3), np.int16)}, "has dtype int16"),
    ({CAMERA: "pixels"}, "must be a numpy array"),
    # 0-255 values in a float image: refused, not clipped into a white image (floats are [0, 1], as openpi sends them)
    ({CAMERA: np.full((48, 64, 3), 200.0, np.float32)}, f"camera '{CAMERA}' is a float image with values from 200 to 200; "
                                                          "float images must be in [0, 1] (send 0-255 pixels as uint8)"),
    ({CAMERA: np.linspace(-0.5, 1, 48 * 64 * 3).reshape(48, 64, 3)}, "values from -0.5 to 1; float images must be in [0, 1]"),
    ({CAMERA: np.full((48, 64, 3), np.nan, np.float32)}, "float images must be in [0, 1]"),
    ({"prompt": None}, "'prompt' must be the task text, a string (it is missing)"),
    ({"prompt": 3}, "(it is a int)"),
    ({"seed": 1.5}, "'seed' must be an integer"),
])
def test_a_malformed_observation_is_refused_naming_the_problem(served, change, message):
    from opentau_cli.tools.serve import BadRequest

    with pytest.raises(BadRequest) as caught:
        served.infer(_obs(**change))
    assert message in str(caught.value)


def test_images_of_any_size_and_layout_reach_the_policy_as_training_lays_them_out(served):
    from PIL import Image

    from opentau_cli.data.images import resize_with_pad

    rng = np.random.default_rng(0)
    hwc = rng.integers(0, 256, (120, 200, 3), dtype=np.uint8)
    # As the dataset reader scales decoded frames.
    expected = resize_with_pad(Image.fromarray(hwc), 32, 32).transpose(2, 0, 1).astype(np.float32) * np.float32(1 / 255)
    for image in (hwc, hwc.transpose(2, 0, 1), hwc.astype(np.float32) / 255):
        batch = served.batch(_obs(**{CAMERA: image}))
        assert batch["images"].shape == (1, 2, 3, 32, 32) and batch["image_masks"].tolist() == [[True, False]]
        assert np.abs(batch["images"][0, 0].numpy() - expected).max() <= 1 / 255 + 1e-6
    assert np.array_equal(served.batch(_obs(**{CAMERA: hwc}))["images"][0, 0].numpy(), expected)


def test_the_wire_format_is_msgpack_with_numpy_maps():
    import msgpack

    from opentau_cli.tools.serve import BadRequest, packb, unpackb

    message = {"actions": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int64(3), "text": "a"}
    raw = msgpack.unpackb(packb(message), raw=False)
    assert raw["actions"] == {b"__ndarray__": True, b"data": np.arange(6, dtype=np.float32).tobytes(), b"dtype": "<f4",
                              b"shape": [2, 3]}
    assert raw["n"] == {b"__npgeneric__": True, b"data": 3, b"dtype": "<i8"}
    back = unpackb(packb(message))
    assert back["actions"].dtype == np.float32 and back["actions"].tolist() == message["actions"].tolist()
    assert back["n"] == 3 and isinstance(back["n"], np.int64) and back["text"] == "a"
    with pytest.raises(BadRequest, match="not a msgpack observation"):
        unpackb(b"\xc1garbage")


def test_serve_benchmark_smoke_tabulates_in_process_and_served_side_by_side(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    results = tmp_path / "BENCHMARKS.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OPENTAU_DEBUG", None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_serve.py"), "--smoke", "--results", str(results)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = results.read_text()
    assert "## opentau serve: requests/s and latency vs in-process" in text and "--smoke" in text
    for row in ("in-process (ServedPolicy.infer, worker thread)", "serve, 1 client", "serve, 4 clients"):
        assert f"| {row} | " in text and "req/s, p50 " in text
    assert "(12 requests)" in text  # 4 clients x 3 requests, every reply received


def test_serve_mistakes_exit_2_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from opentau_cli.cli.main import app

    for args, needle in ((["serve", str(tmp_path), "--port", "70000"], "--port=70000: a TCP port is 0-65535."),
                         (["serve", str(tmp_path / "missing")], "no such file or directory")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and needle in result.stderr and "Traceback" not in result.output


def test_a_model_listing_its_cameras_is_served_with_every_one_and_a_smaller_slot_count_is_refused():
    """A LeRobot-layout config.json lists each camera; the default dataset.num_cameras (1) must not drop the second."""
    from opentau_cli.config.load import load_config
    from opentau_cli.errors import UserError
    from opentau_cli.tools.serve import _observation_keys

    features = {"observation.images.top": {"type": "VISUAL", "shape": [3, 224, 224]},
                "observation.images.wrist": {"type": "VISUAL", "shape": [3, 224, 224]},
                "observation.state": {"type": "STATE", "shape": [8]}}
    cams, state = _observation_keys(load_config(None, {}), None, features)
    assert cams == ["observation.images.top", "observation.images.wrist"] and state == "observation.state"
    cams, _ = _observation_keys(load_config(None, {"dataset.num_cameras": "3"}), None, features, given_slots=True)
    assert cams == ["observation.images.top", "observation.images.wrist", None]
    with pytest.raises(UserError, match=r"lists 2 cameras .* but --dataset.num_cameras=1: give it at least 2"):
        _observation_keys(load_config(None, {"dataset.num_cameras": "1"}), None, features, given_slots=True)


def test_serve_compile_compiles_before_the_first_client_and_serves_the_eager_chunk(tiny_run):
    """`opentau serve --compile`: sampling's loop is torch.compiled and compiled while loading (a warm-up chunk), so
    the first robot request compiles nothing; the chunk is the eager one up to fused kernels' rounding."""
    from torch._dynamo.utils import counters

    from opentau_cli.tools.serve import load_served

    image, state, task, _ = _first_frame(tiny_run)
    obs = {CAMERA: image, STATE: state, "prompt": task}
    eager = load_served(tiny_run).infer(obs)["actions"]
    compiled = load_served(tiny_run, compiled=True)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # compiled while loading
    got = compiled.infer(obs)["actions"]
    assert counters["stats"]["unique_graphs"] == graphs  # the request reused what loading compiled
    np.testing.assert_allclose(got, eager, rtol=0, atol=1e-5 * np.abs(eager).max())


def test_serve_compile_where_the_compiler_fails_is_refused_in_one_line(tiny_run, monkeypatch):
    import torch._inductor.config as inductor_config

    from opentau_cli.errors import UserError
    from opentau_cli.tools.serve import load_served

    torch._dynamo.reset()  # compile anew rather than reuse a graph compiled by another test in this process
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # a cached build would need no compiler
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    with pytest.raises(UserError, match=r"^--compile: torch.compile could not compile the sampling loop on this "
                                        r"machine \(.*\); serve without --compile\.$"):
        load_served(tiny_run, compiled=True)


def test_the_server_sends_which_weights_of_which_step_it_serves_and_refuses_a_0_255_float_image_to_the_client(tiny_run):
    """In-process server: GET /healthz answers OK; for a websocket client, the metadata on connect records the weights (a run without an EMA:
    live) and the checkpoint's step; a float image of 0-255 values gets a text frame naming the range, as every
    refused request does, and the connection serves the next request."""
    import asyncio
    import threading

    from websockets.sync.client import connect

    from opentau_cli.tools.serve import PolicyServer, load_served, packb, unpackb

    served = load_served(tiny_run, device="cpu")
    ckpt = (tiny_run / "checkpoints" / "000002").resolve()
    assert served.describe() == f"live weights of step 2 ({ckpt})"
    image, state, task, _ = _first_frame(tiny_run)
    loop = asyncio.new_event_loop()
    stop, bound = loop.create_future(), []
    thread = threading.Thread(target=lambda: loop.run_until_complete(
        PolicyServer(served, port=0).serve(stop, lambda port: bound.append(port))), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not bound and time.monotonic() < deadline:
            time.sleep(0.05)
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{bound[0]}/healthz", timeout=30) as health:  # a plain HTTP probe
            assert (health.status, health.read()) == (200, b"OK\n")
        with connect(f"ws://127.0.0.1:{bound[0]}", max_size=None) as ws:
            meta = unpackb(ws.recv())
            assert (meta["weights"], meta["step"]) == ("live", 2)
            assert meta["checkpoint"] == {"path": str(ckpt), "step": 2, "resolved_from": str(tiny_run)}
            ws.send(packb({CAMERA: image.astype(np.float32), STATE: state, "prompt": task}))
            refused = ws.recv()
            assert refused == (f"Bad observation: camera '{CAMERA}' is a float image with values from {image.min():g} to "
                               f"{image.max():g}; float images must be in [0, 1] (send 0-255 pixels as uint8).")
            ws.send(packb({CAMERA: image.astype(np.float32) / 255, STATE: state, "prompt": task}))
            assert unpackb(ws.recv())["actions"].shape == (10, 2)
    finally:
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(timeout=60)
