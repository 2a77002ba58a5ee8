"""``raylens submit``, ``raylens status`` and ``raylens ingest-server``.

Ray 2.60 with token authentication: ``ray.init()`` writes ``~/.ray/auth_token`` and clients must
then run with ``RAY_AUTH_MODE=token`` set *before* Ray is imported. :func:`prepare_ray_env` does
that for these commands; with the plain ``ray job submit`` CLI export it yourself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_commands", "prepare_ray_env"]

REPO = Path(__file__).resolve().parent.parent
_UPLOAD_EXCLUDES = [".venv", ".git", "artifacts", "bench-results", "**/__pycache__", "*.duckdb", "*.duckdb.wal"]


def prepare_ray_env() -> None:
    """Set ``RAY_AUTH_MODE=token`` when a token exists (must run before ``import ray``)."""
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


# --------------------------------------------------------------------------------------- submit


def _cmd_submit(args: argparse.Namespace) -> int:
    from engine.config import load_config

    from .generate import read_prompts

    prompts = Path(args.prompts).resolve()
    read_prompts(prompts)  # a bad line fails here, naming the line, before anything is submitted
    config = load_config(args.config)
    out = Path(args.out).resolve()
    prepare_ray_env()
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(args.address or config.ray.dashboard_url)
    config_arg = f" --config {Path(args.config).resolve()}" if args.config else ""
    entrypoint = (f"python -m pipelines.generate --workdir {Path.cwd()}{config_arg} "
                  f"--prompts {prompts} --out {out}")
    job_id = client.submit_job(entrypoint=entrypoint,
                               runtime_env={"working_dir": str(REPO), "excludes": _UPLOAD_EXCLUDES})
    print(f"raylens: submitted job {job_id}; results go to {out}", file=sys.stderr, flush=True)
    if args.no_wait:
        print(job_id)
        return 0
    shown = 0
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    deadline = time.monotonic() + args.timeout
    while True:
        logs = client.get_job_logs(job_id)
        if len(logs) > shown:
            sys.stderr.write(logs[shown:])
            sys.stderr.flush()
            shown = len(logs)
        status = client.get_job_status(job_id)
        if status in terminal:
            break
        if time.monotonic() > deadline:
            print(f"raylens: job {job_id} still {status} after {args.timeout} s; it keeps running "
                  f"(ray job logs {job_id})", file=sys.stderr)
            return 1
        time.sleep(1.0)
    print(f"raylens: job {job_id} {status}", file=sys.stderr)
    return 0 if status == JobStatus.SUCCEEDED else 1


# --------------------------------------------------------------------------------------- status


def _cmd_status(args: argparse.Namespace) -> int:
    from engine.config import load_config

    prepare_ray_env()
    import ray

    from .topology import INGEST, STORE, actor_names, connect

    config = load_config(args.config)
    connect(config, args.address)
    timeout = min(30.0, config.ray.call_timeout_s)
    report: dict[str, Any] = {"namespace": config.ray.namespace, "actors": {}}
    for name in actor_names(config):
        try:
            handle = ray.get_actor(name, namespace=config.ray.namespace)
        except ValueError:
            report["actors"][name] = "not running"
            continue
        method = {STORE: "counts", INGEST: "stats"}.get(name, "stats")
        try:
            report["actors"][name] = ray.get(getattr(handle, method).remote(), timeout=timeout)
        except Exception as err:  # a dead or busy actor is a status, not a crash
            report["actors"][name] = f"unreachable: {type(err).__name__}"
    report["cluster"] = {"nodes": len([n for n in ray.nodes() if n.get("Alive")]),
                         "resources": ray.cluster_resources()}
    print(json.dumps(report, indent=2, default=str))
    return 0


# -------------------------------------------------------------------------------- ingest-server


def _cmd_ingest_server(args: argparse.Namespace) -> int:
    from engine.services.ingest_server import IngestServer

    server = IngestServer(args.db, host=args.host, port=args.port)
    print(f"raylens ingest server: {server.url} (payloads kept in {args.db}); Ctrl-C stops it", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.stop()
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="run a prompts file as a Ray Job (JobSubmissionClient), with its logs")
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", default="results.jsonl")
    p.add_argument("--config")
    p.add_argument("--address", help="dashboard URL (default: ray.dashboard_url)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to follow the job")
    p.set_defaults(func=_cmd_submit)

    p = sub.add_parser("status", help="raylens actors, SAE backlog, store rows, ingest spool")
    p.add_argument("--config")
    p.add_argument("--address", help="Ray address (default: ray.address)")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("ingest-server", help="a local ingest backend (validates, keeps payloads in DuckDB)")
    p.add_argument("--db", default="./artifacts/ingest/ingest.duckdb")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=6767)
    p.set_defaults(func=_cmd_ingest_server)
