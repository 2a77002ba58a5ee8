"""Streaming requests on the engine: :func:`submit` returns a handle that yields token events.

Every route submits through :func:`submit` and nothing else, so the server follows the engine's
streaming interface in one place:

* an engine with ``Engine.submit`` (requests join its shared continuous-batching step loop) is
  used directly;
* an engine without it gets :class:`_ThreadedRequest`, a stand-in with the same interface that
  runs ``Engine.generate(..., on_event=…)`` on a thread of its own. It turns the loop's events into
  :class:`TokenEvent` / :class:`Erased`, applies ``banned_tokens`` and ``repetition_penalty`` as a
  logits-adjusting mod that runs after the request's own mods (so the ban wins), reports
  log-probabilities of the distribution each token was drawn from, and for ``attention="all"``
  recomputes every layer's newest attention row with one extra no-cache forward of the context.
  That extra forward makes it slower than the step loop; it is correct, not fast.

Handle interface: ``for event in handle`` blocks per event and ends when the request finishes;
``handle.result(timeout)`` returns the ``GenerationResult``; ``handle.cancel()`` ends the request
at its next event (finish reason ``"cancelled"``).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["TokenEvent", "Erased", "submit", "engine_streams_natively"]

try:  # the engine's own event types, once it streams
    from engine.core.stream import Erased, TokenEvent  # type: ignore[import-not-found]
except ImportError:

    @dataclass(frozen=True)
    class TokenEvent:  # type: ignore[no-redef]
        """One committed chunk: a sampled token, or a forced chunk (``logprobs`` None per token).

        ``attention``: float32 ``(num_layers, num_heads, context_len)``, the attention from the
        newest token in context to every token in context, when the request asked for it.
        """

        request_id: str
        token_ids: tuple[int, ...]
        forced: bool
        logprobs: tuple[float | None, ...]
        top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
        attention: np.ndarray | None = None

    @dataclass(frozen=True)
    class Erased:  # type: ignore[no-redef]
        """The newest ``n`` streamed tokens were erased (a mod's Backtrack)."""

        request_id: str
        n: int


def engine_streams_natively(engine: Any) -> bool:
    return callable(getattr(engine, "submit", None))


def submit(engine: Any, **kwargs: Any) -> Any:
    """Start one request; raises the engine's typed errors for bad input before anything runs."""
    if engine_streams_natively(engine):
        return engine.submit(**kwargs)
    return _ThreadedRequest.start(engine, kwargs)


# ----------------------------------------------------------------------------- the stand-in

_END = object()


class _Cancelled(Exception):
    """Raised inside the stand-in's event callback to stop a cancelled request's loop."""


@dataclass
class _Pending:
    """What the current step produced before its tokens are committed."""

    processed: Any = None  # torch (V,) logits after bans/penalty
    sampled: int | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    attention: np.ndarray | None = None


class _ThreadedRequest:
    _GENERATE_KEYS = ("prompt", "messages", "input_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
                      "stop_tokens", "ignore_eos", "tools", "response_format")

    def __init__(self, engine: Any, kwargs: dict[str, Any]) -> None:
        self.engine = engine
        self.request_id = kwargs.get("request_id") or str(uuid.uuid4())
        self.kwargs = kwargs
        self.banned = tuple(int(t) for t in kwargs.get("banned_tokens") or ())
        self.penalty = float(kwargs.get("repetition_penalty") or 1.0)
        self.top_k_logprobs = int(kwargs.get("top_logprobs") or 0)
        self.attention = kwargs.get("attention")
        gen = engine.config.generation
        self.temperature = gen.temperature if kwargs.get("temperature") is None else float(kwargs["temperature"])
        self.top_p = gen.top_p if kwargs.get("top_p") is None else float(kwargs["top_p"])
        self.top_k = gen.top_k if kwargs.get("top_k") is None else int(kwargs["top_k"])
        self._events: queue.Queue[Any] = queue.Queue()
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._prompt_len: int | None = None
        self._streamed: list[int] = []
        self._pending = _Pending()

    @classmethod
    def start(cls, engine: Any, kwargs: dict[str, Any]) -> "_ThreadedRequest":
        from engine.engine import load_mods

        request = cls(engine, kwargs)
        engine.encode(kwargs.get("prompt"), messages=kwargs.get("messages"), input_ids=kwargs.get("input_ids"),
                      tools=kwargs.get("tools"))  # bad prompts raise here, synchronously
        mods = load_mods(kwargs.get("mods"))
        mods = [*mods, request._control_mod]  # last: its bans win over a request mod's logits
        thread = threading.Thread(target=request._run, args=(mods,), name=f"raylens-request-{request.request_id[:8]}",
                                  daemon=True)
        thread.start()
        return request

    # -------------------------------------------------------------------------- handle API

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._events.get()
            if item is _END:
                self._events.put(_END)  # a second iteration ends at once too
                return
            yield item

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        self._cancelled.set()

    # ----------------------------------------------------------------------------- running

    def _run(self, mods: list[Any]) -> None:
        args = {k: self.kwargs.get(k) for k in self._GENERATE_KEYS}
        prompt = args.pop("prompt")
        try:
            result = self.engine.generate(prompt, **args, mods=mods, request_id=self.request_id,
                                          on_event=self._on_event)
            self._reconcile(list(result.metadata.get("sequence_ids", [])))
            self._result = result
        except _Cancelled:
            self._result = _cancelled_result(self.request_id, self._streamed)
        except BaseException as err:  # handed to result(); the iterator still ends
            self._error = err
        finally:
            self._done.set()
            self._events.put(_END)

    def _on_event(self, event: Any) -> None:
        from mods.types import Added, ForwardPass, Prefilled, Sampled

        if self._cancelled.is_set():
            raise _Cancelled()
        if isinstance(event, Prefilled):
            self._prompt_len = len(event.input_ids or [])
        elif isinstance(event, ForwardPass):
            self._reconcile(list(event.input_ids or [])[self._prompt_len or 0:])
            self._pending = _Pending()
            if self.attention == "all":
                self._pending.attention = self._all_layer_attention(list(event.input_ids or []))
        elif isinstance(event, Sampled):
            self._pending.sampled = int(event.sampled_token)
            self._score_sample()
        elif isinstance(event, Added):
            sequence = self._backend_tokens()
            if sequence is None:
                sequence = [*self._streamed, *event.added_tokens]
            self._reconcile(sequence, sampled=not event.forced)

    def _backend_tokens(self) -> list[int] | None:
        """The request's committed tokens after the prompt, as the backend holds them now."""
        sequences = getattr(self.engine.backend, "_sequences", None)
        seq = sequences.get(self.request_id) if isinstance(sequences, dict) else None
        return list(seq.tokens)[self._prompt_len or 0:] if seq is not None else None

    def _reconcile(self, current: Sequence[int], *, sampled: bool = False) -> None:
        """Emit Erased / TokenEvent so the streamed tokens equal ``current``."""
        streamed = self._streamed
        common = 0
        for a, b in zip(streamed, current):
            if a != b:
                break
            common += 1
        if len(streamed) > common:
            self._events.put(Erased(self.request_id, len(streamed) - common))
            del streamed[common:]
        new = tuple(int(t) for t in current[common:])
        if not new:
            return
        pending = self._pending
        if sampled and new == (pending.sampled,):
            event = TokenEvent(self.request_id, new, False, (pending.logprob,),
                               (pending.top,) if self.top_k_logprobs else None, pending.attention)
        else:
            event = TokenEvent(self.request_id, new, True, (None,) * len(new),
                               ((),) * len(new) if self.top_k_logprobs else None, pending.attention)
        self._pending = dataclasses.replace(pending, attention=None)
        streamed.extend(new)
        self._events.put(event)

    # ----------------------------------------------------------------------- logits and scores

    def _control_mod(self, event: Any, tokenizer: Any) -> Any:
        """Bans and repetition penalty as an AdjustedLogits at ForwardPass; keeps the processed
        logits so the sampled token's log-probability comes from the distribution it was drawn from."""
        import torch

        from mods.types import AdjustedLogits, ForwardPass

        if not isinstance(event, ForwardPass):
            return None
        logits = event.logits.tensor if hasattr(event.logits, "tensor") else torch.as_tensor(event.logits)
        scores = logits.reshape(-1).float().clone()  # (V,)
        changed = False
        if self.penalty != 1.0 and event.input_ids:
            ids = torch.tensor(sorted(set(event.input_ids)), dtype=torch.long, device=scores.device)
            picked = scores[ids]
            scores[ids] = torch.where(picked < 0, picked * self.penalty, picked / self.penalty)
            changed = True
        if self.banned:
            scores[torch.tensor(self.banned, dtype=torch.long, device=scores.device)] = float("-inf")
            changed = True
        self._pending.processed = scores
        return AdjustedLogits(scores[None, :]) if changed else None

    def _score_sample(self) -> None:
        import torch

        pending = self._pending
        if pending.processed is None or pending.sampled is None:
            return
        scores = pending.processed[None, :]
        if self.temperature > 0:
            from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

            scores = scores / self.temperature
            if self.top_k > 0:
                scores = TopKLogitsWarper(self.top_k)(None, scores)
            if self.top_p < 1.0:
                scores = TopPLogitsWarper(self.top_p)(None, scores)
        logp = torch.log_softmax(scores[0], dim=-1)
        pending.logprob = float(logp[pending.sampled])
        if self.top_k_logprobs:
            values, ids = torch.topk(logp, self.top_k_logprobs)
            pending.top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))

    def _all_layer_attention(self, context: list[int]) -> np.ndarray | None:
        """Every layer's attention row from the newest context token, ``(layers, heads, len(context))``.

        One no-cache forward of ``context`` through the model's capturing attention function, with
        a capture object that matches every layer and keeps each layer's newest query row.
        """
        import torch

        from engine.model import capture

        backend = self.engine.backend
        model = getattr(backend, "model", None)
        if model is None or model.config._attn_implementation != capture.ATTENTION_IMPLEMENTATION:
            return None
        kwarg = getattr(capture, "CAPTURE_KWARG", None) or getattr(capture, "_CAPTURE_KWARG")
        sink = _EveryLayerCapture()
        ids = torch.tensor([context], dtype=torch.long, device=model.device)  # (1, kv)
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1, **{kwarg: sink})
        rows = [row[:, -1, :] for row in sink.rows]  # each (heads, kv)
        return torch.stack(rows).float().cpu().numpy()  # (layers, heads, kv)


class _AnyLayer(int):
    """An int equal to every layer index, so the capturing attention function fires on all layers."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, int)

    __hash__ = int.__hash__


class _EveryLayerCapture:
    """The capture sink for :meth:`_ThreadedRequest._all_layer_attention`: layers run in order,
    so appending each assigned pattern yields them by layer index."""

    newest_row_only = True

    def __init__(self) -> None:
        self.layer = _AnyLayer(0)
        self.rows: list[Any] = []

    @property
    def pattern(self) -> Any:
        return self.rows[-1] if self.rows else None

    @pattern.setter
    def pattern(self, value: Any) -> None:
        self.rows.append(value)  # (heads, 1, kv)


def _cancelled_result(request_id: str, streamed: list[int]) -> Any:
    from engine.core.result import GenerationResult

    return GenerationResult(request_id=request_id, prompt_ids=[], output_ids=list(streamed), output_text="",
                            finish_reason="cancelled", events=[], actions=[], ignored_actions=[], payload={},  # type: ignore[arg-type]
                            metadata={"sequence_ids": list(streamed)})
