"""The generation loop: events out, mod actions in — every event × action rule in one place.

Phase order (the contract, with every rule, is ``docs/generation-rules.md``)::

    prefill ─ Prefilled ─► actions                                   (once, step 0)
    loop:  forward ─ ForwardPass ─► actions
           sample  ─ Sampled     ─► actions      (skipped when the step's tokens are forced)
           add     ─ Added       ─► actions
           stop checks; step += 1                                    (steps 0, 1, 2, …)

Each phase has one ``apply_*`` method (ForwardPass and Sampled share ``apply_step``) with one case per action the event allows. Processing a phase's actions goes in mod registration order and
ends at the first Backtrack, AdjustedPrefill or terminal action; every non-Noop action after that
point is recorded as ignored, never dropped silently.

Rules, with the deliberate deviations (DEV) from the original engine:

* **ForceTokens** queue per request (``ModManager.forced_queues[rid]``); at most one accepted
  per step, from any phase (later ones are ignored with a reason). A non-empty queue at the
  sampling point skips sampling *and* the Sampled event (DEV); the whole queue is committed
  as one ``Added(tokens, forced=True)``. A Sampled-phase ForceTokens replaces the sampled
  token. An Added-phase ForceTokens is committed right after the added tokens with no
  further Added event (mods such as SelfPrompt rely on never seeing it).
* **Backtrack(n, R)** erases committed tokens and never prompt tokens (DEV):
  at ForwardPass ``min(n, C)`` of the committed tokens ``C``, no sample this step;
  at Sampled the pending sample counts as the first erased token, then ``min(n - 1, C)``;
  at Added the tokens just added count first (they are committed), ``min(n, C)`` in all.
  Non-empty ``R`` is committed; from ForwardPass/Sampled it is announced by
  ``Added(R, forced=True)``, from Added it is committed silently. ``tokens=None`` and
  ``tokens=[]`` behave alike. The mod's action object is never mutated (DEV).
* **AdjustedLogits**: sampling uses the action's logits (numpy, torch or Tensor shim; ``[1, V]``
  or ``[V]``); the last one wins. ``token_temp``: None keeps the request temperature, 0 is
  greedy (DEV), otherwise that temperature for this step.
* **AdjustedPrefill(tokens, max_steps)**: non-empty ``tokens`` replace the prompt (prefilled
  again, Prefilled not re-dispatched); ``max_steps > 0`` becomes the token budget (DEV).
* **Terminal actions** end the request at once, dropping tokens of the current step:
  ForceOutput → output is exactly its tokens (finish ``stop``); ToolCalls → finish
  ``tool_calls`` with ``tool_calls = [payload]`` (wrapping kept); EmitError → finish
  ``error``. After a terminal Prefilled action no forward pass runs (DEV).
* **Prefilled** is dispatched once, ``max_steps`` = the token budget (DEV). A raw mod's
  ForceTokens at Prefilled (which validation rejects) is still queued as the first Added
  chunk.
* **Stopping**: a stop token (EOS ids of tokenizer and generation config, plus
  ``stop_tokens``) committed in this step and not erased ends the request after the step's
  Added was dispatched; stop ids are stripped from the output. The budget counts the current
  committed tokens (forced included); ``step_limit`` bounds iterations (Backtrack can erase
  tokens forever); a full context window also ends the request (``length``).

These rules see one request at a time (:class:`~engine.core.request.RequestState`); the step
loop (:mod:`engine.core.step_loop`) runs the forward and the sampling of many requests at once
and calls them in between. They do no I/O: they report to the request's payload sink (the
ingest-payload builder) and to an optional ``on_event`` callback.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from engine.core.request import ForwardRecord, RequestState
from engine.core.result import FinishReason, IgnoredAction
from engine.model.sampling import SamplingParams
from engine.model.tensor import TensorShim, as_torch
from mods.manager import ModCall
from mods.validation import InvalidActionError, check_action_values, check_steer, check_token_ids
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
    Noop,
    Prefilled,
    SAEFeatures,
    Sampled,
    Steer,
    ToolCalls,
)

__all__ = ["Rules", "StepPlan", "SteerSource"]


class SteerSource(Protocol):
    """Where Steer actions get their directions (the engine's loaded SAE)."""

    layer: int
    num_features: int

    def delta(self, steers: dict[int, float]) -> Any: ...


@dataclass
class _Call:
    call: ModCall
    index: int | None  # its position in the payload's mod_calls, when recorded


@dataclass
class StepPlan:
    """What the ForwardPass/Sampled phase decided for the rest of the step."""

    logits: Any = None  # AdjustedLogits replacement (torch, on device)
    sampling: SamplingParams | None = None
    backtracked: bool = False
    reinject: list[int] = field(default_factory=list)


class Rules:
    """Applies one request's mod actions, phase by phase; events are built from its newest forward."""

    def __init__(self, state: RequestState, *, vocab_size: int, device: torch.device,
                 steering: SteerSource | None = None) -> None:
        self.state = state
        self.vocab_size = vocab_size
        self.device = device
        self.steering = steering
        self.steer_log: list[dict[str, Any]] = []  # every applied Steer: step, feature, scale

    # ------------------------------------------------------------------------------- plumbing

    def report_forward(self, start: int, fed: Sequence[int]) -> None:
        """Hand the newest forward's hidden states to the SAE sink (nearline: no waiting)."""
        state = self.state
        state.sae_features = None
        if state.hidden_sink is not None and state.output is not None and state.output.captured.hidden:
            state.sae_features = state.hidden_sink.on_forward(
                state.request_id, state.step, ForwardRecord(start, tuple(fed), state.output.captured.hidden))

    def record(self, event: ModEvent) -> int:
        """The event joins the request's events and payload (no mod sees it); its payload index."""
        state = self.state
        state.events.append(event)
        if state.on_event is not None:
            state.on_event(event)
        top = state.output.top if isinstance(event, ForwardPass) and state.output is not None else None
        return state.payload.event(event, top)

    def dispatch(self, event: ModEvent) -> list[_Call]:
        state = self.state
        index = self.record(event)
        calls = state.manager.dispatch_traced(event)
        items = [_Call(c, i) for c, i in zip(calls, state.payload.calls(index, calls))]
        return items if self.check_fatal_calls(items) else []

    def applied(self, item: _Call, note: str | None = None, action: ModAction | None = None) -> None:
        action = action if action is not None else item.call.action
        self.state.actions.append(action)
        self.state.payload.action(item.index, action, applied=True, note=note)

    def ignored(self, item: _Call, reason: str, action: ModAction | None = None) -> None:
        action = action if action is not None else item.call.action
        self.state.ignored.append(IgnoredAction(self.state.step, item.call.event_type, item.call.mod_name, action,
                                                reason))
        self.state.payload.action(item.index, action, applied=False, note=reason)

    def ignore_rest(self, rest: Sequence[_Call], after: ModAction) -> None:
        for item in rest:
            if not isinstance(item.call.action, Noop):
                self.ignored(item, f"a {type(after).__name__} earlier in this phase ended processing")

    def fault(self, item: _Call, reason: str, action: ModAction | None = None) -> None:
        """A mod handed back a value the engine cannot use: the action is recorded as not applied
        and the request ends with finish reason ``error`` naming the mod (its neighbours go on)."""
        action = action if action is not None else item.call.action
        self.ignored(item, reason, action)
        self.state.fail(f"mod {item.call.mod_name} returned an unusable {type(action).__name__} at "
                        f"{item.call.event_type} step {self.state.step}: {reason}")

    def valid(self, item: _Call, action: ModAction | None = None) -> bool:
        """Check every value of the action before it is applied (token ids in the vocabulary,
        finite logits, a usable temperature); a bad one is a :meth:`fault`."""
        action = action if action is not None else item.call.action
        try:
            check_action_values(action, self.vocab_size, logits=False)
        except InvalidActionError as err:
            self.fault(item, str(err), action)
            return False
        return True

    def valid_ids(self, item: _Call, ids: Sequence[int] | None, what: str) -> list[int] | None:
        """``ids`` as ints if all are token ids in the vocabulary; otherwise a :meth:`fault`."""
        try:
            return check_token_ids(ids if ids is not None else [], self.vocab_size, field=what)
        except InvalidActionError as err:
            self.fault(item, str(err))
            return None

    def check_fatal_calls(self, calls: Sequence[_Call]) -> bool:
        """A call that timed out or raised a BaseException ends the request (the mod cannot be
        trusted to go on); True when the request may continue."""
        for item in calls:
            call = item.call
            if getattr(call, "fatal", False):
                what = call.exception.message if call.exception is not None else "failed"
                kind = call.exception.type if call.exception is not None else "error"
                self.state.fail(f"mod {call.mod_name} failed on {call.event_type} step {call.step}: {kind}: {what}")
                return False
        return True

    # ------------------------------------------------------------------------------- events

    def _shim(self, tensor: torch.Tensor | None) -> TensorShim | None:
        return TensorShim(tensor, readonly=True) if tensor is not None else None

    def _features(self, newest_only: bool) -> SAEFeatures | None:
        """The inline SAE encoding of the newest forward, as the SDK's numpy object."""
        encoded = self.state.sae_features
        if encoded is None:
            return None
        values, indices = (encoded.values[-1], encoded.indices[-1]) if newest_only else (encoded.values,
                                                                                         encoded.indices)
        return SAEFeatures(indices.cpu().numpy(), values.float().cpu().numpy(), encoded.release, encoded.layer)

    def prefilled_event(self) -> Prefilled:
        from mods.types import ContextInfo

        state = self.state
        captured = state.output.captured  # type: ignore[union-attr]
        layer = state.event_layer
        ids = list(state.prompt_ids)
        return Prefilled(
            state.request_id, 0, state.max_tokens, ContextInfo(state.request_id, ids, state.max_tokens),
            hidden_states=self._shim(captured.hidden.get(layer)),  # (seq, d)
            attention_patterns=self._shim(captured.attention.get(layer)),  # (h, seq, seq)
            layer=layer,
            input_ids=ids,
            sae_features=self._features(newest_only=False),  # (prompt_len, k)
        )

    def forward_event(self) -> ForwardPass:
        state = self.state
        output = state.output
        assert output is not None  # the step loop builds events only after a forward
        hidden = output.captured.hidden.get(state.event_layer)
        attention = output.captured.attention.get(state.event_layer)
        return ForwardPass(
            state.request_id, state.step, TensorShim(output.logits[None, :], readonly=True),  # (1, V)
            hidden_states=self._shim(hidden[-1:] if hidden is not None else None),  # (1, d)
            attention_patterns=self._shim(attention[:, -1:, :] if attention is not None else None),  # (h, 1, kv)
            layer=state.event_layer,
            input_ids=state.tokens,
            sae_features=self._features(newest_only=True),  # (k,)
        )

    # ------------------------------------------------------------------------ shared effects

    def accept_force(self, item: _Call, action: ForceTokens) -> list[int] | None:
        """The ForceTokens ids if this is the step's first and they are valid, else None (ignored)."""
        if self.state.force_accepted:
            self.ignored(item, "a ForceTokens was already accepted this step (one per step)", action)
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
        if not self.valid(item):
            return None
        reinject = [int(t) for t in action.tokens or []]
        wanted = max(0, int(action.n) - already_erased)
        erase = min(wanted, len(self.state.generated))
        self.state.erase(erase)
        self.applied(item, None if erase == wanted else f"erased {erase} of {wanted}: prompt tokens are kept")
        return reinject

    def commit(self, tokens: list[int], *, forced: bool, announce: bool, sample: Any = None,
               attention: Any = None) -> None:
        state = self.state
        features = self._features(newest_only=True) if sample is not None and state.stream is not None else None
        state.commit(tokens, forced=forced, sample=sample, attention=attention, sae_features=features)
        if announce:
            self.apply_added(self.dispatch(Added(state.request_id, state.step, list(tokens), forced)))

    # -------------------------------------------------------------------------------- phases

    def apply_prefilled(self, calls: list[_Call]) -> None:
        state = self.state
        for i, item in enumerate(calls):
            action = item.call.action
            if isinstance(item.call.rejected, ForceTokens):  # a raw mod's ForceTokens at Prefilled: queued
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
                    if tokens:  # the new prompt is fed by the next step's forward (Prefilled is not re-sent)
                        state.prompt_ids, state.cached, state.output = tokens, 0, None
                    self.applied(item)
                    return self.ignore_rest(calls[i + 1:], action)
                case ForceOutput() | ToolCalls() | EmitError():
                    if self.finish_terminal(item):
                        return self.ignore_rest(calls[i + 1:], action)
                case _:
                    self.ignored(item, f"{type(action).__name__} has no effect at Prefilled")

    def apply_forward_pass(self, calls: list[_Call]) -> StepPlan:
        return self.apply_step(calls, "ForwardPass", logits_allowed=True, already_erased=0)

    def apply_sampled(self, calls: list[_Call]) -> StepPlan:
        # the pending sample is erased first by a Backtrack here
        return self.apply_step(calls, "Sampled", logits_allowed=False, already_erased=1)

    def apply_step(self, calls: list[_Call], event: str, *, logits_allowed: bool, already_erased: int) -> StepPlan:
        """ForwardPass and Sampled take the same actions, except that only ForwardPass may adjust
        logits and that at Sampled a Backtrack also drops the token just sampled."""
        plan = StepPlan()
        for i, item in enumerate(calls):
            action = item.call.action
            match action:
                case Noop():
                    continue
                case AdjustedLogits() if logits_allowed:
                    self.adjust_logits(item, action, plan)
                case Steer():
                    self.steer(item, action)
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

    def adjust_logits(self, item: _Call, action: AdjustedLogits, plan: StepPlan) -> None:
        vocab = self.vocab_size
        if not self.valid(item):  # token_temp: None, 0 (greedy) or finite > 0
            return
        try:
            logits = as_torch(action.logits, device=self.device, dtype=torch.float32).reshape(-1)
        except Exception as err:  # a mod handed us something that is not a tensor
            return self.fault(item, f"AdjustedLogits.logits is not a tensor of numbers: {err}")
        if logits.shape[0] != vocab:
            return self.fault(item, f"AdjustedLogits.logits must have {vocab} entries ([1, V] or [V]), "
                                    f"got {logits.shape[0]}")
        # one device read: NaN or +inf anywhere, or nothing finite left, cannot be sampled from
        if bool(torch.isnan(logits).any() | torch.isposinf(logits).any() | torch.isneginf(logits).all()):
            return self.fault(item, "AdjustedLogits.logits must be finite numbers (-inf allowed) with at least one "
                                    "finite entry; got NaN, +inf or -inf everywhere")
        temp = action.token_temp
        base = self.state.request.sampling
        plan.logits = logits
        plan.sampling = base if temp is None else dataclasses.replace(base, temperature=float(temp))
        self.applied(item)

    def steer(self, item: _Call, action: Steer) -> None:
        """Set (or with scale 0 remove) the request's steer of one feature; every later forward of
        this request adds the summed directions at the SAE's layer."""
        if self.steering is None:
            return self.fault(item, "Steer needs the engine's SAE loaded (sae.enabled); none is")
        try:
            feature, scale = check_steer(action, num_features=self.steering.num_features)
        except InvalidActionError as err:
            return self.fault(item, str(err))
        state = self.state
        if scale == 0.0:
            state.steers.pop(feature, None)
        else:
            state.steers[feature] = scale
        state.steer_delta = self.steering.delta(state.steers) if state.steers else None
        self.steer_log.append({"step": state.step, "feature_id": feature, "scale": scale})
        self.applied(item)

    def apply_added(self, calls: list[_Call]) -> None:
        for i, item in enumerate(calls):
            action = item.call.action
            match action:
                case Noop():
                    continue
                case Steer():
                    self.steer(item, action)
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

    # --------------------------------------------------------------------------- step halves

    def begin_step(self) -> None:
        self.state.force_accepted = False
        self.state.step_committed = []

    def sampling_needed(self, plan: StepPlan) -> bool:
        state = self.state
        return state.finish is None and not plan.backtracked and not state.forced_queue

    def add_step_tokens(self, plan: StepPlan, sampled: Any = None, attention: Any = None) -> None:
        """Commit and announce this step's tokens: reinjected, forced, or the sample."""
        if plan.backtracked:
            if plan.reinject:
                self.commit(plan.reinject, forced=True, announce=True)
        elif self.state.forced_queue:
            self.commit(self.state.take_queue(), forced=True, announce=True)
        elif sampled is not None:
            self.commit([sampled.token], forced=False, announce=True, sample=sampled, attention=attention)

    def can_defer_announcements(self) -> bool:
        """No mod can act on this step's Sampled/Added and announcing needs no device read, so the
        step loop may announce them after the next forward is launched (see ``StepLoop``)."""
        state = self.state
        return not state.manager.mods and not state.request.attention_all_layers and state.sae_features is None

    def take_sample(self, sampled: Any) -> None:
        """A mod-free step's sample joins the sequence now; :meth:`announce_sample` tells of it later."""
        self.state.append([sampled.token], sampled)

    def announce_sample(self, step: int, sampled: Any) -> None:
        """Sampled, the stream's token and Added of a step whose sample :meth:`take_sample` took —
        in the order, and with the records, a dispatch with no mods gives."""
        state = self.state
        self.record(Sampled(state.request_id, step, sampled.token))
        if state.stream is not None:
            state.stream.committed([sampled.token], False, sampled, None, None)
        self.record(Added(state.request_id, step, [sampled.token], False))

    def end_step(self, max_sequence: int) -> None:
        state, request = self.state, self.state.request
        if state.finish is None:
            if any(t in request.stop_ids for t in state.step_committed):
                state.finish = FinishReason.STOP
            elif len(state.generated) >= state.max_tokens:
                state.finish = FinishReason.LENGTH
            elif state.length >= max_sequence:
                state.finish = FinishReason.LENGTH
            elif state.step + 1 >= request.step_limit:
                state.finish = FinishReason.LENGTH
        state.step += 1
