"""``raylens generate`` and ``raylens candidates``: in-process generation (no Ray), mods and SAE included."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .arguments import _add_source, _read_json, _source

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_generate(sub)
    _add_candidates(sub)


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
    from engine.core.inputs import GenerationRequest
    from engine.engine import load_mods

    messages, tools, response_format, input_ids = _source(args)
    # Mods load and the request is checked before the model, so a broken mod file or a bad value
    # fails in a second, not after the model load.
    mods = load_mods(list(args.mod) + [_read_json(p, "mod payload") for p in args.mod_payload])
    request = GenerationRequest(
        prompt=args.prompt, messages=messages, input_ids=input_ids, tools=tools, response_format=response_format,
        mods=tuple(mods), max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos, request_id=args.request_id,
        payload_top_tokens=True if args.json else None)  # --json prints the payload: with its top tokens
    overrides: dict[str, dict[str, Any]] | None = None
    if args.sae or args.sae_inline:
        overrides = {"activations": {"enabled": True}, "sae": {"enabled": True}}
        if args.sae_inline:
            overrides["sae"]["mode"] = "inline"
    print("raylens: loading model…", file=sys.stderr, flush=True)
    with Engine.from_config(args.config, overrides=overrides) as engine:
        result = engine.generate(request)
    from engine.services.strict_json import dumps  # no NaN/Infinity in what we print as JSON

    failed = 1 if str(result.finish_reason) == "error" else 0  # the request failed: say so in the exit code
    if args.json:
        print(dumps({**result.to_dict(), "payload": result.payload}, indent=2))
        return failed
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
    return failed


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
