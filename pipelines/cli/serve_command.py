"""``raylens serve``: the HTTP server (OpenAI-compatible chat, attention streaming, viewer) on Ray Serve."""

from __future__ import annotations

import argparse
import os

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_serve(sub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="HTTP: OpenAI-compatible chat with mods, attention streaming, viewer (Ray Serve)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback; any other host is reachable by others)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", help="YAML config (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.add_argument("--address", help="Ray cluster to join (default: the config's ray.address, else a new local one)")
    p.add_argument("--api-key", help="require this key on every route but /healthz (default: $RAYLENS_API_KEY)")
    p.add_argument("--allow-mod-registration", action="store_true",
                   help="enable POST /v1/mods (uploaded mods run arbitrary code; needs --api-key off loopback)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="most tokens one request may ask for")
    p.add_argument("--max-ws-connections", type=int, default=32, help="open WebSocket connections at once")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="a request running longer is cancelled")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from engine.config import load_config
    from pipelines.serve.settings import API_KEY_ENV, ServeSettings

    from .ray_commands import prepare_ray_env

    # the key is a secret for this command only: read here, never logged (ServeSettings hides it)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    settings = ServeSettings(host=args.host, port=args.port, api_key=api_key,
                             allow_mod_registration=args.allow_mod_registration, max_new_tokens=args.max_new_tokens,
                             max_ws_connections=args.max_ws_connections, request_timeout_s=args.request_timeout_s)
    config = load_config(args.config)
    prepare_ray_env()
    from pipelines.serve.deployment import serve_forever

    return serve_forever(config, settings, args.address)
