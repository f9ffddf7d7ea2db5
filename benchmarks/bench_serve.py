"""Benchmark: `opentau serve` (openpi's websocket policy protocol) against calling the policy in-process.

Requests per second and p50 / p99 latency of one action chunk per request, for pi05_small on this machine: the
policy called in-process, then served on a loopback port to 1 client and to 4 concurrent clients (each waiting for
its reply before sending again, as robot code does), side by side in one run. The weights are a fresh build (speed
does not depend on their values); the observation is one camera image of 480x640 and the state.

    python benchmarks/bench_serve.py              # pi05_small, 20 requests per measure
    python benchmarks/bench_serve.py --smoke      # tiny preset, a few requests (CI)
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import numpy as np

from _common import SMALL_CONFIG, TINY_CONFIG, Headline, base_parser, p99, print_rows, report

CAMERA, STATE = "observation.images.top", "observation.state"


def _served(config):
    import torch

    from opentau_cli.config.load import load_config
    from opentau_cli.policies import build_policy
    from opentau_cli.tools.serve import ServedPolicy

    cfg = load_config(config, [])
    torch.manual_seed(0)
    policy = build_policy(cfg.policy).eval()
    state_width = 4  # the demo robot's
    policy.set_stats({k: {s: [0.0 if s in ("mean", "q01") else 1.0] * state_width for s in ("mean", "std", "q01", "q99")}
                      for k in ("state", "action")})
    return ServedPolicy(policy, [CAMERA], STATE, str(config))


def _observation(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {CAMERA: rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), STATE: rng.standard_normal(4).astype(np.float32),
            "prompt": "Move the blue dot to the red target."}


class _Background:
    """The server on a loopback port, in its own thread and event loop."""

    def __init__(self, served):
        from opentau_cli.tools.serve import PolicyServer

        self.server = PolicyServer(served, "127.0.0.1", 0)
        self.port = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._thread.start()
        self._ready.wait(60)

    async def _main(self):
        self._stop = self._loop.create_future()

        def ready(port):
            self.port = port
            self._ready.set()

        await self.server.serve(self._stop, ready)

    def close(self):
        self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(30)


def _client_latencies(port: int, requests: int, offset: int) -> list[float]:
    from websockets.sync.client import connect

    from opentau_cli.tools.serve import packb, unpackb

    out = []
    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        unpackb(ws.recv())  # the metadata
        for i in range(requests):
            message = packb(_observation(offset + i))
            start = time.perf_counter()
            ws.send(message)
            reply = ws.recv()
            out.append(time.perf_counter() - start)
            assert isinstance(reply, bytes), reply
    return out


def _served_run(port: int, clients: int, requests: int) -> tuple[list[float], float]:
    results: list[list[float]] = [[] for _ in range(clients)]

    def one(k):
        results[k] = _client_latencies(port, requests, 1000 * k)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [x for r in results for x in r], time.perf_counter() - start


def _in_process(served, requests: int) -> tuple[list[float], float]:
    """Calls of ServedPolicy.infer in a worker thread, as the server makes them. (On a loaded 2-core machine, torch's
    2 OpenMP threads in the main thread measured 30x slower than the same call from a worker thread: this compares
    the protocol, not that.)"""
    out, wall = [], []

    def calls():
        served.infer(_observation(0))  # warm-up: first-call allocations
        start = time.perf_counter()
        for i in range(requests):
            began = time.perf_counter()
            served.infer(_observation(i))
            out.append(time.perf_counter() - began)
        wall.append(time.perf_counter() - start)

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    return out, wall[0]


def _summary(latencies: list[float], wall: float) -> str:
    ms = sorted(x * 1000 for x in latencies)
    return f"{len(ms) / wall:.2f} req/s, p50 {statistics.median(ms):.0f} ms, p99 {p99(ms):.0f} ms ({len(ms)} requests)"


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--requests", type=int, default=20, help="Requests per client and measure.")
    args = parser.parse_args()
    config = args.config or (TINY_CONFIG if args.smoke else SMALL_CONFIG)
    requests = 3 if args.smoke else args.requests
    served = _served(config)
    inproc, inproc_wall = _in_process(served, requests)
    server = _Background(served)
    try:
        one, one_wall = _served_run(server.port, 1, requests)
        four, four_wall = _served_run(server.port, 4, requests)
    finally:
        server.close()
    rows = [
        ("config", f"{config.name} ({'smoke' if args.smoke else 'full'}), {served.policy.cfg.preset}, "
                   f"{served.policy.cfg.num_inference_steps} denoising steps, chunk {served.policy.cfg.chunk_size}, "
                   "1 camera 480x640 resized to " + "x".join(map(str, served.policy.cfg.image_resolution))),
        ("in-process (ServedPolicy.infer, worker thread)", _summary(inproc, inproc_wall)),
        ("serve, 1 client", _summary(one, one_wall)),
        ("serve, 4 clients", _summary(four, four_wall)),
        ("serve 1 client / in-process throughput", f"{(len(one) / one_wall) / (len(inproc) / inproc_wall):.2f}x"),
    ]
    print_rows("Benchmark: opentau serve vs in-process inference", rows)
    report(args, "opentau serve: requests/s and latency vs in-process", rows,
           ["requests include packing the observation (msgpack) and the loopback round trip; the server samples one "
            "chunk at a time, so 4 clients queue (their latency includes the wait)"],
           Headline(f"{dict(rows)['serve 1 client / in-process throughput']} throughput, serve 1 client / in-process"))


if __name__ == "__main__":
    main()
