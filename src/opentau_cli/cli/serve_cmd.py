"""`opentau serve`."""

from __future__ import annotations

import os
from typing import Optional

import typer

from opentau_cli.cli.common import (
    OVERRIDES_CONTEXT, DeviceOpt, PolicySourceArg, WeightsOpt, config_overrides, handle_errors, local_source,
)


@handle_errors
def serve_cmd(
    ctx: typer.Context,
    source: PolicySourceArg,
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one, printed)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Refuse clients that do not send "
                                                                 "'Authorization: Api-Key KEY' (default: env OPENTAU_SERVE_API_KEY)."),
    device: DeviceOpt = None,
    seed: int = typer.Option(0, "--seed", help="Seed of every request's sampling noise (a request's integer 'seed' overrides it)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="The dataset of a mixture run to serve, by its name "
                                                                 "(default: the first), with its own statistics."),
    weights: WeightsOpt = None,
    compiled: bool = typer.Option(False, "--compile", help="torch.compile sampling's loop before serving (tens of "
                                                           "seconds at start; faster chunks on a GPU)."),
) -> None:
    """Serve a policy over openpi's websocket policy protocol: robot code written for `openpi-client` works unchanged.

    On connect the server sends its metadata (the observation keys: the training dataset's cameras and state, and
    'prompt'); each observation gets {"actions": (n_action_steps, action_dim), "server_timing": ...}. SIGTERM or
    Ctrl-C closes every connection and stops.

    Examples:

      opentau serve outputs/train/pi05/checkpoints/000040 --port 8000

      OPENTAU_SERVE_API_KEY=secret opentau serve exported/pi05_lerobot --host 0.0.0.0

      opentau serve my-org/pi05-pick-bottle@main     # a pushed export, pinned to main's commit (printed)
    """
    from opentau_cli.errors import UserError
    from opentau_cli.tools.inference import describe_hub
    from opentau_cli.tools.serve import API_KEY_ENV, PolicyServer, load_served, run_server

    if not 0 <= port <= 65535:
        raise UserError(f"--port={port}: a TCP port is 0-65535.")
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    served = load_served(local_source(source), overrides=config_overrides(ctx), dataset=dataset, device=device, seed=seed,
                         weights=weights, compiled=compiled)
    server = PolicyServer(served, host, port, key)
    meta = served.metadata()
    if describe_hub(served.origin):
        typer.echo(describe_hub(served.origin), err=True)

    def ready(bound: int) -> None:
        typer.echo(f"Serving {served.source} ({meta['policy_type']} {meta['preset']}, {served.describe()}) on ws://{host}:{bound}"
                   f"{' (API key required)' if key else ''}; observation keys: {', '.join(meta['observation_keys'])}.",
                   err=True)

    run_server(server, ready)
    typer.echo("Server stopped.", err=True)


def register(app: typer.Typer) -> None:
    app.command("serve", context_settings=OVERRIDES_CONTEXT)(serve_cmd)
