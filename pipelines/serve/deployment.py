"""``raylens serve`` on Ray Serve: one FastAPI-ingress replica that owns an Engine.

Why the replica holds the engine instead of calling the GeneratorActor: the actor's interface is
one whole request per call (``generate(request) -> dict``), with no way to hand back tokens as they
are made or to cancel a request whose client left. Streaming needs the engine's request handle in
the same process as the socket. The replica is placed with the generator's resources from the
config (``ray.generator_num_cpus`` / ``ray.generator_num_gpus``), and every HTTP or WebSocket
request is one more request in that engine's shared step loop.

The cluster: the running one when there is one (``ray.address``), else a new local one bound to
127.0.0.1. The HTTP proxy listens on ``--host``/``--port``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from engine.config import RaylensConfig

from .settings import ServeSettings

__all__ = ["build_deployment", "deploy", "ensure_ray", "serve_forever"]

APP_NAME = "raylens"


class _Ingress:
    """The replica: loads the engine once, then serves :func:`app.build_app` over it."""

    def __init__(self, config: RaylensConfig, settings: ServeSettings) -> None:
        from engine import Engine

        self.engine = Engine(config)
        self.settings = settings

    def __serve_build_asgi_app__(self) -> Any:
        from .app import build_app

        return build_app(self.engine, self.settings)


def build_deployment(config: RaylensConfig, settings: ServeSettings) -> Any:
    """The bound Serve application (not yet running)."""
    from ray import serve

    ingress = serve.ingress()(_Ingress)
    deployment = serve.deployment(
        ingress, name="raylens", num_replicas=1,
        # every open WebSocket and stream is an ongoing request; HTTP calls come on top
        max_ongoing_requests=settings.max_ws_connections + 64,
        ray_actor_options={"num_cpus": config.ray.generator_num_cpus, "num_gpus": config.ray.generator_num_gpus},
    )
    return deployment.bind(config, settings)


def ensure_ray(config: RaylensConfig, address: str | None = None) -> None:
    """Join the configured cluster if one runs; otherwise start a local one on 127.0.0.1."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=address or config.ray.address, namespace=config.ray.namespace, log_to_driver=False,
                 configure_logging=False)
    except ConnectionError:
        if address:
            raise
        print("raylens: no running Ray cluster; starting a local one on 127.0.0.1", file=sys.stderr, flush=True)
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, namespace=config.ray.namespace,
                 log_to_driver=False, configure_logging=False)


def deploy(config: RaylensConfig, settings: ServeSettings) -> str:
    """Start Serve's proxy on the settings' host/port and run the app; the base URL."""
    from ray import serve

    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_deployment(config, settings), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{settings.host}:{settings.port}"


def serve_forever(config: RaylensConfig, settings: ServeSettings, address: str | None = None) -> int:
    """``raylens serve``: deploy, print where, and run until Ctrl-C, then take the app down."""
    from ray import serve

    for note in settings.startup_warnings():
        print(f"raylens: WARNING: {note}", file=sys.stderr, flush=True)
    ensure_ray(config, address)
    print("raylens: loading the model in the Serve replica…", file=sys.stderr, flush=True)
    url = deploy(config, settings)
    print(f"raylens: serving {config.backend.model_id} at {url}  (viewer: {url}/, OpenAI: {url}/v1, "
          f"attention API: {url}/api/v1). Ctrl-C stops.", file=sys.stderr, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
    return 0
