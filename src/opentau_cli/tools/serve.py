"""`opentau serve`: a policy behind openpi's websocket policy protocol, so robot code written for `openpi-client`
works unchanged (docs/ARCHITECTURE.md, "Serving").

The protocol: on connect the server sends one binary message, the metadata; then every binary message from the
client is one observation and gets one binary reply `{"actions": ndarray (n_action_steps, action_dim),
"server_timing": {"infer_ms": ..., "prev_total_ms": ...}}`. Messages are msgpack, numpy arrays and scalars packed as
maps (`__ndarray__` / `__npgeneric__`, raw bytes, dtype string, shape). A request the server cannot act on gets a
text frame naming the problem (the client raises it) and the connection stays open for the next one.

Observation keys are the training dataset's feature names: each camera (uint8, or float in [0, 1]: a float image
outside [0, 1] is refused, never clipped; (H, W, 3) or (3, H, W), any size: resized with padding as in training), the
state (its real width) and `prompt` (text). The metadata also says which weights (ema | live) of which checkpoint
step are served.
Sampling noise is drawn per request from a generator seeded with the server's seed, or with the request's integer
`seed` when it carries one: the same observation and seed always give the same action chunk, the chunk
`opentau eval --seed S` samples for that observation.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import torch

from opentau_cli.errors import UserError

API_KEY_ENV = "OPENTAU_SERVE_API_KEY"
PROMPT_KEY = "prompt"
SEED_KEY = "seed"
logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """An observation the policy cannot act on; its message is sent back to the client."""


# ------------------------------------------------------------------------------------------- msgpack with numpy
def _pack_default(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in "VOc":
        raise TypeError(f"cannot send a numpy array of dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send an object of type {type(obj).__name__}")


def _unpack_hook(obj: dict):
    if b"__ndarray__" in obj:
        dtype = np.dtype(obj[b"dtype"])
        if dtype.kind in "VOc":
            raise BadRequest(f"arrays of dtype {dtype} are not accepted")
        return np.ndarray(buffer=obj[b"data"], dtype=dtype, shape=tuple(obj[b"shape"]))
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


def packb(obj) -> bytes:
    """msgpack bytes, numpy arrays and scalars in openpi-client's convention."""
    return msgpack.packb(obj, default=_pack_default, use_bin_type=True)


def unpackb(data: bytes):
    """The inverse of `packb` (numpy arrays are read-only views of the message)."""
    try:
        return msgpack.unpackb(data, object_hook=_unpack_hook, raw=False)
    except BadRequest:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad bytes
        raise BadRequest(f"the message is not a msgpack observation ({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------------------------------------- the served policy
@dataclass
class ServedPolicy:
    """A policy in eval mode with what a request must carry to drive it."""

    policy: torch.nn.Module
    cameras: list[str | None]  # the dataset feature of each camera slot (None: a slot the policy saw padded)
    state_key: str
    source: str
    origin: dict = field(default_factory=dict)
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def state_width(self) -> int:
        return int(self.policy.state_dim.item())

    @property
    def action_width(self) -> int:
        return int(self.policy.action_dim.item())

    def metadata(self) -> dict:
        """What the server sends on connect: the observation it expects and the actions it answers."""
        cfg = self.policy.cfg
        return {
            "server": "opentau serve",
            "source": self.source,
            "policy_type": cfg.type,
            "preset": cfg.preset,
            "observation_keys": [c for c in self.cameras if c] + [self.state_key, PROMPT_KEY],
            "cameras": [c for c in self.cameras if c],
            "state_key": self.state_key,
            "state_dim": self.state_width,
            "prompt_key": PROMPT_KEY,
            "image_resolution": list(cfg.image_resolution),
            "action_dim": self.action_width,
            "action_horizon": cfg.n_action_steps,
            "seed": self.seed,
            "statistics": str(self.origin.get("statistics", "")),
            # Which weights (ema | live; None: a model that does not say) of which step: docs/ARCHITECTURE.md, "EMA weights".
            "weights": self.origin.get("weights"),
            "step": self.origin.get("step"),
            "checkpoint": self.origin.get("checkpoint"),
        }

    def describe(self) -> str:
        """The served weights in words, for the banner: 'EMA weights of step 60 (RUN/checkpoints/000060)'."""
        from opentau_cli.tools.inference import describe_weights

        return describe_weights(self.origin)

    def batch(self, obs) -> dict:
        """One observation as the one-sample batch the policy samples from. Raises BadRequest naming the problem."""
        from opentau_cli.data.images import resize_with_pad
        from PIL import Image

        if not isinstance(obs, dict):
            raise BadRequest(f"an observation is a map of feature name to value, not a {type(obs).__name__}")
        height, width = self.policy.cfg.image_resolution
        images = np.zeros((len(self.cameras), height, width, 3), dtype=np.uint8)
        masks = np.zeros(len(self.cameras), dtype=bool)
        for slot, camera in enumerate(self.cameras):
            if camera is None:
                continue
            if camera not in obs:
                raise BadRequest(f"missing camera '{camera}' (the observation needs {', '.join(self.metadata()['observation_keys'])})")
            images[slot] = resize_with_pad(Image.fromarray(_image_pixels(camera, obs[camera])), height, width)
            masks[slot] = True
        state = _state(self.state_key, obs.get(self.state_key), self.state_width)
        prompt = obs.get(PROMPT_KEY)
        if not isinstance(prompt, str):
            what = "missing" if prompt is None else f"a {type(prompt).__name__}"
            raise BadRequest(f"'{PROMPT_KEY}' must be the task text, a string (it is {what})")
        return {
            "images": torch.from_numpy(images.transpose(0, 3, 1, 2).astype(np.float32) * np.float32(1 / 255))[None],
            "image_masks": torch.from_numpy(masks)[None],
            "state": torch.from_numpy(state)[None],
            "task": [prompt],
        }

    def blank_observation(self) -> dict:
        """A valid observation of black images and a zero state (a warm-up request)."""
        height, width = self.policy.cfg.image_resolution
        obs = {camera: np.zeros((height, width, 3), np.uint8) for camera in self.cameras if camera}
        return {**obs, self.state_key: np.zeros(self.state_width, np.float32), PROMPT_KEY: ""}

    def request_seed(self, obs: dict) -> int:
        seed = obs.get(SEED_KEY, self.seed) if isinstance(obs, dict) else self.seed
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise BadRequest(f"'{SEED_KEY}' must be an integer, not {seed!r}")
        return int(seed)

    def infer(self, obs) -> dict:
        """The action chunk for one observation: {"actions": float32 (n_action_steps, action_dim)}."""
        from opentau_cli.tools.inference import sample

        batch, seed = self.batch(obs), self.request_seed(obs)
        with self._lock:  # one sampling at a time: concurrent clients queue instead of sharing the cores
            actions = sample(self.policy, batch, self.device, torch.Generator().manual_seed(seed))
        return {"actions": actions[0].float().numpy()}

    def infer_many(self, observations: list[dict], generators: list[torch.Generator]) -> np.ndarray:
        """Action chunks for several observations in one forward: float32 (B, n_action_steps, action_dim), row i's
        noise from generators[i] (opentau eval --env batches its envs through here)."""
        from opentau_cli.tools.inference import sample

        batches = [self.batch(obs) for obs in observations]
        batch = {key: torch.cat([b[key] for b in batches]) if key != "task" else [t for b in batches for t in b[key]]
                 for key in batches[0]}
        with self._lock:
            actions = sample(self.policy, batch, self.device, generators)
        return actions.float().numpy()


def _image_pixels(name: str, value) -> np.ndarray:
    """A camera image as uint8 (H, W, 3); floats must be in [0, 1] (as openpi's clients send them): a float image of
    0-255 values is refused rather than clipped into another image."""
    if not isinstance(value, np.ndarray):
        raise BadRequest(f"camera '{name}' must be a numpy array (H, W, 3) or (3, H, W), not a {type(value).__name__}")
    if value.ndim == 3 and value.shape[0] == 3 and value.shape[-1] != 3:
        value = value.transpose(1, 2, 0)
    if value.ndim != 3 or value.shape[-1] != 3 or min(value.shape[:2]) < 1:
        raise BadRequest(f"camera '{name}' has shape {list(value.shape)}; expected (H, W, 3) or (3, H, W)")
    if value.dtype == np.uint8:
        return np.ascontiguousarray(value)
    if value.dtype.kind == "f":
        low, high = (float(value.min()), float(value.max())) if value.size else (0.0, 0.0)
        if not (0.0 <= low and high <= 1.0):  # NaN fails both comparisons
            raise BadRequest(f"camera '{name}' is a float image with values from {low:g} to {high:g}; float images "
                             "must be in [0, 1] (send 0-255 pixels as uint8)")
        return np.ascontiguousarray((value * 255).astype(np.uint8))
    raise BadRequest(f"camera '{name}' has dtype {value.dtype}; expected uint8 (0-255) or float (0-1)")


def _state(key: str, value, width: int) -> np.ndarray:
    if value is None:
        raise BadRequest(f"missing state '{key}' ({width} numbers)")
    if isinstance(value, (list, tuple)):
        try:
            value = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise BadRequest(f"state '{key}' must be {width} numbers") from None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiu":
        what = f"dtype {value.dtype}" if isinstance(value, np.ndarray) else f"a {type(value).__name__}"
        raise BadRequest(f"state '{key}' must be a numeric array of {width} numbers, not {what}")
    if value.shape != (width,):
        raise BadRequest(f"state '{key}' has shape {list(value.shape)}; the policy was trained on {width} state dims")
    if not np.isfinite(value).all():
        raise BadRequest(f"state '{key}' holds NaN or infinity")
    return value.astype(np.float32)


# ------------------------------------------------------------------------------------------- loading
def load_served(source: str | Path, *, overrides: dict | None = None, dataset: str | None = None,
                device: str | None = None, seed: int = 0, weights: str | None = None,
                compiled: bool = False) -> ServedPolicy:
    """The policy of a run / checkpoint directory (DDP, DeepSpeed shards, LoRA), an export or a repo id, loaded as
    `opentau eval` loads it, with the observation keys of the dataset it was trained on. `compiled`: sampling's loop
    torch.compiled and compiled here, on one blank observation, before the first client waits for it."""
    from opentau_cli.data.mixture import select_member
    from opentau_cli.tools.inference import (
        device_named, for_inference, from_checkpoint, from_model, is_training_checkpoint, model_policy_config,
        pinned_model,
    )

    overrides = dict(overrides or {})
    dev = device_named(device)
    path = Path(str(source)).expanduser()
    if is_training_checkpoint(path):
        cfg, member, policy, origin = from_checkpoint(path, overrides, dataset, weights)
        features = None
    else:
        local, hub = pinned_model(str(source))  # a repo id: one commit, from the Hugging Face cache
        cfg = model_policy_config(local, overrides)
        member = select_member(cfg, dataset)
        policy, origin = from_model(cfg, local, None)
        if str(origin.get("statistics", "")).startswith("none"):
            raise UserError(f"{source}: the model carries no normalization statistics ({origin['statistics']}); "
                            "serve a training checkpoint or an export of one.")
        features = _model_features(local)
        origin.update(hub)
    cameras, state_key = _observation_keys(cfg, member, features, given_slots="dataset.num_cameras" in overrides)
    for_inference(policy, dev)  # as eval samples: bf16 on CUDA, so the served chunk is eval's
    shown = f"{origin['hub']['repo_id']}@{origin['hub']['commit']}" if "hub" in origin else str(source)
    if (origin.get("checkpoint") or {}).get("url"):  # a copy of a checkpoint in remote storage: its URL and step
        shown = origin["checkpoint"]["resolved_from"]
    served = ServedPolicy(policy, cameras, state_key, shown, origin, seed, dev)
    if compiled:
        policy.compile_sampling()
        try:
            served.infer(served.blank_observation())
        except Exception as exc:  # no C++ compiler, an op the compiler refuses: the policy serves as well without
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise UserError(f"--compile: torch.compile could not compile the sampling loop on this machine "
                            f"({type(exc).__name__}: {first}); serve without --compile.") from None
    return served


def _model_features(source: str) -> dict | None:
    """The `input_features` of a model's config.json (LeRobot's layout lists every camera and the state), if any."""
    import json

    from opentau_cli.policies.pretrained import Checkpoint
    from opentau_cli.tools.export import MODEL_CONFIG

    with Checkpoint(source) as ckpt:
        config = ckpt.root / MODEL_CONFIG
        if not config.is_file():
            return None
        try:
            features = json.loads(config.read_text()).get("input_features")
        except (ValueError, AttributeError):
            return None
    return features if isinstance(features, dict) and features else None


def _observation_keys(cfg, member, features: dict | None, given_slots: bool = False) -> tuple[list[str | None], str]:
    """(camera feature per slot, state feature): the model's declared features, else the training dataset's. A model
    that lists its cameras gets a slot for each (the default dataset.num_cameras is 1); a camera is never dropped:
    the policy would act on fewer images than it was trained on."""
    num = cfg.dataset.num_cameras
    if features:
        cams = [k for k, f in features.items() if isinstance(f, dict) and f.get("type") == "VISUAL"]
        states = [k for k, f in features.items() if isinstance(f, dict) and f.get("type") == "STATE"]
        if cams and states:
            if len(cams) > num and given_slots:
                raise UserError(f"the model lists {len(cams)} cameras ({', '.join(cams)}) but --dataset.num_cameras={num}: "
                                f"give it at least {len(cams)} or leave it out.")
            num = max(num, len(cams))
            return cams + [None] * (num - len(cams)), states[0]
    from opentau_cli.tools.export import camera_features

    return camera_features(cfg, member), member.state_key


# ------------------------------------------------------------------------------------------- the server
def _authorized(headers, api_key: str | None) -> bool:
    if not api_key:
        return True
    given = headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Api-Key {api_key}".encode())


class PolicyServer:
    """openpi's websocket policy protocol in front of a ServedPolicy."""

    def __init__(self, served: ServedPolicy, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None):
        self.served, self.host, self.port, self.api_key = served, host, port, api_key or None
        self._metadata = packb(served.metadata())

    def _process_request(self, connection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        if not _authorized(request.headers, self.api_key):
            logger.warning("refused a client without the API key (%s)", connection.remote_address)
            return connection.respond(http.HTTPStatus.UNAUTHORIZED, "Missing or wrong API key: send 'Authorization: Api-Key <key>'.\n")
        return None

    async def _handle(self, websocket) -> None:
        import websockets

        await websocket.send(self._metadata)
        previous_total = None
        while True:
            try:
                message = await websocket.recv()
            except websockets.ConnectionClosed:
                return
            start = time.monotonic()
            try:
                if isinstance(message, str):
                    raise BadRequest("observations are binary msgpack messages, not text")
                obs = unpackb(message)
                began = time.monotonic()
                reply = await asyncio.to_thread(self.served.infer, obs)
                timing = {"infer_ms": (time.monotonic() - began) * 1000}
                if previous_total is not None:
                    timing["prev_total_ms"] = previous_total * 1000
                reply["server_timing"] = timing
                await websocket.send(packb(reply))
                previous_total = time.monotonic() - start
            except BadRequest as exc:
                await _send_quietly(websocket, f"Bad observation: {exc}.")
            except UserError as exc:  # the policy's own checks (e.g. a prompt it cannot tokenize)
                await _send_quietly(websocket, f"Bad observation: {exc}")
            except websockets.ConnectionClosed:
                return
            except Exception:  # a fault of the server: tell the client, close this connection, keep serving others
                logger.exception("inference failed")
                await _send_quietly(websocket, traceback.format_exc())
                await websocket.close(code=1011, reason="Internal server error; traceback in the previous frame.")
                return

    async def serve(self, stop: asyncio.Future, ready=None) -> None:
        """Serve until `stop` completes; `ready(port)` is called once the socket listens."""
        from websockets.asyncio.server import serve

        try:
            server = await serve(self._handle, self.host, self.port, compression=None, max_size=None,
                                 process_request=self._process_request)
        except OSError as exc:
            raise UserError(f"Cannot listen on {self.host}:{self.port} ({exc.strerror or exc}).") from None
        async with server:
            port = next(iter(server.sockets)).getsockname()[1]
            if ready is not None:
                ready(port)
            await stop
            server.close()  # closes open connections with 1001 (going away)
            await server.wait_closed()


async def _send_quietly(websocket, text: str) -> None:
    import websockets

    try:
        await websocket.send(text)
    except websockets.ConnectionClosed:
        pass


def run_server(server: PolicyServer, ready=None) -> None:
    """Serve until SIGTERM (or SIGINT, which then raises KeyboardInterrupt); both close every connection first."""

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        interrupted = False

        def on_signal(signum):
            nonlocal interrupted
            interrupted = signum == signal.SIGINT
            if not stop.done():
                stop.set_result(signum)

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            await server.serve(stop, ready)
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
        return interrupted

    if asyncio.run(main()):
        raise KeyboardInterrupt
