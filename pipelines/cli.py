"""The ``raylens`` command line.

Every subcommand is a ``main``-style function; user mistakes (``RaylensError`` and the SDK's
``ValueError`` subclasses) print one line saying what to do and exit 2. ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main"]

EXIT_USAGE = 2


class UsageError(Exception):
    """A command-line argument is wrong."""


def _read_json(path: str, what: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{what} `{path}` does not exist")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UsageError(f"{what} `{path}` is not valid JSON: line {err.lineno}: {err.msg}") from None


def _messages_from_file(path: str) -> tuple[Any, Any, Any]:
    """A chat file is a JSON list of messages, or ``{"messages", "tools", "response_format"}``."""
    data = _read_json(path, "messages file")
    if isinstance(data, dict):
        return data.get("messages"), data.get("tools"), data.get("response_format")
    return data, None, None


# ------------------------------------------------------------------------------------ generate


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate one completion in-process (no Ray)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat-templated)")
    src.add_argument("--messages-file", help="JSON chat: a list of messages, or {messages, tools, response_format}")
    src.add_argument("--input-ids", help="comma-separated token ids, used as is")
    p.add_argument("--mod", action="append", default=[], metavar="FILE.py[:function]",
                   help="mod file to run (repeatable, in order)")
    p.add_argument("--mod-payload", action="append", default=[], metavar="FILE.json",
                   help="mod payload JSON (inline source, directory or bundle form), repeatable")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--request-id")
    p.add_argument("--config", help="YAML config (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.add_argument("--sae", action="store_true", help="extract SAE features into the activation store")
    p.add_argument("--json", action="store_true", help="print the result (and payload) as JSON")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import Engine
    from engine.engine import load_mods

    messages = tools = response_format = input_ids = None
    if args.messages_file:
        messages, tools, response_format = _messages_from_file(args.messages_file)
    if args.input_ids:
        try:
            input_ids = [int(t) for t in args.input_ids.replace(" ", "").split(",") if t]
        except ValueError:
            raise UsageError("--input-ids must be comma-separated integers") from None
    # Mods load before the model so a broken mod file fails in a second, not after the model load.
    mods = load_mods(list(args.mod) + [_read_json(p, "mod payload") for p in args.mod_payload])
    overrides = {"activations": {"enabled": True}, "sae": {"enabled": True}} if args.sae else None
    print("raylens: loading model…", file=sys.stderr, flush=True)
    with Engine.from_config(args.config, overrides=overrides) as engine:
        result = engine.generate(
            args.prompt, messages=messages, input_ids=input_ids, tools=tools, response_format=response_format, mods=mods,
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, ignore_eos=args.ignore_eos, request_id=args.request_id,
        )
    from engine.services.strict_json import dumps  # no NaN/Infinity in what we print as JSON

    if args.json:
        print(dumps({**result.to_dict(), "payload": result.payload}, indent=2))
        return 0
    if result.tool_calls is not None:
        print(dumps({"tool_calls": result.tool_calls}, indent=2))
    else:
        print(result.output_text)
    meta = result.metadata
    summary = (f"[finish={result.finish_reason} tokens={meta['generated_tokens']} "
               f"{meta['tokens_per_s']:.1f} tok/s request={result.request_id}]")
    if result.error is not None:
        summary += f" mod error: {result.error}"
    if result.ignored_actions:
        summary += f" ({len(result.ignored_actions)} mod action(s) ignored; see --json)"
    if "sae" in meta:
        summary += (f" SAE rows stored in {engine.config.activations.db_path} "
                    f"(raylens query top --request-id {result.request_id})")
    print(summary, file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------- bench


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="tokens/s of raylens paths beside bare model.generate")
    p.add_argument("--config")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--sae", action="store_true", help="also: SAE encode, store append, generation with nearline SAE")
    p.add_argument("--ray", action="store_true", help="also: the Ray path end to end vs the in-process engine")
    p.set_defaults(func=lambda args: _bench_main(args))


def _bench_main(args: argparse.Namespace) -> int:
    from . import bench

    return bench.run_cli(args)


# --------------------------------------------------------------------------------------- serve


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

    from .ray_commands import prepare_ray_env
    from .serve.settings import API_KEY_ENV, ServeSettings

    # the key is a secret for this command only: read here, never logged (ServeSettings hides it)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    settings = ServeSettings(host=args.host, port=args.port, api_key=api_key,
                             allow_mod_registration=args.allow_mod_registration, max_new_tokens=args.max_new_tokens,
                             max_ws_connections=args.max_ws_connections, request_timeout_s=args.request_timeout_s)
    config = load_config(args.config)
    prepare_ray_env()
    from .serve.deployment import serve_forever

    return serve_forever(config, settings, args.address)


# ---------------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylens", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_generate, _add_bench, _add_serve):
        add(sub)
    from . import ray_commands, store_commands

    store_commands.add_commands(sub)
    ray_commands.add_commands(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from engine.errors import RaylensError
    from mods.loading import ModPayloadError
    from mods.validation import InvalidActionError

    return (UsageError, RaylensError, ModPayloadError, InvalidActionError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="raylens: %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except _user_errors() as err:
        if args.debug:
            raise
        print(f"raylens: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("raylens: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `raylens query … | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
