"""``raylens query …``, ``raylens store …`` and ``raylens train-sae``: the activation store from
the command line.

Queries open the store read-only. DuckDB lets one process hold a file for writing and then no
other process may open it, even read-only; when the holder is raylens' StoreActor (a Ray
deployment), the query is sent to that actor instead (``ray.address`` of the config). Any other
holder gets an error naming the process.

Housekeeping never creates a store: ``store retention``/``export`` on a path with no store is an
error, not a new empty file. ``store info`` reads every block, so DuckDB's checksums find a damaged
file (``--quick`` skips that).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
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
        from engine.services.strict_json import dumps

        text = dumps(value, default=str)
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= max_width else text[: max_width - 1] + "…"


def _print(table: Any, as_json: bool) -> None:
    from engine.services.strict_json import dumps

    if as_json:
        for row in table.to_pylist():
            print(dumps(row, default=str))
    else:
        print(format_table(table))


def _open(args: argparse.Namespace, *, read_only: bool = True, create: bool = False):
    from engine.config import load_config
    from engine.services.store import ActivationStore

    cfg = load_config(args.config)
    return cfg, ActivationStore.from_config(cfg.activations, read_only=read_only, create=create)


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


def _query_call(args: argparse.Namespace) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The query function's name and arguments, checked here so a bad value fails before any
    store or cluster is touched."""
    from engine.services import queries

    check = queries.check_int
    if args.what == "top":
        if args.step is not None:
            check("step", args.step, 0)
        return "top_features", (args.request_id,), {"step": args.step, "limit": check("limit", args.limit, 1),
                                                    "order": args.order}
    if args.what == "deltas":
        return "feature_deltas", (args.request_id, check("feature", args.feature, 0)), {}
    if args.what == "threshold":
        since = queries.parse_since(args.since) if args.since else None
        return "threshold_search", (check("feature", args.feature, 0), args.min), {
            "since": since, "limit": check("limit", args.limit, 1)}
    return "top_activating_tokens", (check("feature", args.feature, 0),), {
        "limit": check("limit", args.limit, 1), "context": check("context", args.context, 0)}


def _cmd_query(args: argparse.Namespace) -> int:
    from engine.config import load_config
    from engine.services import queries
    from engine.services.store import ActivationStore, StoreLockedError

    name, call_args, call_kwargs = _query_call(args)
    cfg = load_config(args.config)
    try:
        store = ActivationStore.from_config(cfg.activations, read_only=True)
    except StoreLockedError as locked:
        table = query_through_store_actor(cfg, locked, name, call_args, call_kwargs)
    else:
        with store:
            table = _run_query(store, name, call_args, call_kwargs)
    if args.what in ("deltas", "threshold", "tokens") and not args.ids_only:
        tokenizer = _tokenizer(cfg)
        if tokenizer is not None:
            table = queries.decode_tokens(table, tokenizer)
    _print(table, args.json)
    return 0


def _run_query(store: Any, name: str, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> Any:
    """Query ``name`` on a store opened here. DuckDB finds a damaged block only when a query reads
    it; then the store is verified, so the error is the one ``store info`` gives (naming the damaged
    table), not a traceback."""
    import duckdb

    from engine.services import queries
    from engine.services.store import StoreError

    try:
        return getattr(queries, name)(store, *call_args, **call_kwargs)
    except duckdb.Error as err:
        store.verify()  # raises StoreCorruptError naming the damaged table
        raise StoreError(f"the query `{name}` failed on `{store.db_path}`: {str(err).splitlines()[0]}") from None


def query_through_store_actor(cfg: Any, locked: Exception, name: str, call_args: tuple[Any, ...],
                              call_kwargs: dict[str, Any]) -> Any:
    """Run query ``name`` on the StoreActor that holds ``cfg``'s store; when there is none (or no
    cluster), raise ``locked`` with what to do."""
    from engine.errors import RaylensError
    from engine.services.store import StoreLockedError

    from .ray_commands import prepare_ray_env

    prepare_ray_env(cfg.ray.connect_timeout_s, cfg.ray.address)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    from pipelines.cluster.connection import connect

    db_path = str(Path(cfg.activations.db_path).resolve())
    how = (f"stop the process that holds it, or run the query where raylens' Ray cluster runs "
           f"(ray.address = {cfg.ray.address}, namespace {cfg.ray.namespace})")
    owned = not ray.is_initialized()  # leave a caller's own Ray connection as it was
    try:
        connect(cfg)
    except RaylensError as err:
        raise StoreLockedError(f"{locked}. No Ray cluster to ask instead ({err}); {how}") from None
    try:
        handle = _store_actor_for(cfg, db_path)
        if handle is None:
            raise StoreLockedError(f"{locked}. No raylens StoreActor in namespace {cfg.ray.namespace} holds "
                                   f"`{db_path}`; {how}")
        return ray.get(handle.query.remote(name, *call_args, **call_kwargs), timeout=cfg.ray.call_timeout_s)
    except RayTaskError as err:  # the query's own error (bad argument, schema), raised in the actor
        if isinstance(err.cause, RaylensError):
            raise err.cause from None
        raise
    except (GetTimeoutError, RayActorError) as err:
        raise StoreLockedError(f"the StoreActor holding `{db_path}` did not answer within ray.call_timeout_s = "
                               f"{cfg.ray.call_timeout_s} s ({type(err).__name__}); see `raylens status`") from None
    finally:
        if owned:
            ray.shutdown()


def _store_actor_for(cfg: Any, db_path: str) -> Any | None:
    """The StoreActor whose DuckDB file is ``db_path``: the one this config names first, else any
    raylens StoreActor in the namespace that reports that file (one built with other settings)."""
    import ray

    from pipelines.cluster.actor_specs import STORE, actor_roles
    from pipelines.cluster.ending import listed_names

    namespace = cfg.ray.namespace
    names = [actor_roles(cfg)[STORE]]
    names += sorted(n for n in listed_names(namespace) if n.startswith(f"{STORE}-") and n not in names)
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=namespace)
            rows = ray.get(handle.sql.remote(
                "SELECT path FROM duckdb_databases() WHERE database_name = current_database()"),
                timeout=cfg.ray.call_timeout_s)
        except (ValueError, ray.exceptions.RayError):
            continue  # gone meanwhile, or not answering
        if rows and str(Path(rows[0][0]).resolve()) == db_path:
            return handle
    return None


def _explain(cfg: Any, store: Any, args: argparse.Namespace) -> int:
    from engine.services.neuronpedia import NeuronpediaClient, NeuronpediaError, explain_features
    from engine.services.sae import SAE_REGISTRY, format_for_layer

    if not cfg.sae.neuronpedia_url:
        raise NeuronpediaError("feature explanations are off: set sae.neuronpedia_url (e.g. https://www.neuronpedia.org)")
    source = SAE_REGISTRY.get(cfg.sae.sae_id)
    template = source.neuronpedia_template if source else None
    client = NeuronpediaClient(cfg.sae.neuronpedia_url)
    try:
        release = source.release if source and source.release else cfg.sae.sae_id
        table = explain_features(store, client, sae_release=release,
                                 sae_layer=cfg.sae.layer,
                                 neuronpedia_id=format_for_layer(template, cfg.sae.layer) if template else None,
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

    q = qs.add_parser("top", help="a request's features, most specific first (dense ones flagged)")
    q.add_argument("--request-id", required=True)
    q.add_argument("--step", type=int)
    q.add_argument("--limit", type=int, default=20)
    q.add_argument("--order", choices=("specificity", "activation"), default="specificity",
                   help="specificity: peak activation over the feature's store-wide mean (default); "
                        "activation: peak activation")
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
    from engine.services.queries import check_int

    for feature in args.feature_ids:
        check_int("feature", feature, 0)
    cfg, store = _open(args, read_only=False)  # writes the cache
    with store:
        return _explain(cfg, store, args)


# ---------------------------------------------------------------------------------------- store


def _cmd_store(args: argparse.Namespace) -> int:
    from engine.services.queries import check_int
    from engine.services.store import MAX_AGE_DAYS
    from engine.services.strict_json import dumps

    if args.action == "retention" and args.days is not None:
        check_int("days", args.days, 1, MAX_AGE_DAYS)
    # retention writes; info and export only read, so they work beside a reader
    cfg, store = _open(args, read_only=args.action != "retention")
    with store:
        if args.action == "info":
            if not args.quick:
                store.verify()  # raises StoreCorruptError (exit 2) naming the damaged table
            print(dumps({"db_path": str(store.db_path), "schema_version": store.schema_version(),
                         "integrity": "not checked (--quick)" if args.quick else "ok", **store.counts()}, indent=2))
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
        if name == "info":
            a.add_argument("--quick", action="store_true", help="skip reading every block (DuckDB's checksums)")
        if name == "export":
            a.add_argument("--out", help="directory (default: activations.parquet_path)")
        if name == "retention":
            a.add_argument("--days", type=int, help="default: activations.retention_days")
            a.add_argument("--no-compact", action="store_true", help="delete only; do not rewrite the file")
        a.set_defaults(func=_cmd_store)


def _add_train_sae(sub: argparse._SubParsersAction) -> None:
    from pipelines.sae_training.train import arguments

    p = sub.add_parser("train-sae", parents=[arguments()], help="train an SAE for the embedded model",
                       description="Train a TopK SAE on the embedded model's residual stream with sae-lens "
                                   "(pipelines/sae_training/train.py says how).")
    p.set_defaults(func=_cmd_train_sae)


def _cmd_train_sae(args: argparse.Namespace) -> int:
    from pipelines.sae_training.train import config_from, run

    return run(config_from(args), args)


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_query(sub)
    _add_store(sub)
    _add_train_sae(sub)
