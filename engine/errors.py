"""Typed errors, one per failure kind, under :class:`RaylensError`.

Messages follow one shape — "`<name>` must be <constraint>, got <value>." plus the fix — and
carry ``parameter``/``value`` so the CLI and APIs can map them without parsing text. Validation
errors are also ``ValueError`` so existing ``except ValueError`` handlers keep working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "RaylensError",
    "ConfigError",
    "DeviceUnavailableError",
    "LayerOutOfRangeError",
    "ModelLoadError",
    "UnsupportedModelError",
    "InvalidRequestError",
    "TokenOutOfVocabularyError",
    "ContextOverflowError",
    "GrammarError",
    "QuarantinedRequestError",
    "IngestError",
    "ClusterCapacityError",
    "ActorStartError",
    "ClusterUnreachableError",
    "ActorConfigConflictError",
    "ServerAlreadyRunningError",
    "QueueFullError",
    "RequestTimeoutError",
    "JobCancelledError",
    "EngineClosedError",
    "ReplicaDrainingError",
    "ReplicaLostError",
    "NoReplicaError",
    "LogitsNotKeptError",
    "check_request_token_ids",
]


class RaylensError(Exception):
    """Base of every error raylens raises on purpose. ``recoverable``: retrying may succeed."""

    recoverable = False

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class ConfigError(RaylensError, ValueError):
    """A config file, key, value or environment variable is wrong. Fix the config; not recoverable."""


class DeviceUnavailableError(ConfigError):
    """The configured device does not exist on this machine."""


class LayerOutOfRangeError(ConfigError):
    """A layer index is outside the model's layers."""


class ModelLoadError(RaylensError):
    """The model or tokenizer could not be found, converted or loaded."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture is not one of the supported families (engine/model/families.py).
    Unrecoverable for that model: pick a model of a listed family."""


class InvalidRequestError(RaylensError, ValueError):
    """A generation request is malformed (empty prompt, bad parameter). Fix the request."""


class TokenOutOfVocabularyError(InvalidRequestError):
    """A token id is outside ``[0, vocab_size)``."""


class ContextOverflowError(InvalidRequestError):
    """The prompt does not fit the model's context window."""


class GrammarError(InvalidRequestError):
    """A structured request's grammar (``response_format``, an enforced ``tool_choice``; its field
    is ``parameter``) is over a ``structured.*`` limit, cannot be compiled, crashed its compile
    (which runs in a child process, so only that request fails), or failed at a step. Fix or
    simplify the grammar; retrying the same one fails the same way."""


class QuarantinedRequestError(InvalidRequestError):
    """The request is identical to one that was running alone on a generator when that generator's
    process died: it is refused for a while instead of being run (and crashing it) again. Change
    the request; not recoverable by retrying it as it is."""


def check_request_token_ids(ids: Any, vocab: int, parameter: str) -> list[int]:
    """``ids`` as ints in ``[0, vocab)`` by the one rule mods' token ids follow too; a request's
    bad id is the caller's typed error naming its position: an id out of range a
    :class:`TokenOutOfVocabularyError`, anything that is not an int id (a float, a string, a bool)
    an :class:`InvalidRequestError`."""
    from mods.validation import InvalidActionValue, check_token_ids

    try:
        return check_token_ids(ids, vocab, field=parameter)
    except InvalidActionValue as err:
        out_of_range = isinstance(err.value, int) and not isinstance(err.value, bool)
        kind = TokenOutOfVocabularyError if out_of_range else InvalidRequestError
        raise kind(str(err), parameter=err.parameter, value=err.value) from None


class IngestError(RaylensError):
    """The ingest backend refused or could not take a payload (the payload is spooled, not lost)."""

    recoverable = True


class ClusterCapacityError(RaylensError):
    """The Ray cluster cannot place raylens' actors: too few CPUs/GPUs, no node offering a custom
    resource they ask for, or actors still unplaced when the start timeout ends. Lower the
    ``ray.*`` requests in the config or add a node; waiting on it would hang forever."""


class ActorStartError(RaylensError):
    """A raylens actor raised while being constructed (e.g. the generator could not load its
    model); the message carries the actor's own error."""


class ClusterUnreachableError(RaylensError):
    """No Ray cluster or dashboard answers at the configured address within the connect timeout.
    Start Ray or pass the right address; recoverable once it runs."""

    recoverable = True


class ActorConfigConflictError(RaylensError):
    """Running raylens actors hold something this job's config needs with other settings (a
    StoreActor owns the DuckDB file). Use their settings or stop them first (``raylens stop``)."""


class ServerAlreadyRunningError(RaylensError):
    """A ``raylens serve`` already runs on this Ray cluster; a second would replace its app and
    cut off its clients. Stop the first, or serve from another cluster."""


class QueueFullError(RaylensError):
    """Every batch slot is taken and the wait queue is full. Recoverable: retry later, or submit
    with ``block=True`` to wait for room (back-pressure instead of a silent drop)."""

    recoverable = True


class RequestTimeoutError(RaylensError, TimeoutError):
    """A request or job did not finish within its time-out and was stopped. Recoverable: ask for
    less (fewer tokens, fewer or shorter texts) or allow more time."""

    recoverable = True


class JobCancelledError(RaylensError):
    """A job (embeddings, scoring, a capture) was cancelled by its caller before it finished (its
    client left). Nothing to fix; run it again if it is still wanted."""

    recoverable = True


class EngineClosedError(RaylensError):
    """The engine was closed (or its step loop stopped) before the request finished. Unrecoverable
    for this engine: create a new one."""


class ReplicaDrainingError(RaylensError):
    """A generator replica that is being removed (``raylens scale``) takes no new request; the
    request never started there. Recoverable: the router sends it to another replica."""

    recoverable = True


class ReplicaLostError(RaylensError):
    """The generator replica running a request died after the request had sent tokens, so it
    cannot be re-run unseen; the stream ends with this error. Recoverable: retry the request
    (the replica restarts, and the others keep serving)."""

    recoverable = True


class NoReplicaError(RaylensError):
    """No generator replica is up to take a request (all died and are restarting, or draining).
    Recoverable: retry in a few seconds."""

    recoverable = True


class LogitsNotKeptError(RaylensError, LookupError):
    """A finished step's logits were read from a result whose request did not keep them
    (``keep_logits`` off): read them during the step (a mod, an ``on_event`` listener), or run
    the request with ``keep_logits=True``."""
