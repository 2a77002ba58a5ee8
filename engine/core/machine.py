"""One request's state machine: the phases of ``docs/generation-rules.md`` behind the small, fixed
interface the step loop calls.

::

    WAITING ─► PREFILLING (chunk 1, 2, … as the step budget allows) ─► DECODING ─► FINISHED
                 prompt all in: Prefilled ─► its actions (once)
    each decoding step:
        next_forward(n)   the tokens it has not fed yet, at most n  (None: nothing to feed)
        on_forward(row, output)   a fed row's output; chunks of one feed are joined here
        step()            ForwardPass ─► actions; the row to sample from (None: nothing samples)
        on_sample(sample) Sampled ─► actions ─► add ─► Added ─► actions ─► stop checks

The loop only admits, schedules, batches, isolates faults and retires; it reads no request field,
only :attr:`RequestMachine.finished`, :attr:`decoding`, :attr:`ready` and :attr:`pending_tokens`.

A feed split over several forwards (a long prompt under the step's token budget) is invisible
above this class: its chunks' internals are joined into the one output an unsplit forward gives
(hidden rows concatenated; attention rows of earlier chunks zero-padded on the key axis, which
causal attention never reaches), and that whole output is what Prefilled, ForwardPass and the SAE
hand-off see.

A structured request (``response_format``, an enforced ``tool_choice``) has a grammar state
(``engine/core/structured``): each sampling step hands its token mask to the sampler, every
committed token advances it and every erased one rolls it back (``RequestState.append``/``erase``),
and the step it completes ends the request (a tool choice's output becomes its tool call).

Announcing a step's sample (Sampled, the stream's token, Added) has one path. When no mod can act
on it and nothing must be read from the device for it, the machine may hold the announcements
(``overlap``) until :meth:`flush`, which the loop calls right after the next forward is launched —
on a GPU the device then works while the host announces; everything is announced in the same
order, with the same records, as in place.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine.core.actions import Call, PhaseActions, SteerSource, StepPlan
from engine.core.request import ForwardRecord, RequestState
from engine.core.result import FinishReason
from engine.model.backend import ForwardRow, RowOutput
from engine.model.capture import RowCapture
from engine.model.sampling import SampleResult, SampleRow
from engine.model.tensor import TensorShim
from mods.types import Added, ContextInfo, ForwardPass, ModEvent, Prefilled, SAEFeatures, Sampled

__all__ = ["RequestMachine", "join_chunks"]


class RequestMachine:
    """Owns one request's phases and applies its mods' actions (through :class:`PhaseActions`)."""

    def __init__(self, state: RequestState, *, vocab_size: int, device: torch.device,
                 steering: SteerSource | None = None) -> None:
        self.state = state
        self.actions = PhaseActions(state, vocab_size=vocab_size, device=device, steering=steering,
                                    commit_silently=self._commit_silently)
        self.max_sequence = 1 << 62  # set by start()
        self.overlap = False  # the device runs forwards asynchronously: announcements may wait
        self._decoding = False  # Prefilled was dispatched
        self._parts: list[tuple[ForwardRow, RowOutput]] = []  # the chunks of a feed still in progress
        self._newest: tuple[Any, np.ndarray, np.ndarray] | None = None  # the newest row's SAE top-k on the host
        self._outbox: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None
        self._mod_free = not state.manager.mods
        if state.request.grammar is not None and state.grammar is None:  # structured output: its matcher
            state.grammar = state.request.grammar.new_state()
        # the two plans a row is fed with, built once: a prompt's rows all, later feeds the newest
        self._plans = (state.plan.with_all_query_rows(False), state.plan.with_all_query_rows(True))

    @property
    def steer_log(self) -> list[dict[str, Any]]:
        return self.actions.steer_log

    def start(self, *, max_sequence: int, overlap: bool) -> None:
        """Admitted into a batch: its context limit and whether its announcements may overlap."""
        self.max_sequence, self.overlap = max_sequence, overlap

    # --------------------------------------------------------------------------- loop's view

    @property
    def finished(self) -> bool:
        return self.state.finish is not None

    @property
    def decoding(self) -> bool:
        """The prompt is in and Prefilled was dispatched (each step it feeds its newest tokens)."""
        return self._decoding

    @property
    def ready(self) -> bool:
        """This step's phases can run: decoding, not finished, and the newest feed's output is in."""
        return self._decoding and self.state.output is not None and self.state.finish is None

    @property
    def pending_tokens(self) -> int:
        """How many tokens its next forward would feed (0: none needed)."""
        state = self.state
        if state.finish is not None:
            return 0
        left = len(state.prompt_ids) + len(state.generated) - state.cached
        return left if left > 0 else (1 if state.output is None else 0)

    @property
    def request_id(self) -> str:
        return self.state.request_id

    def retire(self) -> None:
        """It left the batch: what it still held is announced, its SAE rows are handed off."""
        self.flush()
        if self.state.hidden_sink is not None:
            self.state.hidden_sink.finish(self.state.request_id)

    def cancel(self) -> None:
        if self.state.finish is None:
            self.state.finish = FinishReason.CANCELLED

    def fail(self, message: str, parameter: str | None = None) -> None:
        self.state.fail(message, parameter)

    # ------------------------------------------------------------------------------- forward

    def next_forward(self, allowance: int) -> ForwardRow | None:
        """The row to feed now: the tokens not fed yet from the cached position, at most
        ``allowance`` of them (an erased position is fed again from the last kept token)."""
        state = self.state
        if state.finish is not None or allowance <= 0:
            return None
        prompt_len = len(state.prompt_ids)
        if state.cached >= prompt_len + len(state.generated):
            if state.output is not None:
                return None
            state.cached = max(0, prompt_len + len(state.generated) - 1)
        start = state.cached
        end = start + allowance
        if start >= prompt_len:
            tokens = state.generated[start - prompt_len:end - prompt_len]
        else:
            tokens = state.prompt_ids[start:end]
            if end > prompt_len:
                tokens = tokens + state.generated[:end - prompt_len]
        steer = state.steer_delta
        layer = self.actions.steering.layer if steer is not None and self.actions.steering is not None else None
        return ForwardRow(state.request_id, start, tuple(tokens), self._plans[not self._decoding], steer, layer)

    def reuse_prefix(self, length: int, captured: RowCapture) -> None:
        """The prompt's first ``length`` positions came from the prefix cache with the internals
        their forward captured: they join the feed as a chunk already done (before any forward)."""
        state = self.state
        row = ForwardRow(state.request_id, 0, tuple(state.prompt_ids[:length]), self._plans[True])
        self._parts.append((row, RowOutput(None, captured, None)))
        state.cached = length

    def on_forward(self, row: ForwardRow, output: RowOutput, forward_ms: float) -> bool:
        """Take a fed row's output; False while the feed it belongs to is still incomplete. The
        last chunk completes it: the joined output becomes the newest forward, its hidden rows go
        to the SAE hand-off, and a prompt's completion dispatches Prefilled."""
        state = self.state
        state.cached = row.start + len(row.tokens)
        if not self._decoding:
            state.prefill_ms += forward_ms
        if state.cached < len(state.prompt_ids) + len(state.generated):
            self._parts.append((row, output))
            state.output = None  # no step runs on an older forward while this feed is incomplete
            return False
        if self._parts:
            self._parts.append((row, output))
            row, output = join_chunks(self._parts)
            self._parts = []
        state.output = output
        self._report_forward(row)
        if not self._decoding:
            self._decoding = True
            self.actions.apply_prefilled_actions(self._dispatch(self._prefilled_event()))
        return True

    def _report_forward(self, row: ForwardRow) -> None:
        """Hand the newest forward's hidden states to the SAE sink (nearline: no waiting)."""
        state = self.state
        state.sae_features = None
        if state.hidden_sink is not None and state.output is not None and state.output.captured.hidden:
            state.sae_features = state.hidden_sink.on_forward(
                state.request_id, state.step, ForwardRecord(row.start, row.tokens, state.output.captured.hidden))

    # ------------------------------------------------------------------------------ the step

    def step(self) -> SampleRow | None:
        """ForwardPass and its actions. Returns the row to sample when this step samples; else the
        step is already over (forced or reinjected tokens added, or the request ended)."""
        state = self.state
        state.force_accepted = False
        state.step_committed = []
        plan = self.actions.apply_forward_pass_actions(self._dispatch(self._forward_event()))
        if state.finish is not None:
            return None
        if not plan.backtracked and not state.forced_queue:
            return self._sample_row(plan)
        self._add_step_tokens(plan, None)
        self._end_step()
        return None

    def _sample_row(self, plan: StepPlan) -> SampleRow:
        """What this step samples from: the (possibly adjusted) logits, the sampling values, and
        what changes per step — stop tokens held back before ``min_tokens``, the grammar's mask
        (which holds back its end token instead, unless the end is all it allows)."""
        state, request = self.state, self.state.request
        params = plan.sampling or request.sampling
        early = len(state.generated) < request.min_tokens
        grammar = state.grammar
        mask = grammar.mask(hold_end=early) if grammar is not None and grammar.attached else None
        suppress = tuple(request.stop_ids) if early and mask is None else ()
        logits = plan.logits if plan.logits is not None else state.output.logits  # type: ignore[union-attr]
        vocab, device = logits.shape[-1], logits.device
        return SampleRow(logits, params, state.generator,
                         state.penalty_counts("history", vocab, device) if params.needs_history else None,
                         request.logprobs,
                         state.penalty_counts("generated", vocab, device) if params.needs_generated else None,
                         suppress, mask)

    def on_sample(self, sample: SampleResult | None) -> bool:
        """Sampled and its actions, the step's tokens added and announced, stop checks. ``None``:
        sampling failed (the loop failed the request). True when the announcements are held
        for :meth:`flush`."""
        state = self.state
        if sample is None or state.finish is not None:
            self._end_step()
            return False
        hold = self.overlap and self._mod_free and not state.request.attention_all_layers \
            and state.sae_features is None
        if hold:
            self._outbox = []
        plan = self.actions.apply_sampled_actions(self._dispatch(Sampled(state.request_id, state.step,
                                                                         sample.token)))
        if state.finish is None:
            self._add_step_tokens(plan, sample)
        self._end_step()
        if hold and state.finish is not None:  # it leaves the batch now: nothing to overlap
            self.flush()
            return False
        return hold

    def flush(self) -> int:
        """Announce what :meth:`on_sample` held, in order; how many announcements went out."""
        outbox, self._outbox = self._outbox, None
        if not outbox:
            return 0
        for fn, args in outbox:
            fn(*args)
        return len(outbox)

    def _add_step_tokens(self, plan: StepPlan, sample: SampleResult | None) -> None:
        """Commit and announce this step's tokens: reinjected, forced, or the sample."""
        state = self.state
        if plan.backtracked:
            if plan.reinject:
                self._commit(plan.reinject, forced=True)
        elif state.forced_queue:
            self._commit(state.take_queue(), forced=True)
        elif sample is not None:
            self._commit([sample.token], forced=False, sample=sample)

    def _commit(self, tokens: list[int], *, forced: bool, sample: SampleResult | None = None) -> None:
        """The step's tokens join the sequence, reach the stream, and Added is dispatched."""
        state = self.state
        features = attention = None
        if sample is not None and state.stream is not None:
            features = self._features(newest_only=True)
            if state.request.attention_all_layers:
                attention = _attention_rows(state.output)  # type: ignore[arg-type]
        tokens = list(state.append(tokens, sample))
        if tokens:
            self._announce(state.stream.committed if state.stream is not None else None,
                           (tokens, forced, sample, attention, features))
        if state.finish is not None:  # a sample the grammar refused: the request ended
            return
        self.actions.apply_added_actions(self._dispatch(Added(state.request_id, state.step, list(tokens), forced)))

    def _commit_silently(self, tokens: list[int]) -> None:
        """Forced tokens with no Added of their own (Added-phase ForceTokens, Backtrack's tokens)."""
        self.state.commit(tokens, forced=True)

    def _end_step(self) -> None:
        state, request = self.state, self.state.request
        if state.finish is None:
            if state.grammar is not None and state.grammar.ended:
                self._finish_structured()
            elif state.step_committed and any(t in request.stop_ids for t in state.step_committed):
                state.finish = FinishReason.STOP
            elif len(state.generated) >= state.max_tokens:
                state.finish = FinishReason.LENGTH
            elif len(state.prompt_ids) + len(state.generated) >= self.max_sequence:
                state.finish = FinishReason.LENGTH
            elif state.step + 1 >= request.step_limit:
                state.finish = FinishReason.LENGTH
        state.step += 1

    def _finish_structured(self) -> None:
        """The grammar took its end token: the output is complete. An enforced tool choice's
        output becomes the request's tool call, as a mod's ToolCalls would report it."""
        state = self.state
        if state.grammar.spec.is_tool_call:
            state.tool_calls, state.finish = [state.grammar.tool_call(state.generated)], FinishReason.TOOL_CALLS
        else:
            state.finish = FinishReason.STOP

    # -------------------------------------------------------------------------------- events

    def _announce(self, fn: Callable[..., Any] | None, args: tuple[Any, ...]) -> None:
        if fn is None:
            return
        if self._outbox is not None:
            self._outbox.append((fn, args))
        else:
            fn(*args)

    def _record(self, event: ModEvent) -> int:
        """The event joins the request's events and payload (no mod sees it); its payload index."""
        state = self.state
        state.events.append(event)
        if state.on_event is not None:
            state.on_event(event)
        top = state.output.top if isinstance(event, ForwardPass) and state.output is not None else None
        return state.payload.event(event, top)

    def _dispatch(self, event: ModEvent) -> list[Call]:
        state = self.state
        if self._mod_free:  # no mod to call: the event is only recorded (held, when announcements are)
            self._announce(self._record, (event,))
            return []
        index = self._record(event)
        calls = state.manager.dispatch_traced(event)
        items = [Call(c, i) for c, i in zip(calls, state.payload.calls(index, calls))]
        return items if self.actions.check_fatal_calls(items) else []

    def _features(self, newest_only: bool) -> SAEFeatures | None:
        """The inline SAE encoding of the newest forward, as the SDK's numpy object."""
        encoded = self.state.sae_features
        if encoded is None:
            return None
        if not newest_only:
            return SAEFeatures(encoded.indices.cpu().numpy(), encoded.values.float().cpu().numpy(), encoded.release,
                               encoded.layer)
        # ForwardPass and the stream both want the newest row: one host copy per forward, and each
        # reader gets arrays of its own (a mod may write into what it is handed)
        if self._newest is None or self._newest[0] is not encoded:
            self._newest = (encoded, encoded.indices[-1].cpu().numpy(), encoded.values[-1].float().cpu().numpy())
        _, indices, values = self._newest
        return SAEFeatures(indices.copy(), values.copy(), encoded.release, encoded.layer)

    def _prefilled_event(self) -> Prefilled:
        state = self.state
        captured = state.output.captured  # type: ignore[union-attr]
        layer = state.event_layer
        ids = list(state.prompt_ids)
        return Prefilled(
            state.request_id, 0, state.max_tokens, ContextInfo(state.request_id, ids, state.max_tokens),
            hidden_states=_shim(captured.hidden.get(layer)),  # (prompt_len, d)
            attention_patterns=_shim(captured.attention.get(layer)),  # (h, prompt_len, prompt_len)
            layer=layer,
            input_ids=ids,
            sae_features=self._features(newest_only=False),  # (prompt_len, k)
        )

    def _forward_event(self) -> ForwardPass:
        state = self.state
        output = state.output
        assert output is not None  # built only when the step is ready
        hidden = output.captured.hidden.get(state.event_layer)
        attention = output.captured.attention.get(state.event_layer)
        return ForwardPass(
            state.request_id, state.step, TensorShim(output.logits[None, :], readonly=True),  # (1, V)
            hidden_states=_shim(hidden[-1:] if hidden is not None else None),  # (1, d)
            attention_patterns=_shim(attention[:, -1:, :] if attention is not None else None),  # (h, 1, kv)
            layer=state.event_layer,
            input_ids=state.tokens,
            sae_features=self._features(newest_only=True),  # (k,)
        )


def join_chunks(parts: Sequence[tuple[ForwardRow, RowOutput]]) -> tuple[ForwardRow, RowOutput]:
    """The row and output one forward of every chunk's tokens would have given: logits and top
    log-probs of the last chunk; hidden ``(q_total, d)`` concatenated; attention, when every query
    row was asked for, ``(heads, q_total, kv)`` with each earlier chunk's ``(heads, q_i, kv_i)``
    zero-padded to the last chunk's ``kv`` (causal: the keys after a chunk get no weight from it),
    else the last chunk's newest row."""
    first, (last_row, last_out) = parts[0][0], parts[-1]
    hidden = {layer: torch.cat([out.captured.hidden[layer] for _, out in parts])
              for layer in last_out.captured.hidden}
    attention = dict(last_out.captured.attention)
    if last_row.plan.all_query_rows:
        for layer, newest in last_out.captured.attention.items():
            kv = newest.shape[-1]
            attention[layer] = torch.cat([torch.nn.functional.pad(out.captured.attention[layer],
                                                                  (0, kv - out.captured.attention[layer].shape[-1]))
                                          for _, out in parts], dim=1)
    tokens = tuple(t for row, _ in parts for t in row.tokens)
    row = ForwardRow(first.request_id, first.start, tokens, last_row.plan, last_row.steer, last_row.steer_layer)
    return row, RowOutput(last_out.logits, RowCapture(hidden, attention), last_out.top)


def _shim(tensor: torch.Tensor | None) -> TensorShim | None:
    return TensorShim(tensor, readonly=True) if tensor is not None else None


def _attention_rows(output: RowOutput) -> np.ndarray:
    """``(layers, heads, context)`` float32 host copy of the newest attention row of every layer."""
    attention = output.captured.attention
    rows = [attention[layer][:, -1, :] for layer in sorted(attention)]
    return torch.stack(rows).float().cpu().numpy()
