"""The FastAPI app: both APIs, the viewer page, the feature browser, and the guards every route shares.

``build_app(engine, settings)`` works over any engine object with ``Engine``'s serving surface: an
in-process :class:`engine.Engine` (tests, :mod:`pipelines.serve.local`) or, in the Ray Serve
replica, a :class:`~pipelines.serve.remote_engine.RemoteEngine` over the shared GeneratorActor.
The feature browser (``/features``, :mod:`.features_api`) reads the engine's own activation store
(``engine.store``) unless a ``store`` is given. ``build_browser_app(store)`` is the browser alone:
no engine, no model, only the store's routes and the static pages.
Guards, outermost first:

* API key — when set, every route except ``/healthz`` and ``/health`` needs ``Authorization: Bearer <key>`` or
  ``X-API-Key: <key>``; browsers (the viewer page, WebSockets) may pass ``?api_key=<key>``.
* WebSocket origin — a browser page from another site may not open the stream (it would use the
  model through the user's loopback server): an ``Origin`` whose host differs from ``Host`` is refused.
* Body size — a request body over ``max_message_bytes`` is refused with 413 before it is read.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from . import attention_api, features_api, openai_api
from .errors import ApiError, ErrorCode, api_error_from, validation_error
from .metrics import CONTENT_TYPE_LATEST, metrics_registry, render
from .service import Service
from .settings import ServeSettings, raylens_version

__all__ = ["build_app", "build_browser_app", "Guards"]

STATIC = Path(__file__).with_name("static")
_OPEN_PATHS = frozenset({"/healthz", "/health"})


def build_app(engine: Any, settings: ServeSettings | None = None, *, store: Any = None,
              neuronpedia_url: str | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    if neuronpedia_url is None:  # the engine's config names it (sae.neuronpedia_url), when it has one
        neuronpedia_url = getattr(getattr(getattr(engine, "config", None), "sae", None), "neuronpedia_url", None)
    source = features_api.FeatureSource(store if store is not None else getattr(engine, "store", None),
                                        engine.tokenizer, neuronpedia_url, features_api.neuronpedia_ids_from_registry())
    app = _base_app(settings, source, "OpenAI-compatible chat with mods, and per-token attention streaming.")
    app.state.service = Service(engine, settings)
    for router in openai_api.routers:
        app.include_router(router)
    app.include_router(attention_api.router)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        return {"ok": True, "model": app.state.service.model_id}

    @app.get("/health", tags=["health"])
    def health() -> dict[str, Any]:
        """What OpenAI-compatible servers answer and clients (guidellm) check before starting."""
        return {"ok": True, "model": app.state.service.model_id}

    registry = metrics_registry(engine, app.state.service.model_id)

    @app.get("/metrics", tags=["health"])
    def metrics() -> Response:
        """Prometheus metrics of every generator replica and in total (vLLM's names; see
        :mod:`pipelines.serve.metrics`)."""
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", tags=["health"])
    def version() -> dict[str, Any]:
        return {"version": raylens_version()}

    @app.get("/", include_in_schema=False)
    def viewer() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    return app


def build_browser_app(store: Any, settings: ServeSettings | None = None, *, tokenizer: Any = None,
                      neuronpedia_url: str | None = None) -> FastAPI:
    """The feature browser over ``store`` (an :class:`~engine.services.store.ActivationStore`, best
    opened ``read_only``) without an engine: ``/`` is the browser page; ``tokenizer`` (optional)
    gives token text, else pages show ids."""
    settings = settings or ServeSettings()
    source = features_api.FeatureSource(store, tokenizer, neuronpedia_url, features_api.neuronpedia_ids_from_registry())
    app = _base_app(settings, source, "Browse the SAE features in an activation store.")

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        return {"ok": True, "model": None, "store": str(getattr(store, "db_path", "")) or None}

    @app.get("/", include_in_schema=False)
    def browser_home() -> FileResponse:
        return FileResponse(STATIC / "features.html")

    return app


def _base_app(settings: ServeSettings, source: "features_api.FeatureSource", description: str) -> FastAPI:
    """The parts every app has: the feature routes and page, static files, error handlers, guards."""
    app = FastAPI(title="raylens", version="0.1.0", description=description)
    app.state.features = source
    app.include_router(features_api.router)

    @app.get("/features", include_in_schema=False)
    def feature_browser() -> FileResponse:
        return FileResponse(STATIC / "features.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, err: ApiError) -> JSONResponse:
        return _error_response(request.url.path, err)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return _error_response(request.url.path, validation_error(err.errors()))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException) -> Any:
        # FastAPI answers a body it cannot read with a bare 400 ("There was an error parsing the
        # body"): a body over the size limit (the guard's coded error is its cause), bytes that are
        # not UTF-8, JSON nested past the parser's depth. Each becomes a coded error.
        cause = err.__cause__ or err.__context__
        while cause is not None and not isinstance(cause, ApiError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, ApiError):
            return _error_response(request.url.path, cause)
        if err.status_code == 400:
            return _error_response(request.url.path, ApiError(
                ErrorCode.INVALID_REQUEST, "the request body must be a JSON document in UTF-8 (nested at most a "
                                           "few hundred levels), got one that cannot be parsed.", "body"))
        return await http_exception_handler(request, err)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, err: Exception) -> JSONResponse:
        return _error_response(request.url.path, api_error_from(err))

    app.add_middleware(Guards, settings=settings)
    return app


def _error_response(path: str, err: ApiError) -> JSONResponse:
    body = err.openai_body() if path.startswith("/v1/") else err.attention_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


class Guards:
    """ASGI middleware with the API-key, origin and body-size checks (HTTP and WebSocket alike)."""

    def __init__(self, app: Any, settings: ServeSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope["path"] not in _OPEN_PATHS and self.settings.api_key and not self._authorized(scope, headers):
            return await self._refuse(scope, receive, send, ApiError(
                ErrorCode.UNAUTHORIZED, "an API key must be sent, got none or a wrong one: use `Authorization: "
                                        "Bearer <key>`, `X-API-Key: <key>` or `?api_key=<key>`."))
        if scope["type"] == "websocket" and not _same_origin(headers):
            return await self._refuse(scope, receive, send, ApiError(
                ErrorCode.FORBIDDEN, f"the page's Origin must be this server, got {headers.get('origin')!r}."))
        if scope["type"] == "http":
            length = headers.get("content-length")
            limit = self.settings.max_message_bytes
            if length is not None and (not length.isdigit() or int(length) > limit):
                return await self._refuse(scope, receive, send, ApiError(
                    ErrorCode.MESSAGE_TOO_LARGE, f"a request body must be at most {limit} bytes, got {length}."))
            receive = _limited(receive, limit)
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict[str, Any], headers: dict[str, str]) -> bool:
        key = self.settings.api_key or ""
        offered = headers.get("x-api-key")
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            offered = auth[7:].strip()
        if offered is None:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            offered = (query.get("api_key") or [None])[0]
        return offered is not None and hmac.compare_digest(offered.encode(), key.encode())

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any, err: ApiError) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": err.message[:120]})
            return
        await _error_response(scope["path"], err)(scope, receive, send)


def _same_origin(headers: dict[str, str]) -> bool:
    origin = headers.get("origin")
    if origin is None:  # not a browser: scripts and servers send no Origin
        return True
    return urlsplit(origin).netloc.lower() == headers.get("host", "").lower()


def _limited(receive: Any, limit: int) -> Any:
    """``receive`` that fails a body growing past ``limit`` (chunked bodies carry no length)."""
    seen = 0

    async def wrapped() -> dict[str, Any]:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise ApiError(ErrorCode.MESSAGE_TOO_LARGE, f"a request body must be at most {limit} bytes, got more.")
        return message

    return wrapped
