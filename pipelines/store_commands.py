"""``raylens query …``, ``raylens store …`` and ``raylens train-sae``: the activation store from
the command line. Queries open the store read-only, so they work beside nothing else writing it
(a running writer holds DuckDB's lock; the message says so)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_commands", "format_table"]


def format_table(table: Any, *, max_width: int = 60) -> str:
    """An Arrow table as aligned text columns."""
    names = table.column_names
    rows = [[_cell(v, max_width) for v in row.values()] for row in table.to_pylist()]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if not rows:
        lines.append("(no rows)")
    return "\n".join(lines)


def _cell(value: Any, max_width: int) -> str:
    if isinstance(value, float):
        text = f"{value:.4f}"
    elif isinstance(value, list):
        text = json.dumps(value)
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= max_width else text[: max_width - 1] + "…"


def _print(table: Any, as_json: bool) -> None:
    if as_json:
        for row in table.to_pylist():
            print(json.dumps(row, default=str))
    else:
        print(format_table(table))


def _open(args: argparse.Namespace, *, read_only: bool = True):
    from engine.config import load_config
    from engine.services.store import ActivationStore

    cfg = load_config(args.config)
    return cfg, ActivationStore.from_config(cfg.activations, read_only=read_only)


def _tokenizer(cfg: Any) -> Any | None:
    """The model's tokenizer for readable tokens; None (ids only) when it cannot be loaded here."""
    try:
        from transformers import AutoTokenizer

        from engine.model.loading import resolve_model_path

        return AutoTokenizer.from_pretrained(resolve_model_path(cfg.backend.model_id, cfg.backend.model_cache_dir),
                                             token=cfg.backend.hf_token)
    except Exception as err:  # hub unreachable, gated model: ids are still an answer
        print(f"raylens: showing token ids only ({err})", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------------------- query


def _cmd_query(args: argparse.Namespace) -> int:
    from engine.services import queries

    cfg, store = _open(args)
    with store:
        if args.what == "top":
            table = queries.top_features(store, args.request_id, step=args.step, limit=args.limit)
        elif args.what == "deltas":
            table = queries.feature_deltas(store, args.request_id, args.feature)
        elif args.what == "threshold":
            since = queries.parse_since(args.since) if args.since else None
            table = queries.threshold_search(store, args.feature, args.min, since=since, limit=args.limit)
        elif args.what == "tokens":
            table = queries.top_activating_tokens(store, args.feature, limit=args.limit, context=args.context)
        else:
            return _explain(cfg, store, args)
        if args.what in ("deltas", "threshold", "tokens") and not args.ids_only:
            tokenizer = _tokenizer(cfg)
            if tokenizer is not None:
                table = queries.decode_tokens(table, tokenizer)
    _print(table, args.json)
    return 0


def _explain(cfg: Any, store: Any, args: argparse.Namespace) -> int:
    from engine.services.neuronpedia import NeuronpediaClient, NeuronpediaError, explain_features
    from engine.services.sae import SAE_REGISTRY

    if not cfg.sae.neuronpedia_url:
        raise NeuronpediaError("feature explanations are off: set sae.neuronpedia_url (e.g. https://www.neuronpedia.org)")
    source = SAE_REGISTRY.get(cfg.sae.sae_id)
    template = source.neuronpedia_template if source else None
    client = NeuronpediaClient(cfg.sae.neuronpedia_url)
    try:
        table = explain_features(store, client, sae_release=source.release if source and source.release else cfg.sae.sae_id,
                                 sae_layer=cfg.sae.layer,
                                 neuronpedia_id=template.format(layer=cfg.sae.layer) if template else None,
                                 feature_ids=args.feature_ids, refresh=args.refresh)
    finally:
        client.close()
    _print(table, args.json)
    return 0


def _add_query(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("query", help="ask the activation store (read-only)")
    qs = p.add_subparsers(dest="what", required=True, metavar="QUERY")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--config")
        q.add_argument("--json", action="store_true", help="one JSON object per row")
        q.set_defaults(func=_cmd_query, ids_only=False)

    q = qs.add_parser("top", help="a request's strongest features")
    q.add_argument("--request-id", required=True)
    q.add_argument("--step", type=int)
    q.add_argument("--limit", type=int, default=20)
    common(q)
    q = qs.add_parser("deltas", help="a feature's activation token by token in a request, and its change")
    q.add_argument("--request-id", required=True)
    q.add_argument("--feature", type=int, required=True)
    q.add_argument("--ids-only", action="store_true")
    common(q)
    q = qs.add_parser("threshold", help="every request/step where a feature fired at or above a value")
    q.add_argument("--feature", type=int, required=True)
    q.add_argument("--min", type=float, required=True)
    q.add_argument("--since", help="only rows newer than this: 7d, 12h, 30m")
    q.add_argument("--limit", type=int, default=1000)
    q.add_argument("--ids-only", action="store_true")
    common(q)
    q = qs.add_parser("tokens", help="a feature's top-activating tokens with context")
    q.add_argument("--feature", type=int, required=True)
    q.add_argument("--limit", type=int, default=20)
    q.add_argument("--context", type=int, default=8)
    q.add_argument("--ids-only", action="store_true")
    common(q)
    q = qs.add_parser("explain", help="Neuronpedia explanations of features (cached in the store)")
    q.add_argument("feature_ids", type=int, nargs="+")
    q.add_argument("--refresh", action="store_true")
    common(q)
    q.set_defaults(func=_cmd_explain)


def _cmd_explain(args: argparse.Namespace) -> int:
    cfg, store = _open(args, read_only=False)  # writes the cache
    with store:
        return _explain(cfg, store, args)


# ---------------------------------------------------------------------------------------- store


def _cmd_store(args: argparse.Namespace) -> int:
    cfg, store = _open(args, read_only=args.action == "info")
    with store:
        if args.action == "info":
            print(json.dumps({"db_path": str(store.db_path), "schema_version": store.schema_version(),
                              **store.counts()}, indent=2))
        elif args.action == "export":
            result = store.export_parquet(args.out)
            print(f"exported {result.rows} rows to {result.directory} ({len(result.files)} files, by date)")
        else:
            days = args.days if args.days is not None else cfg.activations.retention_days
            result = store.apply_retention(days, compact=not args.no_compact)
            print(f"retention {days} d: deleted {result.deleted_rows} rows and {result.deleted_requests} requests; "
                  f"file {result.bytes_before:,} → {result.bytes_after:,} bytes")
    return 0


def _add_store(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="activation store housekeeping")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help_text in (("info", "schema version and row counts"),
                            ("export", "write Parquet, partitioned by date"),
                            ("retention", "delete rows older than the retention period and shrink the file")):
        a = acts.add_parser(name, help=help_text)
        a.add_argument("--config")
        if name == "export":
            a.add_argument("--out", help="directory (default: activations.parquet_path)")
        if name == "retention":
            a.add_argument("--days", type=int, help="default: activations.retention_days")
            a.add_argument("--no-compact", action="store_true", help="delete only; do not rewrite the file")
        a.set_defaults(func=_cmd_store)


def _add_train_sae(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-sae", help="train an SAE for the embedded model (see pipelines/train_sae.py)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: __import__("pipelines.train_sae", fromlist=["main"]).main(args.rest))


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_query(sub)
    _add_store(sub)
    _add_train_sae(sub)
