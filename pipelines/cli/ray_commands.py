"""``raylens submit``, ``raylens status``, ``raylens stop``, ``raylens scale`` and ``raylens ingest-server``.

``submit`` runs a prompts file as a Ray Job whose entrypoint holds no user value: the arguments
travel in the job's environment, since Ray runs entrypoints through a shell. ``submit``,
``status`` and ``stop`` first check that the dashboard or cluster answers within
``ray.connect_timeout_s`` (one line and exit 2 otherwise, never minutes of Ray's retries).

Ray 2.60 with token authentication: ``ray.init()`` writes ``~/.ray/auth_token`` and clients must
then run with ``RAY_AUTH_MODE=token`` set *before* Ray is imported. :func:`prepare_ray_env` does
that for these commands; with the plain ``ray job submit`` CLI export it yourself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_commands", "prepare_ray_env", "job_request"]

REPO = Path(__file__).resolve().parents[2]
_UPLOAD_EXCLUDES = [".venv", ".git", "artifacts", "bench-results", "**/__pycache__", "*.duckdb", "*.duckdb.wal"]


def prepare_ray_env(connect_timeout_s: float | None = None, address: str | None = None) -> None:
    """Set ``RAY_AUTH_MODE=token`` when a token exists, bound how long ``ray.init`` retries a GCS
    that does not answer (it would retry for tens of seconds), and keep a cluster on loopback on
    loopback; must run before ``import ray``.

    On Linux Ray dials a loopback address (``127.0.0.1:6379``) at this machine's outward address
    instead, unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set when Ray is imported; a head
    started on loopback does not answer there, and ``ray.init`` retries for ever. So when the
    address this command joins (``RAY_ADDRESS`` first, as Ray reads it, else ``address``) is on
    loopback, the variable is set here unless the user set it. (``auto`` is resolved by Ray
    itself, after it is imported: :func:`pipelines.cluster.connection.connect` then refuses a
    loopback cluster Ray would dial elsewhere, in one line.)"""
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
    if connect_timeout_s is not None:
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(max(1, math.ceil(connect_timeout_s))))
    from pipelines.cluster.addresses import is_loopback_address  # imports no Ray

    if is_loopback_address(os.environ.get("RAY_ADDRESS") or address or ""):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


# --------------------------------------------------------------------------------------- submit


def job_request(args: argparse.Namespace, cwd: Path) -> tuple[str, dict[str, Any]]:
    """The entrypoint and runtime_env of the Ray Job for ``raylens submit``.

    Ray runs an entrypoint through a shell, so no user value may be part of it: a crafted
    ``--out`` would run a command on the cluster, and a path with a space would split. The
    entrypoint is a constant; the arguments travel, encoded, in the job's environment.
    """
    from pipelines.jobs.generate import JOB_ARGS_ENV, encode_job_args, job_entrypoint

    argv = ["--workdir", str(cwd), "--prompts", str(Path(args.prompts).resolve()),
            "--out", str(Path(args.out).resolve())]
    if args.config:
        argv += ["--config", str(Path(args.config).resolve())]
    runtime_env = {"working_dir": str(REPO), "excludes": _UPLOAD_EXCLUDES,
                   "env_vars": {JOB_ARGS_ENV: encode_job_args(argv)}}
    return job_entrypoint(), runtime_env


def _cmd_submit(args: argparse.Namespace) -> int:
    from engine.config import load_config
    from pipelines.jobs.generate import read_prompts

    read_prompts(Path(args.prompts).resolve())  # a bad line fails here, naming the line, before anything is submitted
    config = load_config(args.config)
    out = Path(args.out).resolve()
    prepare_ray_env()
    from ray.job_submission import JobStatus, JobSubmissionClient

    from pipelines.cluster.connection import probe_address

    address = args.address or config.ray.dashboard_url
    probe_address(address, config.ray.connect_timeout_s, what="Ray dashboard (Jobs API)", key="ray.dashboard_url")
    client = JobSubmissionClient(address)
    entrypoint, runtime_env = job_request(args, Path.cwd())
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
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


# --------------------------------------------------------------------------------- status, stop


def _raylens_actors(namespace: str) -> list[str]:
    from pipelines.cluster.actor_specs import RAYLENS_PREFIX
    from pipelines.cluster.ending import listed_names

    return sorted(n for n in listed_names(namespace) if n.startswith(RAYLENS_PREFIX))


def _cmd_status(args: argparse.Namespace) -> int:
    from engine.config import load_config

    config = load_config(args.config)
    prepare_ray_env(config.ray.connect_timeout_s, args.address or config.ray.address)
    import ray

    from pipelines.cluster.actor_specs import GENERATOR, INGEST, STORE, actor_roles
    from pipelines.cluster.connection import connect
    from pipelines.cluster.scaling import running_replicas

    connect(config, args.address)
    timeout = min(30.0, config.ray.call_timeout_s)
    report: dict[str, Any] = {"namespace": config.ray.namespace, "actors": {}}
    roles = actor_roles(config)
    for index, name in running_replicas(config).items():  # however many `raylens scale` left running
        roles[GENERATOR if index == 0 else f"{GENERATOR}-{index}"] = name
    for role, name in roles.items():
        try:
            handle = ray.get_actor(name, namespace=config.ray.namespace)
        except ValueError:
            report["actors"][role] = "not running"
            continue
        method = {STORE: "counts", INGEST: "stats"}.get(role, "stats")
        try:
            report["actors"][role] = {"actor": name, **ray.get(getattr(handle, method).remote(), timeout=timeout)}
        except Exception as err:  # a dead or busy actor is a status, not a crash
            report["actors"][role] = f"unreachable: {type(err).__name__}"
    # actors of other configs (another store, SAE, resources) in the namespace: `raylens stop --all` ends them
    report["other_actors"] = [n for n in _raylens_actors(config.ray.namespace) if n not in roles.values()]
    report["cluster"] = {"nodes": len([n for n in ray.nodes() if n.get("Alive")]),
                         "resources": ray.cluster_resources()}
    print(json.dumps(report, indent=2, default=str))
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    """Stop this config's actors (or, with --all, every raylens actor in the namespace): the way to
    replace actors that run with other settings. Jobs running on them fail."""
    from engine.config import load_config

    config = load_config(args.config)
    prepare_ray_env(config.ray.connect_timeout_s, args.address or config.ray.address)
    from pipelines.cluster.actor_specs import actor_names, generator_prefix
    from pipelines.cluster.connection import connect
    from pipelines.cluster.ending import end_named_actors

    connect(config, args.address)
    running = set(_raylens_actors(config.ray.namespace))
    # the config's generator replicas, however many `raylens scale` left running
    ours = set(actor_names(config)) | {n for n in running if n.startswith(generator_prefix(config))}
    names = sorted(running) if args.all else sorted(n for n in ours if n in running)
    # waited for: a job started right after must not find one of them still listed, and get it
    left = end_named_actors(config.ray.namespace, names, timeout_s=config.ray.call_timeout_s)
    print(json.dumps({"namespace": config.ray.namespace, "stopped": [n for n in names if n not in left],
                      "still_listed": left}))
    if left:
        print(f"raylens: Ray still lists {left} {config.ray.call_timeout_s:g} s (ray.call_timeout_s) after they were "
              "killed; check the cluster with `ray list actors` and run `raylens stop` again", file=sys.stderr)
        return 1
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    """Add or remove generator replicas of the config's running set; removed ones drain first."""
    from engine.config import load_config

    config = load_config(args.config)
    prepare_ray_env(config.ray.connect_timeout_s)
    from pipelines.cluster.connection import connect
    from pipelines.cluster.scaling import scale

    connect(config, args.address)
    report = scale(config, args.replicas, progress=lambda line: print(f"raylens: {line}", file=sys.stderr, flush=True))
    print(json.dumps({"namespace": config.ray.namespace, **report}))
    if report["still_draining"]:
        print(f"raylens: replica(s) {report['still_draining']} still run requests after {config.ray.call_timeout_s:g} s "
              "(ray.call_timeout_s); they take no new ones. Run `raylens scale` again to end them once idle",
              file=sys.stderr)
        return 1
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

    p = sub.add_parser("stop", help="stop this config's raylens actors (--all: every raylens actor in the namespace)")
    p.add_argument("--config")
    p.add_argument("--address", help="Ray address (default: ray.address)")
    p.add_argument("--all", action="store_true", help="every raylens actor in the namespace, whatever its config")
    p.set_defaults(func=_cmd_stop)

    p = sub.add_parser("scale", help="run N generator replicas of the config (removed ones finish their requests "
                                     "first)")
    p.add_argument("replicas", type=int, help="how many generator replicas should run")
    p.add_argument("--config")
    p.add_argument("--address", help="Ray address (default: ray.address)")
    p.set_defaults(func=_cmd_scale)

    p = sub.add_parser("ingest-server", help="a local ingest backend (validates, keeps payloads in DuckDB)")
    p.add_argument("--db", default="./artifacts/ingest/ingest.duckdb")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=6767)
    p.set_defaults(func=_cmd_ingest_server)
