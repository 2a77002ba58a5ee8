"""ModManager: calls every registered mod for an event and records what each call did.

Legacy code imports this module as ``quote.mods.manager``. Contract (compat §3.1):

* every mod is called, in registration order, for every event — no short-circuit here; the
  generation loop decides which returned actions it processes;
* a mod's prints and log records are captured per call (see :mod:`mods.capture`);
* a mod exception, or a result the event does not allow, is recorded and becomes ``Noop`` —
  the one place an error is swallowed, and never without a record;
* ``dispatch`` returns one action per mod, each tagged with ``_source`` (the mod's name) and,
  when it printed, ``_mod_logs``.

``dispatch_traced`` returns the full :class:`ModCall` records (timing, logs, exception) that
the ingest payload is built from. Unlike the original, nothing is written to ``/tmp`` (⚠F18).
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from .capture import CapturedLog, capture_mod_output
from .conversation import pop_request_context, push_request_context
from .types import ModAction, ModEvent, Noop
from .validation import InvalidActionError, validate_action

__all__ = ["ModManager", "ModCall", "ModException", "mod_name"]

log = logging.getLogger("raylens.mods")


@dataclass(frozen=True)
class ModException:
    type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class ModCall:
    """What one mod did for one event."""

    mod_name: str
    event_type: str
    step: int
    action: ModAction
    logs: tuple[CapturedLog, ...]
    started_at: float  # epoch seconds
    elapsed_ms: float
    exception: ModException | None = None
    rejected: ModAction | None = None  # what a raw mod returned that the event does not allow

    @property
    def noteworthy(self) -> bool:
        """Worth a ``mod_calls`` row in the payload: it acted, printed, or failed."""
        return not isinstance(self.action, Noop) or bool(self.logs) or self.exception is not None


def mod_name(mod: Callable[..., Any]) -> str:
    return getattr(mod, "__name__", None) or type(mod).__name__


class ModManager:
    def __init__(self, mods: Iterable[Callable[..., Any]] | None = None, *, tokenizer: Any = None) -> None:
        self.mods: list[Callable[..., Any]] = list(mods or [])
        self.forced_queues: dict[str, list[int]] = {}
        self.forced_reason_queues: dict[str, list[str]] = {}
        self._tokenizer = tokenizer

    def register(self, mod: Callable[..., Any]) -> None:
        self.mods.append(mod)

    def set_tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def dispatch(self, event: ModEvent) -> list[ModAction]:
        return [call.action for call in self.dispatch_traced(event)]

    def dispatch_traced(self, event: ModEvent, mods: Sequence[Callable[..., Any]] | None = None) -> list[ModCall]:
        return [self._call(m, event) for m in (self.mods if mods is None else mods)]

    def _call(self, mod: Callable[..., Any], event: ModEvent) -> ModCall:
        name = mod_name(mod)
        event_type = type(event).__name__
        exception: ModException | None = None
        rejected: ModAction | None = None
        started_at = time.time()
        t0 = time.perf_counter()
        request_id = getattr(event, "request_id", None)
        with capture_mod_output() as buffer:
            context = push_request_context(request_id if isinstance(request_id, str) else None)
            try:
                result = mod(event, self._tokenizer)
                try:
                    action = validate_action(event, result)
                except InvalidActionError:
                    rejected = result if isinstance(result, ModAction) else None
                    raise
            except Exception as err:
                exception = ModException(type(err).__name__, str(err), traceback.format_exc())
                print(f"[mods] Mod raised exception on {event_type}: {err}")
                action = Noop()
            finally:
                pop_request_context(context)
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        logs = buffer.logs()
        if exception is not None:
            log.warning("mod %s raised %s on %s step %s: %s", name, exception.type, event_type,
                        getattr(event, "step", 0), exception.message)
        try:
            action._source = name
            if logs:
                action._mod_logs = "".join(entry.message for entry in logs)
        except AttributeError:  # an action object that refuses attributes: the record still has it
            pass
        return ModCall(name, event_type, getattr(event, "step", 0), action, logs, started_at, elapsed_ms, exception,
                       rejected)
