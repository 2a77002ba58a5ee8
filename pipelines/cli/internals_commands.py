"""``raylens embed``, ``raylens capture`` and ``raylens compare``: the model's internals in-process
(embeddings, named intermediate tensors) and the diff of two captures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .arguments import UsageError, _add_source, _source

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_embed(sub)
    _add_capture(sub)
    _add_compare(sub)


def _add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed",
                       help="one embedding per text, in-process (no Ray; for Ray: python -m pipelines.jobs.embed)")
    p.add_argument("--texts-file", required=True, help="one text per line, or .jsonl: JSON strings or {text}")
    p.add_argument("--out", required=True, help="output: .npy (n, d) float32, or .parquet (line, text, embedding)")
    p.add_argument("--layer", type=int, help="residual stream after this block (default: the final norm's output)")
    p.add_argument("--pool", choices=("mean", "last"), default="mean", help="mean over the tokens, or the last token")
    p.add_argument("--batch-size", type=int, default=16, help="texts per forward pass")
    p.add_argument("--config", help="YAML config (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.set_defaults(func=_cmd_embed)


def _cmd_embed(args: argparse.Namespace) -> int:
    from engine import Engine
    from pipelines.jobs.embed import check_output, read_texts, write_embeddings

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
            shape = "x".join(map(str, d.shape_a if d.shape_a is not None else d.shape_b or ()))
            if d.status == "shape":
                shape = f"{'x'.join(map(str, d.shape_a or ()))} vs {'x'.join(map(str, d.shape_b or ()))}"
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
