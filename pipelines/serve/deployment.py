"""``raylens serve`` on Ray Serve: one FastAPI-ingress replica in front of the shared GeneratorActor
replicas (``ray.generators``; each request goes where the replica router puts it, see
:mod:`pipelines.cluster.router`).

The replica holds no model. It gets the config's actors through :func:`pipelines.cluster.topology.build_topology`
(named by a key of the config, get-or-create), so ``raylens serve`` and Ray Jobs run with the same
config share one GeneratorActor, with its SAE workers, StoreActor and IngestActor: an HTTP or
WebSocket request is one more request in that generator's step loop, batched with whatever else
runs there, and recorded like a job's (store row, ingest payload). The routes reach the actor
through :class:`~pipelines.serve.remote_engine.RemoteEngine`: requests stream token by token (the
actor's ``stream`` is a Ray streaming generator), and a client that disconnects, times out or hits
a stop string cancels its request in the actor (``GeneratorActor.cancel``), freeing its batch slot.
The replica itself loads only the tokenizer and asks for ``REPLICA_NUM_CPUS`` CPUs and no GPU; the
model's resources are the generator's (``ray.generator_*``).

SAE features on the stream (``sae_features: true``) need a generator that encodes inline
(``sae.mode: inline``); with the default nearline mode its SAE runs on the SAE workers (features
go to the store only), so ``GET /api/v1/model/info`` reports ``sae_features_available: false`` and
such requests get ``FEATURES_UNAVAILABLE``.

The cluster: the running one when there is one (``ray.address``), else a new local one bound to
127.0.0.1. The HTTP proxy listens on ``--host``/``--port``. The actors are detached: on a running
cluster they keep running after ``raylens serve`` stops (``raylens stop`` removes them).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from engine.config import RaylensConfig

from .settings import ServeSettings

__all__ = ["build_deployment", "deploy", "ensure_ray", "serve_forever"]

APP_NAME = "raylens"
# The replica relays tokens and decodes text; the generator holds the model. The actors of
# configs/local.yaml ask for the 2 CPUs of a 2-core box already, so the replica asks for none.
REPLICA_NUM_CPUS = 0.0


class _Ingress:
    """The replica: connects to the config's GeneratorActor once, then serves :func:`app.build_app`."""

    def __init__(self, config: RaylensConfig, settings: ServeSettings) -> None:
        from .features_api import StoreActorReader
        from .remote_engine import RemoteEngine

        self.engine = RemoteEngine.connect(config)
        self.store = StoreActorReader.of_config(config)  # the feature browser asks the actor that owns the file
        self.settings = settings

    def __serve_build_asgi_app__(self) -> Any:
        from .app import build_app

        return build_app(self.engine, self.settings, store=self.store)


def build_deployment(config: RaylensConfig, settings: ServeSettings) -> Any:
    """The bound Serve application (not yet running)."""
    from ray import serve

    ingress = serve.ingress()(_Ingress)
    deployment = serve.deployment(
        ingress, name="raylens", num_replicas=1,
        # every open WebSocket and stream is an ongoing request; HTTP calls come on top
        max_ongoing_requests=settings.max_ws_connections + 64,
        ray_actor_options={"num_cpus": REPLICA_NUM_CPUS},
        # taken down (SIGTERM, Ctrl-C): requests in flight get the grace period to finish
        graceful_shutdown_timeout_s=settings.shutdown_grace_s, graceful_shutdown_wait_loop_s=0.5,
    )
    return deployment.bind(config, settings)


def ensure_ray(config: RaylensConfig, address: str | None = None) -> None:
    """Join the cluster the config or ``address`` names (``auto``: ``RAY_ADDRESS`` or the one this
    machine recorded, probed first, so a stale record is one line within seconds); with ``auto``
    and no cluster found, start a local one on 127.0.0.1."""
    import ray

    from engine.errors import ClusterUnreachableError
    from pipelines.cluster.connection import connect, resolve_auto

    if ray.is_initialized():
        return
    target = address or config.ray.address
    if target == "auto":
        try:
            target = resolve_auto(target)
        except ClusterUnreachableError:  # none recorded: a Ray of this server's own
            print("raylens: no running Ray cluster; starting a local one on 127.0.0.1", file=sys.stderr, flush=True)
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, namespace=config.ray.namespace,
                     log_to_driver=False, configure_logging=False)
            return
    connect(config, target)


def deploy(config: RaylensConfig, settings: ServeSettings) -> str:
    """Start Serve's proxy on the settings' host/port and run the app; the base URL."""
    from ray import serve

    _refuse_a_running_app()
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_deployment(config, settings), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{settings.host}:{settings.port}"


def _refuse_a_running_app() -> None:
    """One ``raylens serve`` per cluster: a second would replace the first's app (Serve's
    ``run`` swaps an app of the same name in place), cutting off its clients without a word."""
    from ray import serve

    from engine.errors import ServerAlreadyRunningError

    try:
        running = serve.status().applications
    except Exception:  # no Serve on this cluster yet: nothing to replace
        return
    app = running.get(APP_NAME)
    if app is not None and str(getattr(app, "status", "")).split(".")[-1] not in ("DELETING", "NOT_STARTED"):
        raise ServerAlreadyRunningError(
            f"a `raylens serve` must not already run on this cluster, got its app {APP_NAME!r} "
            f"({str(app.status).split('.')[-1]}): stop that server first (Ctrl-C in its terminal), or serve from "
            "another Ray cluster (--address)", parameter="serve", value=APP_NAME)


def serve_forever(config: RaylensConfig, settings: ServeSettings, address: str | None = None) -> int:
    """``raylens serve``: deploy, print where, and run until SIGTERM or Ctrl-C; then stop taking
    requests, give those in flight ``settings.shutdown_grace_s`` to finish, cancel what still runs
    on the generators, take the app down and return (within the grace period and a few seconds)."""
    from ray import serve

    for note in settings.startup_warnings():
        print(f"raylens: WARNING: {note}", file=sys.stderr, flush=True)
    ensure_ray(config, address)
    # after Ray's start (ray.init installs a SIGTERM handler that aborts the process) and before the
    # deploy: Serve's proxy answers as soon as the replica is up, while `serve.run` may still be
    # waiting on the app's status, so a SIGTERM can come before the deploy returns
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("raylens: starting the Serve replica and the generator actors (loading the model)…", file=sys.stderr,
          flush=True)
    try:
        url = deploy(config, settings)
    except BaseException:
        signal.signal(signal.SIGTERM, previous)
        raise
    print(f"raylens: serving {config.backend.model_id} at {url}  (viewer: {url}/, OpenAI: {url}/v1, "
          f"attention API: {url}/api/v1). Ctrl-C stops.", file=sys.stderr, flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print(f"raylens: stopping: requests in flight have {settings.shutdown_grace_s:g} s to finish…",
              file=sys.stderr, flush=True)
        serve.delete(APP_NAME)  # Serve drains the replica for up to the grace period, then stops it
        cancelled = _cancel_streams(config)
        serve.shutdown()
        signal.signal(signal.SIGTERM, previous)
        print(f"raylens: stopped ({cancelled} stream(s) still running were cancelled).", file=sys.stderr, flush=True)
    return 0


def _cancel_streams(config: RaylensConfig) -> int:
    """Cancel the HTTP streams still running on the config's generators after the server's replica
    went away (nobody reads them any more); a Ray job's requests are left alone. How many."""
    import ray

    from pipelines.cluster.replicas import ReplicaSet

    try:
        replicas = ReplicaSet(config)
        replicas.discover()
        handles = list(replicas.handles.values())
        refs = [handle.cancel_streams.remote() for handle in handles]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=config.ray.call_timeout_s)
        return sum(int(ray.get(ref)) for ref in done)
    except Exception as err:  # the cluster is going away too: nothing left to cancel
        print(f"raylens: could not reach the generators to cancel their streams: {type(err).__name__}: {err}",
              file=sys.stderr, flush=True)
        return 0
