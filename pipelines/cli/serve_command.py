"""``raylens serve``: the HTTP server (OpenAI-compatible chat, attention streaming, viewer) on Ray Serve;
``raylens browse``: the feature browser alone over an activation store, no model and no Ray."""

from __future__ import annotations

import argparse
import os

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_serve(sub)
    _add_browse(sub)


def _add_browse(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("browse", help="the feature browser over an activation store (read-only; no model, no Ray)")
    p.add_argument("--store", help="the DuckDB store (default: the config's activations.db_path)")
    p.add_argument("--config", help="YAML config (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--api-key", help="require this key on every route but /healthz (default: $RAYLENS_API_KEY)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-loopback --host without an API key, on purpose (refused otherwise)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="show token ids only (default: token text from the config's model's tokenizer files)")
    p.set_defaults(func=_cmd_browse)


def _cmd_browse(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    import uvicorn

    from engine.config import load_config
    from engine.services.store import ActivationStore
    from pipelines.serve.app import build_browser_app
    from pipelines.serve.settings import API_KEY_ENV, ServeSettings

    from .arguments import UsageError
    from .store_commands import _tokenizer

    settings = ServeSettings(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV),
                             insecure_no_auth=args.insecure_no_auth)
    config = load_config(args.config)
    path = Path(args.store or config.activations.db_path)
    if not path.is_file():
        raise UsageError(f"`--store` must name an existing activation store, got {str(path)!r}; run a job with "
                         "activations.enabled first, or pass --store")
    tokenizer = None if args.no_tokenizer else _tokenizer(config)  # token text, else ids
    # read-only: DuckDB allows one writer per file, so this runs beside no job writing to it
    store = ActivationStore(path, read_only=True, create=False)
    try:
        app = build_browser_app(store, settings, tokenizer=tokenizer, neuronpedia_url=config.sae.neuronpedia_url)
        for note in settings.startup_warnings():
            print(f"raylens: WARNING: {note}", file=sys.stderr)
        print(f"raylens: feature browser for {path} at http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        store.close()
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="HTTP: OpenAI-compatible chat with mods, attention streaming, viewer (Ray Serve)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback; any other host is reachable by others)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", help="YAML config (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.add_argument("--address", help="Ray cluster to join (default: the config's ray.address, else a new local one)")
    p.add_argument("--api-key", help="require this key on every route but /healthz (default: $RAYLENS_API_KEY)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-loopback --host without an API key, on purpose (refused otherwise)")
    p.add_argument("--allow-mod-registration", action="store_true",
                   help="enable POST /v1/mods (uploaded mods run arbitrary code; needs --api-key off loopback)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="most tokens one request may ask for")
    p.add_argument("--max-ws-connections", type=int, default=32, help="open WebSocket connections at once")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="a request running longer is cancelled")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C, how long requests in flight may finish before they are cancelled")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from engine.config import load_config
    from pipelines.serve.settings import API_KEY_ENV, ServeSettings

    from .ray_commands import prepare_ray_env

    # the key is a secret for this command only: read here, never logged (ServeSettings hides it)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    settings = ServeSettings(host=args.host, port=args.port, api_key=api_key, insecure_no_auth=args.insecure_no_auth,
                             allow_mod_registration=args.allow_mod_registration, max_new_tokens=args.max_new_tokens,
                             max_ws_connections=args.max_ws_connections, request_timeout_s=args.request_timeout_s,
                             shutdown_grace_s=args.shutdown_grace_s)
    config = load_config(args.config)
    prepare_ray_env(address=args.address or config.ray.address)
    from pipelines.serve.deployment import serve_forever

    return serve_forever(config, settings, args.address)
