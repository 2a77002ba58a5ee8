"""The per-request ingest payload sent to the backend (``engine/schemas/ingest-payload.schema.json``).

:class:`PayloadBuilder` is the generation loop's ``PayloadSink``. It keeps small raw facts while
the loop runs — the top-20 log-probabilities stay on the model's device as tensors, token texts
are not decoded yet — and :meth:`PayloadBuilder.build` turns them into JSON at the end, decoding
every token text in one batched tokenizer call.

Shape rules the backend enforces: ``events[i].sequence_order == i``; ``mod_calls[*].
event_sequence_order`` and ``mod_logs/actions[*].mod_call_sequence`` are array positions;
integers fit in 32 bits; ``token_text`` ≤ 100 characters; ``logits_shape`` is a string.

Hidden states, attention patterns, layer and input ids never enter the payload.

Mod output is bounded (``ingest.mod_log_max_chars_per_call`` and ``…_per_request``): the backend
refuses bodies over 75 MiB with 413, and a mod printing every step can exceed that. Past a limit
the text is cut and a WARNING entry in ``mod_logs`` says how much was cut and which limit did it;
``inference_stats.mod_logs_cut`` holds the totals. Exception tracebacks count against the same
budgets.

Non-finite floats (a log-probability of ``-inf`` after a mod masked a token, a NaN temperature in
an AdjustedLogits) become ``null``: JSON has no NaN, and the backend refuses a body that has one.

Which mod calls are recorded: every call that returned a non-Noop action, printed or logged, or
raised — the silent Noops (most calls) would only bloat the payload. Every non-Noop action is
recorded, with ``details.applied`` and, when it was not applied, ``details.note`` saying why.
"""

from __future__ import annotations

import functools
import json
import math
import time
import weakref
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Sequence

import torch

from engine.config import IngestConfig
from engine.model.tensor import logits_dims
from engine.services.strict_json import dumps, finite
from mods.capture import CapturedLog
from mods.manager import ModCall, ModException
from mods.types import (
    Added,
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ForwardPass,
    ModAction,
    ModEvent,
    Prefilled,
    Sampled,
    ToolCalls,
)

__all__ = ["PayloadBuilder", "iso_time", "MOD_LOG_ENTRY_OVERHEAD"]

# what a PayloadBuilder's log entry is (its first item)
_EVENT, _ADJUSTED, _ACTION, _STEER = (object() for _ in range(4))

TOP_TOKENS = 20
_INPUT_TEXT_CHARS = 70
_TOKEN_TEXT_CHARS = 100
_DECODABLE = 2**32  # tokenizers hold ids as unsigned 32-bit integers; others cannot be decoded
#: Characters a mod-log entry costs besides its message (its record's other fields), so a mod
#: writing many tiny entries is bounded by the same limits as one writing long ones.
MOD_LOG_ENTRY_OVERHEAD = 128


def iso_time(epoch: float) -> str:
    """``datetime.fromtimestamp(epoch, utc).isoformat()`` with ``Z`` for the offset, to the same
    microsecond (rounded half to even, as ``datetime`` does). A payload holds one per event, so the
    date part is formatted once per second, not per record."""
    second = math.floor(epoch)
    micro = round((epoch - second) * 1e6)
    if micro >= 1_000_000:
        second, micro = second + 1, micro - 1_000_000
    base = _iso_second(second)
    return f"{base}.{micro:06d}Z" if micro else f"{base}Z"


@functools.lru_cache(maxsize=1024)
def _iso_second(second: int) -> str:
    return datetime.fromtimestamp(second, timezone.utc).isoformat().removesuffix("+00:00")


@dataclass
class _PendingTexts:
    """Token-id lists whose decoded text is filled in at build time."""

    items: list[tuple[dict[str, Any], str, list[int], Any]] = field(default_factory=list)

    def add(self, target: dict[str, Any], key: str, ids: Sequence[int], shape: Any = None) -> None:
        """``shape``: None → one string; "each" → one string per id; int n → last n characters."""
        self.items.append((target, key, [int(i) for i in ids], shape))

    def resolve(self, tokenizer: Any) -> None:
        batches: list[list[int]] = []
        for _, _, ids, shape in self.items:
            # a payload also records what a mod handed back and the engine refused, such as a
            # negative forced id: only ids a tokenizer can hold are decoded; the rest read as ""
            ids = [i for i in ids if 0 <= i < _DECODABLE]
            batches.extend([[i] for i in ids] if shape == "each" else [ids])
        texts = iter(_decode_all(tokenizer, batches))
        for target, key, ids, shape in self.items:
            if shape == "each":
                target[key] = [next(texts) if 0 <= i < _DECODABLE else "" for i in ids]
            else:
                text = next(texts)
                target[key] = text[-shape:] if isinstance(shape, int) else text


_SINGLE_TOKEN_TEXTS: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = weakref.WeakKeyDictionary()
_SINGLE_TOKEN_CACHE_MAX = 1 << 18


def _decode_all(tokenizer: Any, batches: list[list[int]]) -> list[str]:
    """``batch_decode(batches)``, decoding each distinct id list once. A payload names the same few
    thousand tokens over and over (every step's top 20); single ids are remembered per tokenizer
    across requests, because decoding is what a finished batch of requests spends its time on."""
    try:
        single = _SINGLE_TOKEN_TEXTS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cross-request memory
        single = {}
    distinct: dict[tuple[int, ...], str | None] = {}
    for ids in batches:
        key = tuple(ids)
        if key not in distinct:
            distinct[key] = single.get(ids[0]) if len(ids) == 1 else None
    todo = [key for key, text in distinct.items() if text is None]
    if todo:
        for key, text in zip(todo, tokenizer.batch_decode([list(k) for k in todo])):
            distinct[key] = text
            if len(key) == 1 and len(single) < _SINGLE_TOKEN_CACHE_MAX:
                single[key[0]] = text
    return [distinct[tuple(ids)] for ids in batches]  # type: ignore[misc]


class _LogBudget:
    """What is left of the per-request and per-call mod-log limits, and what was cut."""

    def __init__(self, limits: IngestConfig) -> None:
        self.per_call = limits.mod_log_max_chars_per_call
        self.per_request = limits.mod_log_max_chars_per_request
        self.request_left = self.per_request
        self.cut_chars = 0
        self.cut_entries = 0
        self.request_cut_at: tuple[int, str] | None = None  # (call index, mod name) of the first cut by it

    def take(self, text: str, call_left: int) -> tuple[str | None, int, bool]:
        """→ (the text to keep or None, its cost, cut by the request limit rather than the call's)."""
        cost = len(text) + MOD_LOG_ENTRY_OVERHEAD
        allowed = min(call_left, self.request_left)
        if cost <= allowed:
            self.request_left -= cost
            return text, cost, False
        keep = allowed - MOD_LOG_ENTRY_OVERHEAD - 1  # room for the "…"
        self.cut_chars += len(text) - max(keep, 0)
        by_request = self.request_left < call_left
        if keep <= 0:
            self.cut_entries += 1
            return None, 0, by_request
        self.request_left -= allowed
        return text[:keep] + "…", allowed, by_request


def _cut_marker(chars: int, entries: int, scope: str, key: str, limit: int) -> str:
    dropped = f" and {entries} entr{'y' if entries == 1 else 'ies'} dropped" if entries else ""
    return (f"[raylens: {chars:,} characters of mod output cut{dropped} in this {scope}: it is over "
            f"`ingest.{key}` = {limit:,}]")


@dataclass(slots=True)
class _CallFacts:
    """What a mod call's ``mod_calls`` and ``mod_logs`` records say (a :class:`ModCall` less its
    action), and the index of the event it was called for: the call's entry in the log itself."""

    event_index: int
    mod_name: str
    event_type: str
    step: int
    started_at: float
    elapsed_ms: float
    exception: ModException | None
    logs: tuple[CapturedLog, ...]


class PayloadBuilder:
    """Builds one request's payload. ``limits``: the ``ingest`` config whose mod-log limits apply
    (default: :class:`IngestConfig`'s defaults)."""

    def __init__(self, request_id: str, *, tokenizer: Any, request: dict[str, Any],
                 limits: IngestConfig | None = None) -> None:
        self.request_id = request_id
        self._tokenizer = tokenizer
        self._created = datetime.now(timezone.utc).timestamp()
        self._request = {"request_id": request_id, **request}
        self._events: list[dict[str, Any]] = []
        # per ForwardPass record: the step's batch top log-probs (B, k) and ids (B, k), and the row
        self._top: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor, int]] = []
        self._mod_calls: list[dict[str, Any]] = []
        self._mod_logs: list[dict[str, Any]] = []
        self._actions: list[dict[str, Any]] = []
        self._texts = _PendingTexts()
        self._later: list[tuple[ModEvent, Any, float]] = []  # event_later's, recorded at build
        # what the loop recorded, in order, as small facts made into JSON records at build: a
        # request's payload is built once, at its end, and only when something reads or sends it
        # (a call's entry is its _CallFacts; every other entry a tuple tagged by its first item)
        self._log: list[tuple[Any, ...] | _CallFacts] = []
        self._event_count = 0
        self._call_count = 0
        self._fed_upto: int | None = None
        self._budget = _LogBudget(limits or IngestConfig())

    # ------------------------------------------------------------------------ during the loop

    def event(self, event: ModEvent, top: tuple[torch.Tensor, torch.Tensor, int] | None = None,
              at: float | None = None) -> int:
        """Record ``event``; for a ForwardPass, ``top`` is ``(values (B, k), ids (B, k), row)``: the
        top log-probs and ids the backend computed for the whole batch, and this request's row
        (the record's ``top_tokens``; none without). ``at``: when it happened (epoch seconds;
        default now), for an event recorded after the fact. What the record needs is read now (a
        mod may change the event later); the record is made at build."""
        index = self._event_count
        self._event_count += 1
        # time.time() is what datetime.now(utc).timestamp() reads, at a tenth of the cost
        at = time.time() if at is None else at
        # one flat tuple a record, its facts after (_EVENT, class, step, time): each tuple a request
        # keeps until it ends is one more object for the garbage collector's passes to walk
        kind, step = type(event), int(event.step)
        if isinstance(event, ForwardPass):
            ids = event.input_ids or []  # the event's own list: read, never kept or changed
            fed = ids[:] if self._fed_upto is None else (ids[self._fed_upto:] or ids[-1:])
            self._fed_upto = len(ids)
            self._log.append((_EVENT, kind, step, at, fed, top))
        elif isinstance(event, Sampled):
            self._log.append((_EVENT, kind, step, at, int(event.sampled_token)))
        elif isinstance(event, Added):
            self._log.append((_EVENT, kind, step, at, [int(t) for t in event.added_tokens], bool(event.forced)))
        elif isinstance(event, Prefilled):
            self._fed_upto = None
            self._log.append((_EVENT, kind, step, at,
                              len(event.input_ids or getattr(event.context_info, "tokens", []) or []),
                              int(event.max_steps)))
        else:
            self._log.append((_EVENT, kind, step, at))
        return index

    def sampled(self, step: int, token: int) -> int:
        """Record a Sampled event from its facts, as :meth:`event` would record the event (for a
        step whose Sampled no one hears as it happens: the event itself is made later)."""
        index = self._event_count
        self._event_count += 1
        self._log.append((_EVENT, Sampled, step, time.time(), int(token)))
        return index

    def added(self, step: int, tokens: Sequence[int], forced: bool) -> int:
        """Record an Added event from its facts, as :meth:`event` would (see :meth:`sampled`)."""
        index = self._event_count
        self._event_count += 1
        self._log.append((_EVENT, Added, step, time.time(), [int(t) for t in tokens], bool(forced)))
        return index

    def event_later(self, events: Sequence[tuple[ModEvent, Any, float]]) -> None:
        """``(event, top, at)`` each, recorded as :meth:`event` would, in order, when the payload
        is built: for events made after the request ended (a request nobody watched step by step),
        which come after every event recorded before them."""
        self._later.extend(events)

    def _event_record(self, kind: type, step: int, at: float, *facts: Any) -> None:
        record: dict[str, Any] = {
            "event_type": kind.__name__,
            "step": step,
            "sequence_order": len(self._events),
            "created_at": at,
        }
        if issubclass(kind, Prefilled):
            record["prompt_length"], record["max_steps"] = facts
        elif issubclass(kind, ForwardPass):
            fed, top = facts
            self._texts.add(record, "input_text", fed, _INPUT_TEXT_CHARS)
            if top is not None:  # stays on device until build: no per-step sync
                self._top.append((record, top[0], top[1], top[2]))  # cut to TOP_TOKENS once, at build
        elif issubclass(kind, Sampled):
            (token,) = facts
            record["sampled_token"] = token
            self._texts.add(record, "token_text", [token], _TOKEN_TEXT_CHARS)
        elif issubclass(kind, Added):
            tokens, forced = facts
            record["added_tokens"] = tokens
            record["added_token_count"] = len(tokens)
            record["forced"] = forced
        self._events.append(record)

    def call(self, event_index: int, call: ModCall) -> int | None:
        """Record ``call`` of event ``event_index`` if it is noteworthy (a call record is read,
        never changed); its position in ``mod_calls``, None when it is not recorded."""
        if not call.noteworthy:
            return None
        index = self._call_count
        self._call_count += 1
        # its facts, not the call: its action may hold a row of the step's host copy of the
        # logits, which would keep every step's whole copy alive until the request ends
        self._log.append(_CallFacts(event_index, call.mod_name, call.event_type, call.step, call.started_at,
                                    call.elapsed_ms, call.exception, call.logs))
        return index

    def _call_record(self, call: "_CallFacts") -> None:
        index = len(self._mod_calls)
        record: dict[str, Any] = {
            "event_sequence_order": call.event_index,
            "mod_name": call.mod_name[:255],
            "event_type": call.event_type,
            "step": int(call.step),
            "created_at": call.started_at,
            "execution_time_ms": round(call.elapsed_ms, 4),
            "exception_occurred": call.exception is not None,
        }
        call_left = self._budget.per_call
        if call.exception is not None:
            message, cost = self._bounded(f"{call.exception.type}: {call.exception.message}", index, call, call_left)
            record["exception_message"] = message
            call_left -= cost
            traceback, cost = self._bounded(call.exception.traceback, index, call, call_left)
            record["exception_traceback"] = traceback
            call_left -= cost
        self._mod_calls.append(record)
        self._record_logs(index, call, call_left)

    def _bounded(self, text: str | None, index: int, call: "_CallFacts", call_left: int) -> tuple[str | None, int]:
        """``text`` cut to what the budgets allow (a marker replaces all of it when nothing is left)."""
        if not text:
            return text, 0
        budget = self._budget
        kept, cost, by_request = budget.take(text, call_left)
        if by_request and budget.request_cut_at is None:
            budget.request_cut_at = (index, call.mod_name[:255])
        if kept is None:
            budget.cut_entries -= 1  # not a log entry: the field stays, with the marker
            return f"[raylens: {len(text):,} characters cut; see the mod_logs marker]", 0
        return kept, cost

    def _record_logs(self, index: int, call: "_CallFacts", call_left: int) -> None:
        budget = self._budget
        cut_chars, cut_entries = budget.cut_chars, budget.cut_entries
        cut_by_call = False
        for entry in call.logs:
            kept, cost, by_request = budget.take(entry.message, call_left)
            if kept != entry.message:
                if by_request:
                    if budget.request_cut_at is None:
                        budget.request_cut_at = (index, call.mod_name[:255])
                else:
                    cut_by_call = True
            if kept is None:
                continue
            call_left -= cost
            self._mod_logs.append({"mod_call_sequence": index, "mod_name": call.mod_name[:255],
                                   "log_message": kept, "log_level": entry.level, "created_at": entry.created_at})
        if cut_by_call and budget.request_cut_at is None:
            # one marker per call cut by its own limit; it is charged to the request's budget, so
            # the markers are bounded too (once that is spent, build() adds the only other marker)
            marker = _cut_marker(budget.cut_chars - cut_chars, budget.cut_entries - cut_entries, "mod call",
                                 "mod_log_max_chars_per_call", budget.per_call)
            cost = len(marker) + MOD_LOG_ENTRY_OVERHEAD
            if cost <= budget.request_left:
                budget.request_left -= cost
                self._mod_logs.append({"mod_call_sequence": index, "mod_name": call.mod_name[:255],
                                       "log_message": marker, "log_level": "WARNING",
                                       "created_at": datetime.now(timezone.utc).timestamp()})

    def action(self, call_index: int | None, action: ModAction, *, applied: bool, note: str | None = None,
               dims: tuple[int, ...] | None = None) -> None:
        """Record what became of the action of recorded call ``call_index``: its facts are read now
        (a mod may change the object later), the record is made at build. ``dims``: an
        ``AdjustedLogits``' logits' shape as ints, when the caller read it already."""
        if call_index is None:
            return
        at = time.time()  # what datetime.now(utc).timestamp() reads, at a tenth of the cost
        details: dict[str, Any] = {"applied": applied}
        if note:
            details["note"] = note
        if isinstance(action, AdjustedLogits):  # one per step of a logits mod: the record is made at build
            if dims is None:
                dims = logits_dims(action.logits)
            temp = None if action.token_temp is None else finite(float(action.token_temp))
            self._log.append((_ADJUSTED, call_index, details, at, dims, temp))
            return
        if type(action).__name__ == "Steer":  # the backend's action types are a closed set: a log line
            fid, scale = getattr(action, "feature_id", None), getattr(action, "scale", None)
            status = "applied" if applied else f"not applied: {note}"
            message = f"[raylens] Steer feature_id={fid} scale={scale} ({status})"[:2000]
            self._log.append((_STEER, call_index, message, at))
            return
        record = self._action_record(call_index, type(action).__name__, details, at)
        self._describe(record, details, action)
        self._log.append((_ACTION, record))

    def take_back_action(self, call_index: int | None) -> None:
        """Unrecord the newest record, which must be :meth:`action`'s of the ``AdjustedLogits`` of
        recorded call ``call_index``: one recorded as applied ahead of its check, which then failed
        (its record as not applied follows)."""
        if call_index is None:
            return
        last = self._log[-1] if self._log else None
        if type(last) is not tuple or last[0] is not _ADJUSTED or last[1] != call_index \
                or last[2].get("applied") is not True:
            raise AssertionError(f"the newest payload record is not call {call_index}'s AdjustedLogits as applied")
        self._log.pop()

    @staticmethod
    def _action_record(call_index: int, kind: str, details: dict[str, Any], at: float) -> dict[str, Any]:
        return {"mod_call_sequence": call_index, "action_type": kind, "action_order": 0, "created_at": at,
                "details": details}

    def _replay(self) -> None:
        """Make the JSON records of everything logged, in the order it happened."""
        log, self._log = self._log, []
        for entry in log:
            if isinstance(entry, _CallFacts):
                self._call_record(entry)
                continue
            what = entry[0]
            if what is _EVENT:
                self._event_record(*entry[1:])
            elif what is _ADJUSTED:
                _, call_index, details, at, dims, temp = entry
                record = self._action_record(call_index, "AdjustedLogits", details, at)
                record["logits_shape"] = str(list(dims)) if dims is not None else None  # "[1, 49152]"
                record["temperature"] = temp
                self._actions.append(record)
            elif what is _ACTION:
                self._actions.append(entry[1])
            else:  # _STEER
                _, call_index, message, at = entry
                self._mod_logs.append({"mod_call_sequence": call_index,
                                       "mod_name": str(self._mod_calls[call_index]["mod_name"])[:255],
                                       "log_message": message, "log_level": "INFO", "created_at": at})

    def _tokens(self, record: dict[str, Any], details: dict[str, Any], tokens: Sequence[int]) -> None:
        ids = [int(t) for t in tokens]
        record["tokens"] = ids
        record["token_count"] = len(ids)
        details["tokens"] = ids
        self._texts.add(details, "tokens_as_text", ids, "each")
        self._texts.add(record, "tokens_preview", ids[:10])

    def _describe(self, record: dict[str, Any], details: dict[str, Any], action: ModAction) -> None:
        if isinstance(action, (ForceTokens, ForceOutput)):
            self._tokens(record, details, action.tokens)
        elif isinstance(action, AdjustedPrefill):
            self._tokens(record, details, action.tokens)
            record["new_length"] = len(action.tokens)
            record["adjusted_max_steps"] = _i32(action.max_steps)
            self._texts.add(record, "new_prompt", action.tokens)
        elif isinstance(action, Backtrack):
            record["backtrack_steps"] = _i32(action.n)
            if action.tokens is not None:
                self._tokens(record, details, action.tokens)
        elif isinstance(action, ToolCalls):
            record["has_tool_calls"] = bool(action.tool_calls)
            record["tool_calls"] = _jsonable(action.tool_calls)
        elif isinstance(action, EmitError):
            record["error_message"] = str(action.err_str)

    # ----------------------------------------------------------------------------- at the end

    def build(self, *, final_ids: Sequence[int], final_text: str, finish_reason: str, prompt_tokens: int,
              extra: dict[str, Any] | None = None, completed_at: float | None = None) -> dict[str, Any]:
        """The JSON payload; call once, after the loop. The request's outcome — ``finish_reason``
        and ``extra``'s non-null entries (its ``tool_calls``, its ``error``) — goes into
        ``request.inference_stats``: the backend stores that object (JSONB) and has no column of
        its own for them, so anywhere else in the request they would be dropped without a trace.
        ``completed_at``: when the request ended (epoch seconds; default now), for a payload built
        later than that."""
        later, self._later = self._later, []
        for event, top, at in later:
            self.event(event, top, at=at)
        self._replay()
        if self._top:
            values = torch.stack([v[b] for _, v, _, b in self._top])[:, :TOP_TOKENS].cpu()  # one device→host copy
            indices = torch.stack([i[b] for _, _, i, b in self._top])[:, :TOP_TOKENS].cpu()
            rows_i, rows_v = indices.tolist(), values.tolist()
            distinct = sorted({t for row in rows_i for t in row})
            texts = {t: text[-_TOKEN_TEXT_CHARS:]
                     for t, text in zip(distinct, _decode_all(self._tokenizer, [[t] for t in distinct]))}
            for (record, _, _, _), row_i, row_v in zip(self._top, rows_i, rows_v):
                record["top_tokens"] = [
                    {"token": t, "logprob": finite(lp), "token_str": texts[t],
                     "prob": math.exp(lp) if lp > -700 else 0.0}
                    for t, lp in zip(row_i, row_v)]
            self._top = []
        self._texts.resolve(self._tokenizer)
        self._texts = _PendingTexts()
        self._request_cut_marker()
        request = dict(self._request)
        request.update({
            "created_at": iso_time(self._created),
            "completed_at": iso_time(datetime.now(timezone.utc).timestamp() if completed_at is None else completed_at),
            "final_token_ids": [int(t) for t in final_ids if int(t) >= 0],
            "final_text": final_text,
            "inference_stats": {"prompt_tokens": prompt_tokens, "generated_tokens": len(final_ids),
                                "total_tokens": prompt_tokens + len(final_ids), "finish_reason": finish_reason,
                                **{k: _jsonable(v) for k, v in (extra or {}).items() if v is not None}},
        })
        if self._budget.cut_chars or self._budget.cut_entries:
            request["inference_stats"]["mod_logs_cut"] = {"characters": self._budget.cut_chars,
                                                          "entries": self._budget.cut_entries}
        return {
            "request": request,
            "events": [_with_iso(r) for r in self._events],
            "mod_calls": [_with_iso(r) for r in self._mod_calls],
            "mod_logs": [_with_iso(r) for r in self._mod_logs],
            "actions": [_with_iso(r) for r in self._actions],
        }


    def _request_cut_marker(self) -> None:
        """The one marker for everything the per-request limit cut (it is not charged: there is one)."""
        budget = self._budget
        if budget.request_cut_at is None:
            return
        index, mod = budget.request_cut_at
        marker = _cut_marker(budget.cut_chars, budget.cut_entries, "request", "mod_log_max_chars_per_request",
                             budget.per_request)
        self._mod_logs.append({"mod_call_sequence": index, "mod_name": mod, "log_message": marker,
                               "log_level": "WARNING", "created_at": datetime.now(timezone.utc).timestamp()})
        budget.request_cut_at = None


def _with_iso(record: dict[str, Any]) -> dict[str, Any]:
    out = dict(record)
    if isinstance(out.get("created_at"), float):
        out["created_at"] = iso_time(out["created_at"])
    return out


def _i32(value: Any) -> int:
    return max(-(2**31), min(2**31 - 1, int(value or 0)))


def _jsonable(value: Any) -> Any:
    """A mod's value as plain JSON data (non-finite floats → null; unknown objects → str)."""
    try:
        return json.loads(dumps(value))
    except (TypeError, ValueError):
        return json.loads(dumps(value, default=str))
