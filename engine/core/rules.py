"""The generation loop: events out, mod actions in — every event × action rule in one place.

Phase order (compat §4.1; seed 000 module 3)::

    prefill ─ Prefilled ─► actions                                   (once, step 0)
    loop:  forward ─ ForwardPass ─► actions
           sample  ─ Sampled     ─► actions      (skipped when the step's tokens are forced)
           add     ─ Added       ─► actions
           stop checks; step += 1                                    (steps 0, 1, 2, …)

Each phase has one ``apply_*`` method (ForwardPass and Sampled share ``apply_step``) with one case per action the event allows (compat
§4.2, "Recommended" column). Processing a phase's actions goes in mod registration order and
ends at the first Backtrack, AdjustedPrefill or terminal action; every non-Noop action after that
point is recorded as ignored, never dropped silently.

Rules, with the deviations (DEV) from the original engine that compat §4 recommends:

* **ForceTokens** queue per request (``ModManager.forced_queues[rid]``); at most one accepted
  per step, from any phase (later ones are ignored with a reason). A non-empty queue at the
  sampling point skips sampling *and* the Sampled event (DEV ⚠F5); the whole queue is committed
  as one ``Added(tokens, forced=True)``. A Sampled-phase ForceTokens replaces the sampled
  token (⚠F6). An Added-phase ForceTokens is committed right after the added tokens with no
  further Added event (mods such as SelfPrompt rely on never seeing it).
* **Backtrack(n, R)** erases committed tokens and never prompt tokens (DEV ⚠F4):
  at ForwardPass ``min(n, C)`` of the committed tokens ``C``, no sample this step;
  at Sampled the pending sample counts as the first erased token, then ``min(n - 1, C)``;
  at Added the tokens just added count first (they are committed), ``min(n, C)`` in all.
  Non-empty ``R`` is committed; from ForwardPass/Sampled it is announced by
  ``Added(R, forced=True)``, from Added it is committed silently. ``tokens=None`` and
  ``tokens=[]`` behave alike. The mod's action object is never mutated (DEV).
* **AdjustedLogits**: sampling uses the action's logits (numpy, torch or Tensor shim; ``[1, V]``
  or ``[V]``); the last one wins. ``token_temp``: None keeps the request temperature, 0 is
  greedy (DEV ⚠F8), otherwise that temperature for this step.
* **AdjustedPrefill(tokens, max_steps)**: non-empty ``tokens`` replace the prompt (prefilled
  again, Prefilled not re-dispatched); ``max_steps > 0`` becomes the token budget (DEV ⚠F7).
* **Terminal actions** end the request at once, dropping tokens of the current step:
  ForceOutput → output is exactly its tokens (finish ``stop``); ToolCalls → finish
  ``tool_calls`` with ``tool_calls = [payload]`` (⚠F13 wrapping kept); EmitError → finish
  ``error``. After a terminal Prefilled action no forward pass runs (DEV).
* **Prefilled** is dispatched once, ``max_steps`` = the token budget (DEV ⚠F15). A raw mod's
  ForceTokens at Prefilled (which validation rejects) is still queued as the first Added
  chunk, as compat §4.2 recommends.
* **Stopping**: a stop token (EOS ids of tokenizer and generation config, plus
  ``stop_tokens``) committed in this step and not erased ends the request after the step's
  Added was dispatched; stop ids are stripped from the output. The budget counts the current
  committed tokens (forced included); ``step_limit`` bounds iterations (Backtrack can erase
  tokens forever); a full context window also ends the request (``length``).

The loop does no I/O: it reports to a recorder (the ingest payload) and to an optional
``on_event`` callback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from mods.manager import ModCall, ModManager
from mods.types import (
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ModAction,
    ModEvent,
    Noop,
    ToolCalls,
)

from engine.model.backend import Backend, ForwardRecord
from engine.core.result import FinishReason, IgnoredAction
from engine.model.sampling import SamplingParams
from engine.model.tensor import as_torch

__all__ = ["GenerationRequest", "RequestState", "Recorder", "HiddenSink", "run_generation"]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    input_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    step_limit: int
    seed: int | None = None


class HiddenSink(Protocol):
    """Where the hidden states of every forward pass go (SAE encoding), when asked for."""

    def on_forward(self, request_id: str, step: int, record: ForwardRecord) -> None: ...

    def finish(self, request_id: str) -> None: ...


class Recorder(Protocol):
    """Where the loop reports events, mod calls and what became of each action."""

    def event(self, event: ModEvent) -> int: ...

    def calls(self, event_index: int, calls: Sequence[ModCall]) -> list[int | None]: ...

    def action(self, call_index: int | None, action: ModAction, *, applied: bool, note: str | None = None) -> None: ...


@dataclass
class RequestState:
    """Everything one request's loop knows; handed to every helper."""

    request: GenerationRequest
    prompt_ids: list[int]
    max_tokens: int
    forced_queue: list[int]
    generated: list[int] = field(default_factory=list)
    step: int = 0
    finish: FinishReason | None = None
    forced_output: list[int] | None = None
    tool_calls: list[Any] | None = None
    error: str | None = None
    events: list[ModEvent] = field(default_factory=list)
    actions: list[ModAction] = field(default_factory=list)
    ignored: list[IgnoredAction] = field(default_factory=list)
    # per step
    force_accepted: bool = False
    step_committed: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def commit(self, tokens: Sequence[int]) -> None:
        self.generated.extend(tokens)
        self.step_committed.extend(tokens)

    def erase(self, n: int) -> None:
        del self.generated[len(self.generated) - n:]
        del self.step_committed[max(0, len(self.step_committed) - n):]

    def take_queue(self) -> list[int]:
        tokens = list(self.forced_queue)
        self.forced_queue.clear()
        return tokens


@dataclass
class _Call:
    call: ModCall
    index: int | None  # its position in the payload's mod_calls, when recorded


@dataclass
class _StepPlan:
    """What the ForwardPass/Sampled phase decided for the rest of the step."""

    logits: Any = None  # AdjustedLogits replacement (torch, on device)
    sampling: SamplingParams | None = None
    backtracked: bool = False
    reinject: list[int] = field(default_factory=list)


@dataclass
class _Loop:
    backend: Backend
    manager: ModManager
    recorder: Recorder
    state: RequestState
    on_event: Callable[[ModEvent], None] | None
    hidden_sink: HiddenSink | None = None

    # ------------------------------------------------------------------------------- plumbing

    def report_forward(self, step: int) -> None:
        """Hand the newest forward's hidden states to the sink (nearline: no waiting on encoding)."""
        if self.hidden_sink is not None:
            record = self.backend.take_forward_record(self.state.request_id)
            if record is not None:
                self.hidden_sink.on_forward(self.state.request_id, step, record)

    def dispatch(self, event: ModEvent) -> list[_Call]:
        self.state.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
        index = self.recorder.event(event)
        calls = self.manager.dispatch_traced(event)
        return [_Call(c, i) for c, i in zip(calls, self.recorder.calls(index, calls))]

    def applied(self, item: _Call, note: str | None = None, action: ModAction | None = None) -> None:
        action = action if action is not None else item.call.action
        self.state.actions.append(action)
        self.recorder.action(item.index, action, applied=True, note=note)

    def ignored(self, item: _Call, reason: str, action: ModAction | None = None) -> None:
        action = action if action is not None else item.call.action
        self.state.ignored.append(IgnoredAction(self.state.step, item.call.event_type, item.call.mod_name, action,
                                                reason))
        self.recorder.action(item.index, action, applied=False, note=reason)

    def ignore_rest(self, rest: Sequence[_Call], after: ModAction) -> None:
        for item in rest:
            if not isinstance(item.call.action, Noop):
                self.ignored(item, f"a {type(after).__name__} earlier in this phase ended processing")

    def valid_ids(self, item: _Call, ids: Sequence[int] | None, what: str) -> list[int] | None:
        """``ids`` as ints if all are in the vocabulary; otherwise record the action as ignored."""
        tokens = [int(t) for t in ids or []]
        vocab = self.backend.info.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            self.ignored(item, f"{what} holds token ids outside [0, {vocab}): {bad[:5]}")
            return None
        return tokens

    # ------------------------------------------------------------------------ shared effects

    def accept_force(self, item: _Call, action: ForceTokens) -> list[int] | None:
        """The ForceTokens ids if this is the step's first and they are valid, else None (ignored)."""
        if self.state.force_accepted:
            self.ignored(item, "a ForceTokens was already accepted this step (one per step, compat §4.4)", action)
            return None
        ids = self.valid_ids(item, action.tokens, "ForceTokens.tokens")
        if ids is not None:
            self.state.force_accepted = True
            self.applied(item, action=action)
        return ids

    def queue_force(self, item: _Call, action: ForceTokens) -> None:
        ids = self.accept_force(item, action)
        if ids:
            self.state.forced_queue.extend(ids)

    def finish_terminal(self, item: _Call) -> bool:
        """Apply a terminal action; False when it was ignored (bad token ids)."""
        action, state = item.call.action, self.state
        if isinstance(action, ForceOutput):
            ids = self.valid_ids(item, action.tokens, "ForceOutput.tokens")
            if ids is None:
                return False
            state.forced_output, state.finish = ids, FinishReason.STOP
        elif isinstance(action, ToolCalls):
            state.tool_calls, state.finish = [action.tool_calls], FinishReason.TOOL_CALLS
        else:
            state.error, state.finish = str(getattr(action, "err_str", "")), FinishReason.ERROR
        self.applied(item)
        return True

    def backtrack(self, item: _Call, already_erased: int) -> list[int] | None:
        """Erase per the phase rule; return the tokens to reinject (None if the action was ignored)."""
        action: Backtrack = item.call.action  # type: ignore[assignment]
        reinject = self.valid_ids(item, action.tokens, "Backtrack.tokens")
        if reinject is None:
            return None
        wanted = max(0, action.n - already_erased)
        erase = min(wanted, len(self.state.generated))
        if erase:
            self.backend.rewind_kv_cache(self.state.request_id, erase)
            self.state.erase(erase)
        self.applied(item, None if erase == wanted else f"erased {erase} of {wanted}: prompt tokens are kept")
        return reinject

    def commit(self, tokens: list[int], *, forced: bool, announce: bool) -> None:
        added = self.backend.add_token(self.state.request_id, self.state.step, tokens, forced)
        self.state.commit(tokens)
        if announce:
            self.apply_added(self.dispatch(added))

    # -------------------------------------------------------------------------------- phases

    def apply_prefilled(self, calls: list[_Call]) -> None:
        state = self.state
        for i, item in enumerate(calls):
            action = item.call.action
            if isinstance(item.call.rejected, ForceTokens):  # raw mod, compat §4.2 row "Prefilled | ForceTokens"
                self.queue_force(item, item.call.rejected)
                continue
            match action:
                case Noop():
                    continue
                case AdjustedPrefill():
                    tokens = self.valid_ids(item, action.tokens, "AdjustedPrefill.tokens")
                    if tokens is None:
                        continue
                    if int(action.max_steps or 0) > 0:
                        state.max_tokens = int(action.max_steps)
                    if tokens:
                        state.prompt_ids = tokens
                        self.backend.prefill(state.request_id, tokens, state.max_tokens)
                        self.report_forward(0)
                    self.applied(item)
                    return self.ignore_rest(calls[i + 1:], action)
                case ForceOutput() | ToolCalls() | EmitError():
                    if self.finish_terminal(item):
                        return self.ignore_rest(calls[i + 1:], action)
                case _:
                    self.ignored(item, f"{type(action).__name__} has no effect at Prefilled")

    def apply_forward_pass(self, calls: list[_Call]) -> _StepPlan:
        return self.apply_step(calls, "ForwardPass", logits_allowed=True, already_erased=0)

    def apply_sampled(self, calls: list[_Call]) -> _StepPlan:
        # the pending sample is erased first by a Backtrack here
        return self.apply_step(calls, "Sampled", logits_allowed=False, already_erased=1)

    def apply_step(self, calls: list[_Call], event: str, *, logits_allowed: bool, already_erased: int) -> _StepPlan:
        """ForwardPass and Sampled take the same actions, except that only ForwardPass may adjust
        logits and that at Sampled a Backtrack also drops the token just sampled."""
        plan = _StepPlan()
        for i, item in enumerate(calls):
            action = item.call.action
            match action:
                case Noop():
                    continue
                case AdjustedLogits() if logits_allowed:
                    self.adjust_logits(item, action, plan)
                case ForceTokens():
                    self.queue_force(item, action)
                case Backtrack():
                    reinject = self.backtrack(item, already_erased=already_erased)
                    if reinject is not None:
                        plan.backtracked, plan.reinject = True, reinject
                        self.ignore_rest(calls[i + 1:], action)
                        return plan
                case ForceOutput() | ToolCalls() | EmitError():
                    if self.finish_terminal(item):
                        self.ignore_rest(calls[i + 1:], action)
                        return plan
                case _:
                    self.ignored(item, f"{type(action).__name__} has no effect at {event}")
        return plan

    def adjust_logits(self, item: _Call, action: AdjustedLogits, plan: _StepPlan) -> None:
        vocab = self.backend.info.vocab_size
        try:
            logits = as_torch(action.logits, device=self.backend.info.device, dtype=torch.float32).reshape(-1)
        except Exception as err:  # a mod handed us something that is not a tensor
            return self.ignored(item, f"AdjustedLogits.logits is not a tensor: {err}")
        if logits.shape[0] != vocab:
            return self.ignored(item, f"AdjustedLogits.logits must have {vocab} entries ([1, V] or [V]), "
                                      f"got {logits.shape[0]}")
        temp = action.token_temp
        if temp is not None and (not isinstance(temp, (int, float)) or temp < 0):
            return self.ignored(item, f"AdjustedLogits.token_temp must be None or >= 0, got {temp!r}")
        base = self.state.request.sampling
        plan.logits = logits
        plan.sampling = base if temp is None else SamplingParams(float(temp), base.top_p, base.top_k)
        self.applied(item)

    def apply_added(self, calls: list[_Call]) -> None:
        for i, item in enumerate(calls):
            action = item.call.action
            match action:
                case Noop():
                    continue
                case ForceTokens():
                    ids = self.accept_force(item, action)
                    if ids:
                        self.commit(ids, forced=True, announce=False)  # silent continuation
                case Backtrack():
                    reinject = self.backtrack(item, already_erased=0)
                    if reinject is not None:
                        if reinject:
                            self.commit(reinject, forced=True, announce=False)
                        return self.ignore_rest(calls[i + 1:], action)
                case ForceOutput() | ToolCalls() | EmitError():
                    if self.finish_terminal(item):
                        return self.ignore_rest(calls[i + 1:], action)
                case _:
                    self.ignored(item, f"{type(action).__name__} has no effect at Added")

    # ---------------------------------------------------------------------------------- step

    def run_step(self) -> None:
        state, backend, rid = self.state, self.backend, self.state.request_id
        state.force_accepted = False
        state.step_committed = []
        forward = backend.forward_pass(rid, state.step)
        self.report_forward(state.step)
        plan = self.apply_forward_pass(self.dispatch(forward))
        sampled_token: int | None = None
        if state.finish is None and not plan.backtracked and not state.forced_queue:
            logits = plan.logits if plan.logits is not None else forward.logits
            sampled = backend.sample(rid, state.step, logits, plan.sampling or state.request.sampling)
            sampled_token = sampled.sampled_token
            plan = self.apply_sampled(self.dispatch(sampled))
        if state.finish is None:
            self.add_step_tokens(plan, sampled_token)
        self.end_step()

    def add_step_tokens(self, plan: _StepPlan, sampled_token: int | None) -> None:
        """Commit and announce this step's tokens: reinjected, forced, or the sample."""
        if plan.backtracked:
            if plan.reinject:
                self.commit(plan.reinject, forced=True, announce=True)
        elif self.state.forced_queue:
            self.commit(self.state.take_queue(), forced=True, announce=True)
        elif sampled_token is not None:
            self.commit([sampled_token], forced=False, announce=True)

    def end_step(self) -> None:
        state, request = self.state, self.state.request
        if state.finish is None:
            if any(t in request.stop_ids for t in state.step_committed):
                state.finish = FinishReason.STOP
            elif len(state.generated) >= state.max_tokens:
                state.finish = FinishReason.LENGTH
            elif len(state.prompt_ids) + len(state.generated) >= self.backend.info.max_context:
                state.finish = FinishReason.LENGTH
            elif state.step + 1 >= request.step_limit:
                state.finish = FinishReason.LENGTH
        state.step += 1


def run_generation(
    backend: Backend,
    request: GenerationRequest,
    manager: ModManager,
    recorder: Recorder,
    *,
    on_event: Callable[[ModEvent], None] | None = None,
    hidden_sink: HiddenSink | None = None,
) -> RequestState:
    """Run one request to completion and return its final state (token ids, no text)."""
    queue = manager.forced_queues.setdefault(request.request_id, [])
    queue.clear()
    state = RequestState(request, list(request.input_ids), request.max_tokens, queue)
    loop = _Loop(backend, manager, recorder, state, on_event, hidden_sink)
    try:
        started = time.perf_counter()
        prefilled = backend.prefill(request.request_id, request.input_ids, request.max_tokens, seed=request.seed)
        state.prefill_ms = (time.perf_counter() - started) * 1000.0
        loop.report_forward(0)
        loop.apply_prefilled(loop.dispatch(prefilled))
        while state.finish is None:
            loop.run_step()
    finally:
        manager.forced_queues.pop(request.request_id, None)
        manager.forced_reason_queues.pop(request.request_id, None)
        if hidden_sink is not None:
            hidden_sink.finish(request.request_id)
    return state
