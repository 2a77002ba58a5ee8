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


def _add_source(p: argparse.ArgumentParser) -> None:
    """Exactly one of --prompt, --messages-file, --input-ids: what a request reads."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat-templated)")
    src.add_argument("--messages-file", help="JSON chat: a list of messages, or {messages, tools, response_format}")
    src.add_argument("--input-ids", help="comma-separated token ids, used as is")


def _source(args: argparse.Namespace) -> tuple[Any, Any, Any, list[int] | None]:
    """``(messages, tools, response_format, input_ids)`` from :func:`_add_source`'s arguments."""
    messages = tools = response_format = None
    if args.messages_file:
        messages, tools, response_format = _messages_from_file(args.messages_file)
    return messages, tools, response_format, _input_ids(args.input_ids)


def _input_ids(text: str | None) -> list[int] | None:
    """``--input-ids 1,2,3`` as a list (None when not given)."""
    if not text:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError("--input-ids must be comma-separated integers") from None


# ------------------------------------------------------------------------------------ generate


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate one completion in-process (no Ray)")
    _add_source(p)
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
    p.add_argument("--sae-inline", action="store_true",
                   help="like --sae, encoding inside the loop: events carry sae_features, Steer works")
    p.add_argument("--json", action="store_true", help="print the result (and payload) as JSON")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import Engine
    from engine.engine import load_mods

    messages, tools, response_format, input_ids = _source(args)
    # Mods load before the model so a broken mod file fails in a second, not after the model load.
    mods = load_mods(list(args.mod) + [_read_json(p, "mod payload") for p in args.mod_payload])
    overrides = {"activations": {"enabled": True}, "sae": {"enabled": True}} if args.sae or args.sae_inline else None
    if args.sae_inline:
        overrides["sae"]["mode"] = "inline"  # type: ignore[index]
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


# --------------------------------------------------------------------------------- candidates


def _add_candidates(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("candidates", help="n sampled completions ranked by summed log-probability (one batch)")
    _add_source(p)
    p.add_argument("-n", type=int, default=8, help="how many candidates (default 8)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--seed", type=int, default=0, help="candidate i is seeded seed + i (default 0)")
    p.add_argument("--mod", action="append", default=[], metavar="FILE.py[:function]", help="mod file (repeatable)")
    p.add_argument("--config", help="YAML config (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.add_argument("--json", action="store_true", help="print the candidates as JSON")
    p.set_defaults(func=_cmd_candidates)


def _cmd_candidates(args: argparse.Namespace) -> int:
    from engine import Engine
    from engine.engine import load_mods

    messages, _, _, input_ids = _source(args)
    mods = load_mods(list(args.mod))
    print("raylens: loading model…", file=sys.stderr, flush=True)
    with Engine.from_config(args.config) as engine:
        cands = engine.candidates(args.prompt, messages=messages, input_ids=input_ids, n=args.n, seed=args.seed,
                                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  max_tokens=args.max_tokens, mods=mods or None)
    from engine.services.strict_json import dumps

    if args.json:
        print(dumps([{"text": c.text, "token_ids": c.token_ids, "log_prob": c.log_prob,
                      "finish_reason": c.finish_reason} for c in cands], indent=2))
        return 0
    for rank, cand in enumerate(cands, start=1):
        print(f"{rank:>3}  {cand.log_prob:10.3f}  {cand.text!r}")
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
    p.add_argument("--serve", action="store_true",
                   help="only: the WebSocket server's per-token latency, bytes and concurrent tokens/s vs in-process")
    p.add_argument("--internals", action="store_true",
                   help="instead: embeddings/s batched vs one by one, and a full named-tensor dump vs a plain forward")
    p.add_argument("--concurrency", type=int, action="append", metavar="N",
                   help="instead: N concurrent requests beside transformers' padded batch of N (repeatable)")
    p.add_argument("--decode-modes", action="store_true",
                   help="instead: backend.graph_decode off / static / compile side by side, compile time included "
                        "(with --concurrency N: 1 and N requests; default 8)")
    p.add_argument("--random-model", choices=["llama31-8b"],
                   help="on a CUDA machine: benchmark this architecture with random bf16 weights (built once)")
    p.add_argument("--tokenizer", help="with --random-model: a tokenizer directory (default: the embedded model's)")
    p.set_defaults(func=lambda args: _bench_main(args))


def _bench_main(args: argparse.Namespace) -> int:
    from . import bench

    return bench.run_cli(args)


# --------------------------------------------------------------------- embed, capture, compare


def _add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="one embedding per text, in-process (no Ray; for Ray: python -m pipelines.embed)")
    p.add_argument("--texts-file", required=True, help="one text per line, or .jsonl: JSON strings or {text}")
    p.add_argument("--out", required=True, help="output: .npy (n, d) float32, or .parquet (line, text, embedding)")
    p.add_argument("--layer", type=int, help="residual stream after this block (default: the final norm's output)")
    p.add_argument("--pool", choices=("mean", "last"), default="mean", help="mean over the tokens, or the last token")
    p.add_argument("--batch-size", type=int, default=16, help="texts per forward pass")
    p.add_argument("--config", help="YAML config (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.set_defaults(func=_cmd_embed)


def _cmd_embed(args: argparse.Namespace) -> int:
    from engine import Engine

    from .embed import check_output, read_texts, write_embeddings

    lines = read_texts(args.texts_file)  # file mistakes surface before the model loads
    out = check_output(args.out)
    print("raylens: loading model…", file=sys.stderr, flush=True)
    with Engine.from_config(args.config) as engine:
        vectors = engine.embed([t.text for t in lines], layer=args.layer, pool=args.pool, batch_size=args.batch_size)
        model_id = engine.backend.info.model_id
    write_embeddings(out, lines, vectors, model_id=model_id, layer=args.layer, pool=args.pool)
    print(f"raylens: wrote {vectors.shape[0]} embeddings of {vectors.shape[1]} floats to {out}", file=sys.stderr)
    return 0


def _add_capture(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="dump named intermediate tensors of one forward pass (safetensors + manifest)")
    _add_source(p)
    p.add_argument("--names", action="append", metavar="GLOB[,GLOB…]",
                   help="internals to keep, e.g. 'blocks.*.attn.*' or blocks.3.hook_resid_post (repeatable; "
                        "default: every internal)")
    p.add_argument("--out", required=True, help="directory for tensors.safetensors and manifest.json")
    p.add_argument("--config", help="YAML config (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.set_defaults(func=_cmd_capture)


def _cmd_capture(args: argparse.Namespace) -> int:
    from engine import Engine
    from engine.model.hook_names import parse_hook_name

    names = [n.strip() for group in (args.names or ["*"]) for n in group.split(",") if n.strip()]
    for name in names:  # a misspelt exact name fails now, not after the model load
        if not any(c in name for c in "*?["):
            parse_hook_name(name)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out `{args.out}` must be a directory, but it is a file")
    messages, _, _, input_ids = _source(args)
    print("raylens: loading model…", file=sys.stderr, flush=True)
    with Engine.from_config(args.config) as engine:
        tensors = engine.capture(args.prompt, messages=messages, input_ids=input_ids, names=names, out=args.out)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"raylens: wrote {len(tensors)} tensors ({size / 2**20:.1f} MiB) to {args.out}/ "
          "(tensors.safetensors, manifest.json)", file=sys.stderr)
    return 0


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="diff two captures tensor by tensor (exit 1 on any mismatch)")
    p.add_argument("a", help="capture directory (or a .safetensors file)")
    p.add_argument("b", help="the reference: a capture directory, or a .safetensors file with the same names")
    p.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance, against b (default 1e-3)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_compare)


def _capture_inputs(path: str) -> Any:
    from engine.model.named_capture import MANIFEST_FILE

    manifest = Path(path) / MANIFEST_FILE
    return json.loads(manifest.read_text(encoding="utf-8")).get("input_ids") if manifest.is_file() else None


def _cmd_compare(args: argparse.Namespace) -> int:
    from engine.model.named_capture import compare_captures, load_capture

    diffs = compare_captures(load_capture(args.a), load_capture(args.b), rtol=args.rtol, atol=args.atol)
    inputs_a, inputs_b = _capture_inputs(args.a), _capture_inputs(args.b)
    inputs_differ = inputs_a is not None and inputs_b is not None and inputs_a != inputs_b
    statuses = ("ok", "mismatch", "shape", "only_a", "only_b")
    counts = {status: sum(d.status == status for d in diffs) for status in statuses}
    if args.json:
        print(json.dumps({"inputs_differ": inputs_differ, "counts": counts, "rtol": args.rtol, "atol": args.atol,
                          "tensors": [d.__dict__ for d in diffs]}, indent=2))
    else:
        labels = {"ok": "ok", "mismatch": "MISMATCH", "shape": "SHAPE", "only_a": f"only in {args.a}",
                  "only_b": f"only in {args.b}"}
        for d in diffs:
            shape = "x".join(map(str, d.shape_a if d.shape_a is not None else d.shape_b))
            if d.status == "shape":
                shape = f"{'x'.join(map(str, d.shape_a))} vs {'x'.join(map(str, d.shape_b))}"
            numbers = (f"  max|a-b| {d.max_abs:.3g}  out of tolerance {d.bad_fraction:.2%}"
                       if d.max_abs is not None else "")
            print(f"{labels[d.status]:<10} {d.name}  {shape}{numbers}" + (f"  ({d.detail})" if d.detail else ""))
        print(f"{len(diffs)} names: {counts['ok']} ok, {counts['mismatch']} mismatched, {counts['shape']} with "
              f"other shapes, {counts['only_a']} only in a, {counts['only_b']} only in b "
              f"(rtol {args.rtol}, atol {args.atol})")
    if inputs_differ:
        print(f"raylens: the two captures ran on different input_ids ({len(inputs_a)} vs {len(inputs_b)} tokens); "
              "their tensors are not comparable", file=sys.stderr)
    return 0 if not inputs_differ and all(d.ok for d in diffs) else 1


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
    for add in (_add_generate, _add_candidates, _add_bench, _add_embed, _add_capture, _add_compare, _add_serve):
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
