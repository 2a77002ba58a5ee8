"""Coded API errors: one code per failure kind, mapped from the engine's typed errors.

Both APIs report the same codes; they differ only in the envelope. The attention API answers
``{"error": message, "error_code": CODE, ...}`` (and the same object with ``"type": "error"`` on the
WebSocket); the OpenAI API answers ``{"error": {"message", "type", "param", "code"}}``.
The mapping reads the error's type and its ``parameter``/``value`` fields, never its message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["ErrorCode", "ApiError", "api_error_from", "result_error", "validation_error", "is_lost_actor"]


class ErrorCode(str, Enum):
    """Error codes with their HTTP status. ``INVALID_TOKEN``, ``OOM`` and ``NO_MODEL`` are the
    codes attention clients already know; the rest name the other limits the server enforces."""

    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_TOKEN = "INVALID_TOKEN"
    CONTEXT_TOO_LONG = "CONTEXT_TOO_LONG"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    TOO_MANY_CONNECTIONS = "TOO_MANY_CONNECTIONS"
    QUEUE_FULL = "QUEUE_FULL"
    UNAVAILABLE = "UNAVAILABLE"
    TIMEOUT = "TIMEOUT"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    NOT_FOUND = "NOT_FOUND"
    MOD_ERROR = "MOD_ERROR"
    QUARANTINED = "QUARANTINED"
    FEATURES_UNAVAILABLE = "FEATURES_UNAVAILABLE"
    NO_STORE = "NO_STORE"
    OOM = "OOM"
    NO_MODEL = "NO_MODEL"
    INTERNAL = "INTERNAL"

    @property
    def status(self) -> int:
        return _STATUS[self]

    def __str__(self) -> str:
        return self.value


_STATUS = {
    ErrorCode.INVALID_REQUEST: 400, ErrorCode.INVALID_TOKEN: 400, ErrorCode.CONTEXT_TOO_LONG: 400,
    ErrorCode.MESSAGE_TOO_LARGE: 413, ErrorCode.TOO_MANY_CONNECTIONS: 429, ErrorCode.QUEUE_FULL: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.TIMEOUT: 504, ErrorCode.UNAUTHORIZED: 401, ErrorCode.FORBIDDEN: 403, ErrorCode.NOT_FOUND: 404,
    ErrorCode.MOD_ERROR: 400, ErrorCode.QUARANTINED: 400, ErrorCode.FEATURES_UNAVAILABLE: 501,
    ErrorCode.NO_STORE: 404, ErrorCode.OOM: 503, ErrorCode.NO_MODEL: 503,
    ErrorCode.INTERNAL: 500,
}


@dataclass
class ApiError(Exception):
    """An error a client caused or can act on; ``extra`` adds fields to the error object."""

    code: ErrorCode
    message: str
    parameter: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def status(self) -> int:
        return self.code.status

    @property
    def headers(self) -> dict[str, str]:
        """``Retry-After`` on a 503: the client may try again (a full queue, a lost generator)."""
        return {"Retry-After": str(self.extra.get("retry_after_s", RETRY_AFTER_S))} if self.status == 503 else {}

    def attention_body(self, request_id: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"type": "error"}
        if request_id is not None:
            body["request_id"] = request_id
        body.update({"error": self.message, "error_code": self.code.value, **self.extra})
        if self.parameter:
            body["parameter"] = self.parameter
        return body

    def openai_body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(self.status,
                                                                                                   "server_error")
        if self.code is ErrorCode.MOD_ERROR:
            kind = "mod_error"
        return {"error": {"message": self.message, "type": kind, "param": self.parameter,
                          "code": self.code.value.lower()}}


def api_error_from(err: BaseException) -> ApiError:
    """The coded error for an exception raised while handling a request (unknown ones: INTERNAL)."""
    from engine import errors as engine_errors
    from mods.loading import ModPayloadError

    if isinstance(err, ApiError):
        return err
    parameter = getattr(err, "parameter", None)
    if isinstance(err, engine_errors.TokenOutOfVocabularyError):
        return ApiError(ErrorCode.INVALID_TOKEN, str(err), parameter)
    if isinstance(err, engine_errors.ContextOverflowError):
        return ApiError(ErrorCode.CONTEXT_TOO_LONG, str(err), parameter)
    if isinstance(err, engine_errors.QuarantinedRequestError):
        return ApiError(ErrorCode.QUARANTINED, str(err), parameter)
    if is_lost_actor(err):
        return ApiError(ErrorCode.UNAVAILABLE, "the generator actor serving this request was lost (it died or its "
                                               "node left); the server resolves it again: retry in a few seconds.",
                        None, {"retry_after_s": RETRY_AFTER_S})
    if isinstance(err, (engine_errors.ReplicaLostError, engine_errors.NoReplicaError,
                        engine_errors.ReplicaDrainingError)):  # replicas: retry once one is up
        return ApiError(ErrorCode.UNAVAILABLE, str(err), None, {"retry_after_s": RETRY_AFTER_S})
    queue_full = getattr(engine_errors, "QueueFullError", None)
    if queue_full is not None and isinstance(err, queue_full):
        return ApiError(ErrorCode.QUEUE_FULL, f"{err} Retry after a moment.", parameter)
    if isinstance(err, (engine_errors.InvalidRequestError, engine_errors.ConfigError)):
        return ApiError(ErrorCode.INVALID_REQUEST, str(err), parameter)
    if isinstance(err, ModPayloadError):
        return ApiError(ErrorCode.INVALID_REQUEST, str(err), "mods")
    if _is_out_of_memory(err):
        return ApiError(ErrorCode.OOM, str(err).splitlines()[0] if str(err) else "out of memory", None,
                        _memory_fields())
    return ApiError(ErrorCode.INTERNAL, f"internal error: {type(err).__name__}: {err}")


def result_error(result: Any) -> ApiError:
    """The coded error of a result that ended with finish reason ``error``: its request's own field
    when one was at fault (a grammar that failed at a step: ``INVALID_REQUEST`` naming it), else
    what a mod or the engine reported (``MOD_ERROR``)."""
    parameter = getattr(result, "error_parameter", None)
    if parameter:
        return ApiError(ErrorCode.INVALID_REQUEST, str(result.error), parameter)
    return ApiError(ErrorCode.MOD_ERROR, f"a mod ended the request with an error: {result.error}")


#: what a 503 tells the client to wait (``Retry-After``): a restarted generator reloads its model
RETRY_AFTER_S = 5


def is_lost_actor(err: BaseException) -> bool:
    """A Ray actor died or became unreachable: retryable once it is resolved again."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError
    except ImportError:  # an in-process server without Ray installed has no actors to lose
        return False
    return isinstance(err, (RayActorError, ActorUnavailableError))


def _is_out_of_memory(err: BaseException) -> bool:
    import torch

    return isinstance(err, (torch.OutOfMemoryError, MemoryError))


def _memory_fields() -> dict[str, Any]:
    """Device memory in use and in total (the fields OOM reports carry), when on CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"vram_used_mb": (total - free) // 2**20, "vram_total_mb": total // 2**20}


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The first schema violation (pydantic's error list) as a coded error: which field, what it
    must be, what it got."""
    import json

    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its location is a character offset, not a field
        position = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
        reason = str((first.get("ctx") or {}).get("error") or first.get("msg") or "a parse error")
        return ApiError(ErrorCode.INVALID_REQUEST, f"the request body must be valid JSON, got {reason}"
                                                   + (f" at character {position}" if position is not None else "")
                                                   + ".", "body")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    shown = "nothing" if first.get("type") == "missing" else json.dumps(first.get("input"), default=str)[:80]
    reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(ErrorCode.INVALID_REQUEST, f"`{where}` must be valid ({reason[:1].lower()}{reason[1:]}), got "
                                               f"{shown}. See the OpenAPI document at /docs.", where)
