"""Robot-side script run with openpi-client's own package (in its venv, numpy<2): drives `opentau serve` the way
robot code does and writes what it got as JSON. Usage: python openpi_client_driver.py PORT API_KEY OBS.npz OUT.json"""

import json
import sys

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def refused(port, key):
    try:
        WebsocketClientPolicy("127.0.0.1", port, api_key=key)
    except Exception as exc:  # websockets' InvalidStatus: the HTTP answer to the upgrade
        return f"{type(exc).__name__}: {exc}"
    return None


def error_of(client, obs):
    try:
        client.infer(obs)
    except RuntimeError as exc:
        return str(exc)
    return None


port, key, obs_path, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
with np.load(obs_path) as data:
    arrays = {k: data[k] for k in data.files}
prompt = str(arrays.pop("prompt"))
camera = [k for k in arrays if k != "observation.state"][0]
obs = {**arrays, "prompt": prompt}
client = WebsocketClientPolicy("127.0.0.1", port, api_key=key)
first = client.infer(obs)
out = {
    "metadata": client.get_server_metadata(),
    "actions": first["actions"].tolist(),
    "dtype": str(first["actions"].dtype),
    "timing": first["server_timing"],
    "seed_7": client.infer({**obs, "seed": 7})["actions"].tolist(),
    "errors": {
        "missing_camera": error_of(client, {k: v for k, v in obs.items() if k != camera}),
        "state_width": error_of(client, {**obs, "observation.state": obs["observation.state"][:-1]}),
        "state_dtype": error_of(client, {**obs, "observation.state": np.array(["a"] * len(obs["observation.state"]))}),
        "image_dtype": error_of(client, {**obs, camera: obs[camera].astype(np.int64)}),
    },
}
again = client.infer(obs)  # the same connection still serves
out["again"] = again["actions"].tolist()
out["again_timing"] = again["server_timing"]
out["no_key"] = refused(port, None)
out["wrong_key"] = refused(port, key + "x")
with open(out_path, "w") as f:
    json.dump(out, f)
