"""One request in the step loop: what was asked, processed (:class:`EngineRequest`, built only by
:class:`engine.core.inputs.InputProcessor`), and everything its generation knows so far
(:class:`RequestState`). The batch owns only tensors; each request owns its
mods, forced queue, sampling generator, payload, capture plan and stream."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from engine.core.result import FinishReason, IgnoredAction
from engine.model.backend import ForwardRecord, RowOutput
from engine.model.capture import CapturePlan
from engine.model.sampling import SamplingParams, TokenCounts
from mods.manager import ModCall, ModManager
from mods.token_ids import TokenIds
from mods.types import ModAction, ModEvent

if TYPE_CHECKING:  # llguidance is imported only by requests that ask for structured output
    from engine.core.structured import CompiledGrammar
    from engine.core.structured.state import GrammarState

__all__ = ["EngineRequest", "RequestContext", "RequestState", "RequestStatus", "PayloadSink", "HiddenSink", "ForwardRecord"]


@dataclass(frozen=True)
class RequestContext:
    """What a request brings besides its tokens, for its mods and payload: the user's own words
    (``user_prompt``), the conversation mods read through ``get_conversation``, and the
    ``response_format`` and ``tools`` their schemas come from. Plain data: it crosses Ray."""

    user_prompt: str | None = None
    conversation: tuple[dict[str, Any], ...] = ()
    response_format: dict[str, Any] | None = None
    tools: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class EngineRequest:
    """A validated request as the step loop runs it: token ids, resolved sampling, the stop set
    and limits, built only by :class:`~engine.core.input_processor.InputProcessor`.
    ``caller_request_id``: the id the caller gave (None: ``request_id`` was generated; the engine
    may run a reused one under a fresh ``request_id``); ``prefix_cache``: whether this request
    reuses and offers cached prompt prefixes (its flag, else the backend's default)."""

    request_id: str
    input_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    step_limit: int
    seed: int | None = None
    logprobs: int = -1  # -1: none; 0: each token's log-prob; k > 0: also its k best alternatives
    attention_all_layers: bool = False  # stream every layer's newest attention row with each token
    mods: tuple[Callable[..., Any], ...] = ()  # loaded, in call order
    mod_call_timeout_s: float | None = None
    min_tokens: int = 0  # stop tokens are not drawn before this many tokens were generated
    grammar: CompiledGrammar | None = field(default=None, repr=False, compare=False)  # structured output
    caller_request_id: str | None = None
    prefix_cache: bool = True
    keep_logits: bool = False  # the result's ForwardPass events keep their step's logits
    payload_top_tokens: bool = True  # its payload's ForwardPass records list each step's top tokens
    context: RequestContext = field(default_factory=RequestContext, repr=False, compare=False)

    def portable(self) -> "EngineRequest":
        """This request for another process (a Serve replica reading a GeneratorActor's stream):
        the same type without its loaded mods and compiled grammar, which belong to the engine
        that built them."""
        return replace(self, mods=(), grammar=None)


class HiddenSink(Protocol):
    """Where the hidden states of every forward of a request go (SAE encoding), when subscribed."""

    def on_forward(self, request_id: str, step: int, record: ForwardRecord) -> Any:
        """May return the forward's encoded features (inline SAE encoding) for the events."""
        ...

    def finish(self, request_id: str) -> None: ...


class PayloadSink(Protocol):
    """Where the loop reports events, mod calls and what became of each action (the payload)."""

    def event(self, event: ModEvent, top: tuple[Any, Any, int] | None = None) -> int: ...

    def event_later(self, events: Sequence[tuple[ModEvent, Any, float]]) -> None: ...

    def sampled(self, step: int, token: int) -> int: ...

    def added(self, step: int, tokens: Sequence[int], forced: bool) -> int: ...

    def call(self, event_index: int, call: ModCall) -> int | None: ...

    def action(self, call_index: int | None, action: ModAction, *, applied: bool, note: str | None = None,
               dims: tuple[int, ...] | None = None) -> None: ...

    def take_back_action(self, call_index: int | None) -> None: ...


class StreamSink(Protocol):
    """Where committed and erased tokens are announced as they happen (a request's stream)."""

    def committed(self, tokens: Sequence[int], forced: bool, sample: Any, attention: Any,
                  sae_features: Any = None) -> None: ...

    def erased(self, n: int) -> None: ...


class RequestStatus(enum.Enum):
    """Where a request is: queued, admitted with its prompt being fed, decoding (Prefilled was
    dispatched: a token per step), or finished (``RequestState.finish`` says why)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class RequestState:
    """Everything one request's generation knows; handed to every rule and step helper.

    ``prompt_ids + generated`` is what the model reads; the first ``cached`` of those positions
    have keys/values in the request's cache slot, and ``output`` holds the newest forward's logits
    and internals (None when the next step must run a forward first).
    """

    request: EngineRequest
    manager: ModManager
    payload: PayloadSink
    generator: torch.Generator
    plan: CapturePlan
    prompt_ids: list[int]
    max_tokens: int
    forced_queue: list[int]
    event_layer: int
    on_event: Callable[[ModEvent], None] | None = None
    hidden_sink: HiddenSink | None = None
    stream: StreamSink | None = None
    generated: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # per generated token, when asked for
    step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish: FinishReason | None = None  # set only by finish_with
    forced_output: list[int] | None = None
    tool_calls: list[Any] | None = None
    error: str | None = None
    error_parameter: str | None = None  # the request's own field at fault (its grammar's), when one is
    events: list[ModEvent] = field(default_factory=list)
    actions: list[ModAction] = field(default_factory=list)
    ignored: list[IgnoredAction] = field(default_factory=list)
    cached: int = 0
    output: RowOutput | None = None
    sae_features: Any = None  # the newest forward's inline SAE encoding (EncodedForward), if any
    steers: dict[int, float] = field(default_factory=dict)  # SAE feature id → scale, from Steer actions
    steer_delta: Any = None  # (d,) sum of scale × decoder direction, added at the SAE layer each forward
    # per step
    force_accepted: bool = False
    step_committed: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0
    started_at: float = 0.0
    # structured output: the request's GrammarState, kept in step with ``generated`` by append/erase
    grammar: GrammarState | None = None
    # the penalties' token counts, by what they count ("generated"; "history": prompt + generated),
    # from their first use on
    counts: dict[str, TokenCounts] = field(default_factory=dict, repr=False)
    # ``prompt_ids + generated`` as one list that only grows (None: made at the next read), which
    # events view (:meth:`token_ids`); an erase or a new prompt starts a new one
    _sequence: list[int] | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    def token_ids(self) -> TokenIds:
        """The sequence so far as an event carries it (``input_ids``): a view, made in O(1) a step
        (a list a step would cost a request O(length) a step and its events O(length²) ids)."""
        sequence = self._sequence
        if sequence is None:
            sequence = self._sequence = self.prompt_ids + self.generated
        return TokenIds(sequence)

    def penalty_counts(self, kind: str, vocab: int, device: torch.device) -> torch.Tensor:
        """``(V,)`` counts of the ``"generated"`` tokens (presence/frequency penalties) or of the
        ``"history"``, the prompt's and generated tokens (repetition penalty). Counted once on
        first use, then kept in step by :meth:`append`, :meth:`erase` and :meth:`replace_prompt`."""
        counts = self.counts.get(kind)
        if counts is None or counts.vocab != vocab or counts.device != device:
            counts = self.counts[kind] = TokenCounts(self.tokens if kind == "history" else self.generated, vocab,
                                                     device)
        return counts.counts

    def replace_prompt(self, tokens: list[int]) -> None:
        """AdjustedPrefill: the new prompt is fed by the next forwards (Prefilled is not re-sent);
        counts that include the old prompt are dropped and counted again when next needed."""
        self.prompt_ids, self.cached, self.output = list(tokens), 0, None
        self._sequence = None  # views made before keep the old prompt
        self.counts.pop("history", None)

    def _count(self, tokens: Sequence[int], *, removed: bool) -> None:
        """Keep the penalties' counts (those in use) in step with tokens joining or leaving."""
        for counts in self.counts.values():
            (counts.remove if removed else counts.add)(tokens)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def needs_forward(self) -> bool:
        return self.cached < self.length or self.output is None

    def commit(self, tokens: Sequence[int], *, forced: bool, sample: Any = None, attention: Any = None,
               sae_features: Any = None) -> None:
        tokens = self.append(tokens, sample)
        if self.stream is not None and tokens:
            self.stream.committed(tokens, forced, sample, attention, sae_features)

    def append(self, tokens: Sequence[int], sample: Any = None) -> Sequence[int]:
        """The tokens join the sequence, unannounced (the stream hears of them from ``commit``);
        returns those that joined. With a grammar, the grammar takes them too: forced tokens it
        rejects bypass it (``engine/core/structured/state.py``); a sampled token it rejects (its
        mask left no finite logit, e.g. a mod's AdjustedLogits) does not join and ends the request."""
        if self.grammar is not None and self.finish is None:
            attached = self.grammar.attached
            accepted = self.grammar.advance(tokens)
            if sample is not None and attached and accepted < len(tokens):
                self.grammar.rollback(len(tokens) - accepted)
                self.fail(f"no token the request's `{self.grammar.spec.parameter}` allows had a finite logit at "
                          f"generated token {len(self.generated)} (sampled {list(tokens)}); a mod's AdjustedLogits "
                          "must leave one of them finite")
                return []
        self.generated.extend(tokens)
        if self._sequence is not None:
            self._sequence.extend(tokens)
        self._count(tokens, removed=False)
        self.step_committed.extend(tokens)
        if self.request.logprobs >= 0 and tokens:
            first = sample.logprob if sample is not None else None
            self.logprobs.extend([first] + [None] * (len(tokens) - 1))
        return tokens

    def erase(self, n: int) -> None:
        """Drop the newest ``n`` generated tokens: a position move. The last kept token is fed
        again if its keys/values were overwritten-to-be, so the next forward predicts after it."""
        if n <= 0:
            return
        if self.grammar is not None:
            self.grammar.rollback(n)
        self._count(self.generated[len(self.generated) - n:], removed=True)
        del self.generated[len(self.generated) - n:]
        self._sequence = None  # a new list: views made before keep the erased ids
        del self.logprobs[len(self.generated):]
        del self.step_committed[max(0, len(self.step_committed) - n):]
        keep = self.length
        if self.cached > keep:
            self.cached = keep - 1
            self.output = None
        if self.stream is not None:
            self.stream.erased(n)

    def take_queue(self) -> list[int]:
        tokens = list(self.forced_queue)
        self.forced_queue.clear()
        return tokens

    def finish_with(self, reason: FinishReason, *, error: str | None = None, error_parameter: str | None = None,
                    output: list[int] | None = None, tool_calls: list[Any] | None = None) -> None:
        """End the request: the one place its status becomes FINISHED and its finish reason is set.
        The first reason stands, except that an error replaces any other (a fault found after a
        stop still ends the request as a fault); ``output`` (ForceOutput's tokens), ``tool_calls``
        and an error's message and parameter (the request field at fault, when one is) go with
        the reason that set them."""
        if self.finish is not None and (self.finish is FinishReason.ERROR or reason is not FinishReason.ERROR):
            return
        self.finish, self.status = reason, RequestStatus.FINISHED
        if error is not None:
            self.error, self.error_parameter = error, error_parameter
        if output is not None:
            self.forced_output = output
        if tool_calls is not None:
            self.tool_calls = tool_calls

    def fail(self, message: str, parameter: str | None = None) -> None:
        """End the request with finish reason ``error`` (its neighbours are unaffected);
        ``parameter``: the request field at fault, when one is."""
        self.finish_with(FinishReason.ERROR, error=message, error_parameter=parameter)
