"""One request's state machine: the phases of ``docs/generation-rules.md`` behind the small, fixed
interface the step loop calls.

::

    WAITING ─► PREFILLING (chunk 1, 2, … as the step budget allows) ─► DECODING ─► FINISHED
                 prompt all in: Prefilled ─► its actions (once)
    each decoding step:
        next_forward(n)   the tokens it has not fed yet, at most n  (None: nothing to feed)
        on_forward(row, output)   a fed row's output; chunks of one feed are joined here
        forward_calls()   ForwardPass; the calls its mods get (made by the loop, one round for all)
        after_forward()   their actions; the row to sample from (None: nothing samples)
        on_sample(sample) Sampled ─► actions ─► add ─► Added ─► actions ─► stop checks

The loop only admits, schedules, batches, isolates faults and retires; it reads no request field,
only :attr:`RequestMachine.finished`, :attr:`decoding`, :attr:`ready`, :attr:`prefilled_due`,
:attr:`adds_without_sample` and :attr:`pending_tokens`.

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

from engine.core.chunks import join_chunks
from engine.core.loop_calls import LoopCalls
from engine.core.events import (all_features, attention_rows, features_of, forward_event, newest_row, prefilled_event,
                                released_logits)
from engine.core.phases import Phase
from engine.core.actions import Call, PhaseActions, SteerSource, StepPlan
from engine.core.request import ForwardRecord, RequestState, RequestStatus
from engine.core.result import FinishReason
from engine.model.backend import ForwardRow, RowOutput
from engine.model.capture import RowCapture
from engine.model.tensor import released
from engine.model.sampling import SampleResult, SampleRow
from mods.event_guard import forget_decisions
from mods.manager import ModCall, ModManager, PendingCall
from mods.token_ids import TokenIds
from mods.types import Added, ForwardPass, ModEvent, Prefilled, SAEFeatures, Sampled

__all__ = ["RequestMachine", "Unsettled"]


class RequestMachine:
    """Owns one request's phases and applies its mods' actions (through :class:`PhaseActions`)."""

    def __init__(self, state: RequestState, *, vocab_size: int, device: torch.device,
                 steering: SteerSource | None = None) -> None:
        self.state = state
        self.actions = PhaseActions(state, vocab_size=vocab_size, device=device, steering=steering)
        self.max_sequence = 1 << 62  # set by start()
        self.overlap = False  # the device runs forwards asynchronously: announcements may wait
        self._parts: list[tuple[ForwardRow, RowOutput]] = []  # the chunks of a feed still in progress
        self._newest: tuple[Any, np.ndarray, np.ndarray] | None = None  # the newest row's SAE top-k on the host
        self._outbox: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None
        self._mod_free = not state.manager.mods
        if state.request.grammar is not None and state.grammar is None:  # structured output: its matcher
            state.grammar = state.request.grammar.new_state()
        # the two plans a row is fed with, built once: a prompt's rows all, later feeds the newest
        self._plans = (state.plan.with_all_query_rows(False), state.plan.with_all_query_rows(True))
        self._reads_logits = not self._mod_free  # its mods may read ForwardPass.logits
        self._keep_logits = state.request.keep_logits  # its result's ForwardPass events keep them
        sampling = state.request.sampling
        # its draw is the row's argmax, unless a mod hands back logits — SampleRow.plain of its rows,
        # but for the stop tokens min_tokens holds back, which change per step (forward_row and
        # _in_place check those); and no result keeps its logits
        self._plain_greedy = (sampling.greedy and sampling.plain and state.request.grammar is None
                              and state.request.logprobs < 0 and not self._keep_logits)
        # its forwards compute the top log-probs only when its payload lists them: a log-softmax and
        # a top-k over the vocabulary, which nothing else in a step needs (a greedy draw reads the
        # row's argmax)
        self._wants_top = state.request.payload_top_tokens
        # no mod and no listener: nothing sees its step events as they happen, so each step is a
        # compact trace entry (fast_step / fast_sample) and its events are made after it finished
        self.fast = self._mod_free and state.on_event is None
        self._trace: list[tuple[Any, ...]] = []
        # a request with mods: its Sampled/Added events that nothing heard as they happened, made
        # when it ends (materialize): (their place among its events, class, *its fields after request_id)
        self._later: list[tuple[Any, ...]] = []
        self._host: Any = None  # the newest forward's HostLogits, when its mods may read logits
        self._host_row = -1  # this request's row in it
        self._read_logits = False  # its mods read the last forward's logits: copy the next ahead
        # how many steps in a row its mod has handed back logits of its own, and how many its runner
        # waits for before it defers the argmax (forward_row); doubled each time a deferral cost a
        # recomputation, so a mod that hands rows back only now and then costs few of them
        self._handed_back = 0
        self._defer_after = 1
        self._calls: LoopCalls | None = None  # the loop's runner (start): the loop drives its Prefilled
        self._forward_index = -1  # the payload index of the step's ForwardPass (forward_calls)
        self._unsampled: StepPlan | None = None  # a step that adds tokens without a sample (after_forward)
        self.prefilled_due = False  # its prompt is in; the loop dispatches Prefilled with the step's others

    @property
    def steer_log(self) -> list[dict[str, Any]]:
        return self.actions.steer_log

    def start(self, *, max_sequence: int, overlap: bool = False, calls: LoopCalls | None = None) -> None:
        """Admitted into a batch: its context limit, whether its announcements may overlap, and
        the loop's runner of mod calls (given: the loop drives its Prefilled, :meth:`prefilled`)."""
        self.max_sequence, self.overlap, self._calls = max_sequence, overlap, calls
        if self.state.status is RequestStatus.WAITING:
            self.state.status = RequestStatus.PREFILLING

    # --------------------------------------------------------------------------- loop's view

    @property
    def finished(self) -> bool:
        return self.state.finish is not None

    @property
    def decoding(self) -> bool:
        """The prompt is in (each step it feeds its newest tokens; its Prefilled goes out before the
        step's ForwardPass, :attr:`prefilled_due`)."""
        return self.state.status is RequestStatus.DECODING

    @property
    def ready(self) -> bool:
        """This step's phases can run: decoding, not finished, the newest feed's output is in, and
        its Prefilled was dispatched."""
        state = self.state
        return state.status is RequestStatus.DECODING and state.output is not None and not self.prefilled_due

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
            self.state.finish_with(FinishReason.CANCELLED)

    def fail(self, message: str, parameter: str | None = None) -> None:
        self.state.fail(message, parameter)

    # ------------------------------------------------------------------------------- forward

    def reservation(self, max_sequence: int) -> tuple[int, int]:
        """KV positions to reserve at admission: all it may use (``prompt + max_tokens``, within
        ``max_sequence``), and the least it can start with (its prompt and one more)."""
        state = self.state
        return min(len(state.prompt_ids) + state.max_tokens, max_sequence), len(state.prompt_ids) + 1

    def prefix_lookup(self) -> tuple[list[int], Any] | None:
        """``(prompt, plan)`` to look a cached prefix up with, before its first feed — None when
        its ``prefix_cache`` flag is off, it already ended, or a steer changes its keys/values."""
        state = self.state
        if state.finish is not None or state.steer_delta is not None or not state.request.prefix_cache:
            return None
        return state.prompt_ids, self._plans[True]

    def next_feed(self, allowance: int) -> tuple[int, list[int]] | None:
        """``(start, tokens)`` to feed now: the tokens not fed yet from the cached position, at
        most ``allowance`` of them (an erased position is fed again from the last kept token)."""
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
        return start, tokens

    def forward_row(self, start: int, tokens: Sequence[int], table: Sequence[int]) -> ForwardRow:
        """The runner's row for a feed :meth:`next_feed` gave, over the request's block table."""
        state = self.state
        steer = state.steer_delta
        layer = self.actions.steering.layer if steer is not None and self.actions.steering is not None else None
        prefill = state.status is not RequestStatus.DECODING
        # its draw is the row's argmax, found by the runner with the forward: nothing changes the row
        # before the draw, or its one mod may only hand back logits of its own (the row is then lent
        # to it in place, _in_place, and drawn from as it was before the mod could write into it)
        argmax = ((self._mod_free and self._plain_greedy and len(state.generated) >= state.request.min_tokens)
                  or self._in_place())
        # a mod that handed back logits of its own last step likely does again, and then the argmax
        # found before it is never read: the runner may leave it to be found only if it is
        # (RowOutput.deferred_argmax; with top log-probs it is read off them, nearly free)
        defer = (argmax and self._handed_back >= self._defer_after and not self._mod_free
                 and not self._wants_top)
        return ForwardRow(state.request_id, start, tuple(tokens), self._plans[prefill], steer, layer, table,
                          self._wants_top, argmax, defer_argmax=defer)

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
        if state.status is not RequestStatus.DECODING:
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
        if self._reads_logits:
            last, source = self._host, output.source
            self._read_logits = last is not None and last.was_lent(self._host_row)
            # one host copy of the step's logits for every mod; its row lent in place when the
            # runner found its argmax (for a request with mods, asked only when _in_place held):
            # the draw, unless the mod hands back logits of its own
            self._host = output.host_logits(output.argmax is not None or output.argmax_deferred)
            self._host_row = source[1] if source is not None else -1
        self._report_forward(row)
        if state.status in (RequestStatus.WAITING, RequestStatus.PREFILLING):
            state.status = RequestStatus.DECODING
            if self._mod_free or self._calls is None:
                self.actions.apply_prefilled_actions(self._dispatch_now(self._prefilled_event()))
            else:  # the loop dispatches it with every other request's whose prompt came in this step
                self.prefilled_due = True
        return True

    def _in_place(self) -> bool:
        """Whether nothing reads this step's row of the logits after its mods but the draw (its
        argmax, which the runner finds with the forward, or later in the logits recomputed when its
        mod handed a row back the step before), so that the mods may be lent the row itself
        (:meth:`HostLogits.share`): one mod
        (the only reader: no listener, a result that does not keep logits), and a draw that is
        the row's argmax unless a mod returns logits of its own — greedy, nothing applied before
        it (no penalty, bias, ban or grammar, no stop token held back before ``min_tokens``), no
        log-probs asked for."""
        state = self.state
        return (self._plain_greedy and len(state.manager.mods) == 1
                and state.on_event is None and len(state.generated) >= state.request.min_tokens)

    def prefilled(self) -> Phase[None]:
        """Prefilled and its actions, once its prompt is in (:attr:`prefilled_due`); the loop runs
        the phases of every request whose prompt came in with one hand-off a round (:func:`drive`),
        not one per request, before the step's ForwardPass."""
        self.prefilled_due = False
        self.actions.apply_prefilled_actions((yield from self._dispatch(self._prefilled_event())))

    def _report_forward(self, row: ForwardRow) -> None:
        """Hand the newest forward's hidden states to the SAE sink (nearline: no waiting)."""
        state = self.state
        state.sae_features = None
        if state.hidden_sink is not None and state.output is not None and state.output.captured.hidden:
            state.sae_features = state.hidden_sink.on_forward(
                state.request_id, state.step, ForwardRecord(row.start, row.tokens, state.output.captured.hidden))

    # ------------------------------------------------------------------------------ the step

    def forward_calls(self) -> list[PendingCall]:
        """The step's start: its ForwardPass made and recorded; the calls its mods are to get for it
        (none: :meth:`after_forward` goes on at once). The loop makes every request's calls in one
        round and hands each machine its own back. No phase (a generator) runs for this: a phase
        cost a request two generators and a driver's turn a step, 0.3-0.6 ms a step at 64
        concurrent requests with a logits mod."""
        state = self.state
        state.force_accepted = False
        state.step_committed = []
        if self._read_logits and self._host is not None:
            # its mods read the logits last step: start the copy of the step's rows for mods now
            # (every row is in by now), to run while the step's events are built
            self._host.copy_ahead()
        self._forward_index, pending = self._recorded_calls(self._forward_event())
        return pending

    def after_forward(self, made: Sequence[PendingCall]) -> SampleRow | Unsettled | None:
        """ForwardPass's actions, from ``made`` (:meth:`forward_calls`' calls, made). Returns the
        row to sample when this step samples (or, when that row's logits are a mod's still to be
        checked, :class:`Unsettled`, for :meth:`settle` just before the draw); else None: the
        request ended, or the step adds forced or reinjected tokens instead
        (:attr:`adds_without_sample`, then :meth:`add_without_sample`)."""
        state = self.state
        calls = state.manager.records(made, keep_silent=False) if made else []
        plan = self.actions.apply_forward_pass_actions(self._items(self._forward_index, calls))
        self._handed_back = self._handed_back + 1 if plan.logits is not None else 0
        if state.finish is not None:
            return None
        if plan.unchecked is not None:  # the row a mod handed back is checked just before the draw
            return Unsettled(plan)
        if not plan.backtracked and not state.forced_queue:
            return self._sample_row(plan)
        self._unsampled = plan
        return None

    @property
    def adds_without_sample(self) -> bool:
        """This step samples nothing: it adds tokens its mods forced or reinjected
        (:meth:`add_without_sample`)."""
        return self._unsampled is not None

    def add_without_sample(self) -> Phase[None]:
        """The step's forced or reinjected tokens added (Added dispatched), and the step ended."""
        plan, self._unsampled = self._unsampled, None
        assert plan is not None  # internal invariant: called only when adds_without_sample
        yield from self._add_step_tokens(plan, None)
        self._end_step()

    def settle(self, unsettled: Unsettled) -> SampleRow | None:
        """The row to draw from for a step :meth:`after_forward` left :class:`Unsettled`: its mod's
        logits checked now (the step's first such check searches every row handed back in one
        pass); None when they are unusable (the request ended, as it would have in the phase)."""
        plan = unsettled.plan
        return self._sample_row(plan) if self.actions.settle(plan) else None

    def fast_step(self, now: float) -> SampleRow:
        """:meth:`forward_calls` and :meth:`after_forward` of a request nobody watches step by step
        (:attr:`fast`): no mod can act, so the step samples; the ForwardPass is a trace entry (made
        an event by :meth:`materialize`)."""
        state = self.state
        state.step_committed = []
        output = state.output
        # the step's whole batch of logits stays alive only if the result keeps them
        kept = output if self._keep_logits else (output.captured, self._top_of(output))  # type: ignore[union-attr]
        self._trace.append((ForwardPass, state.step, now, kept, len(state.prompt_ids) + len(state.generated),
                            state.sae_features))
        return self._sample_row(_NO_ACTIONS)

    def fast_sample(self, sample: SampleResult | None, now: float) -> bool:
        """:meth:`on_sample` of a request nobody watches step by step: the token joins, reaches
        the stream (held for :meth:`flush` when announcements overlap), the stop checks run;
        Sampled and Added are trace entries."""
        state = self.state
        if sample is None or state.finish is not None:
            self._end_step()
            return False
        hold = self.overlap and not state.request.attention_all_layers and state.sae_features is None
        if hold:
            self._outbox = []
        self._trace.append((Sampled, state.step, now, sample.token))
        tokens = self._join([sample.token], False, sample)
        if tokens and state.finish is None:
            self._trace.append((Added, state.step, now, tokens, False))
        self._end_step()
        if hold and state.finish is not None:  # it leaves the batch now: nothing to overlap
            self.flush()
            return False
        return hold

    def materialize(self) -> None:
        """Make the trace of the fast path the events and payload records the mod path makes as
        it goes, in the same order and with the same times (after the request left the batch,
        off the loop's thread; its tokens only grew, so each ForwardPass's input ids are a
        prefix of the final sequence). The payload records are made when the payload is built
        (:meth:`~engine.services.ingest_payload.PayloadBuilder.event_later`), which, with no
        ingest URL, is only if the result's payload is read."""
        if self._later:
            self._make_later_events()
        state, trace = self.state, self._trace
        if not trace:
            return
        self._trace = []
        tokens = state.tokens  # every event views a prefix of this one list (TokenIds)
        later = []
        for entry in trace:
            kind = entry[0]
            top = None
            if kind is ForwardPass:
                _, step, at, output, length, encoded = entry
                if isinstance(output, tuple):  # its logits were not kept: the row's internals and top log-probs
                    output, top = output
                    logits = released((1, self.actions.vocab_size), step)
                else:
                    top, logits = self._top_of(output), None
                event: ModEvent = self._forward_event_of(output, step, TokenIds(tokens, length), encoded,
                                                         logits=logits)
            elif kind is Sampled:
                _, step, at, token = entry
                event = Sampled(state.request_id, step, token)
            else:
                _, step, at, added, forced = entry
                event = Added(state.request_id, step, added, forced)
            state.events.append(event)
            later.append((event, top, at))
        state.payload.event_later(later)

    def _make_later_events(self) -> None:
        """Put the events :meth:`_unheard` left unmade in their places among the request's events
        (their payload records were made in order as they happened)."""
        state, later = self.state, self._later
        self._later = []
        events: list[ModEvent] = []
        live = iter(state.events)
        for place, kind, *fields in later:
            events.extend(next(live) for _ in range(place - len(events)))
            events.append(kind(state.request_id, *fields))
        events.extend(live)
        state.events[:] = events

    def _unheard(self, kind: type[ModEvent] | tuple[type[ModEvent], ...]) -> bool:
        """Nothing hears this request's ``kind`` events (or those of each class of it) as they
        happen: no listener, and every mod's guard turns them away
        (:meth:`ModManager.turns_away_all`). Such an event is recorded from its facts and made
        when the request ends (:meth:`_record_later`): the loop's thread skips making it and
        asking each mod about it."""
        state = self.state
        return state.on_event is None and state.manager.turns_away_all(kind)

    def _record_later(self, kind: type[ModEvent], *fields: Any) -> None:
        """An unheard event of this step, ``Sampled`` (``fields``: its token) or ``Added`` (its
        tokens, forced): its payload record now, in order; the event itself when the request ends."""
        state = self.state
        place = len(state.events) + len(self._later)
        if kind is Sampled:
            state.payload.sampled(state.step, *fields)
        else:
            tokens, forced = fields
            fields = (list(tokens), forced)  # its own list: the stream was handed the step's
            state.payload.added(state.step, *fields)
        self._later.append((place, kind, state.step, *fields))  # one flat tuple (each kept one the collector walks)

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
        output = state.output
        source = output.source if plan.logits is None else None  # type: ignore[union-attr]
        logits = None if source is not None else plan.logits if plan.logits is not None else output.logits  # type: ignore[union-attr]
        argmax = plan.argmax
        if argmax is None and source is not None:  # found with the forward when the row asked,
            argmax = output.argmax  # type: ignore[union-attr]  # before any mod could write into the row
            # left to be found, and the mod that may have written into the row did not hand it back
            if argmax is None and self._host is not None and self._host.was_lent(self._host_row) \
                    and output.argmax_deferred:  # type: ignore[union-attr]
                argmax = output.deferred_argmax()  # type: ignore[union-attr]
                self._defer_after = min(2 * self._defer_after, _MOST_DEFER_AFTER)
        if not (params.needs_history or params.needs_generated):
            return SampleRow(logits, params, state.generator, None, request.logprobs, None, suppress, mask, source,
                             output.batch_top if source is not None else None, argmax)  # type: ignore[union-attr]
        vocab, device = self.actions.vocab_size, self.actions.device
        return SampleRow(logits, params, state.generator,
                         state.penalty_counts("history", vocab, device) if params.needs_history else None,
                         request.logprobs,
                         state.penalty_counts("generated", vocab, device) if params.needs_generated else None,
                         suppress, mask, source, output.batch_top if source is not None else None,  # type: ignore[union-attr]
                         argmax)

    def on_sample(self, sample: SampleResult | None) -> Phase[bool]:
        """Sampled and its actions, the step's tokens added and announced, stop checks. ``None``:
        sampling failed (the loop failed the request). Returns True when the announcements are
        held for :meth:`flush`. A phase: it yields each event its mods must see and is sent their
        calls (:func:`~engine.core.phases.drive`)."""
        state = self.state
        if sample is None or state.finish is not None:
            self._end_step()
            return False
        hold = self._hold_announcements()
        if self._unheard(Sampled):
            self._record_later(Sampled, sample.token)
            plan = _NO_ACTIONS
        else:
            plan = self.actions.apply_sampled_actions(
                (yield from self._dispatch(Sampled(state.request_id, state.step, sample.token))))
        if state.finish is None:
            yield from self._add_step_tokens(plan, sample)
        return self._end_sampled_step(hold)

    def on_sample_now(self, sample: SampleResult) -> bool | None:
        """:meth:`on_sample` on this thread, with no phase to drive, when nothing hears this step's
        Sampled or Added (no listener, every mod's guard turns them away: the usual logits mod):
        the token joins and is announced, both events are recorded from their facts, the stop
        checks run; what :meth:`on_sample` returns (for a request that has already ended, its step
        closed: False). None, having done nothing, when something hears one of them (or tokens are
        queued): :meth:`on_sample` must be driven. (A phase costs a request two or three generators
        and a driver's turn a step: 0.24 ms a step at 64 concurrent requests with a logits mod.)"""
        state = self.state
        if state.finish is not None:
            self._end_step()
            return False
        if state.forced_queue or not self._unheard(_SAMPLED_ADDED):
            return None
        hold = self._hold_announcements()
        self._record_later(Sampled, sample.token)
        tokens = self._join([sample.token], False, sample)
        if state.finish is None:  # (a sample the grammar refused ended the request)
            self._record_later(Added, tokens, False)
        return self._end_sampled_step(hold)

    def _hold_announcements(self) -> bool:
        """Whether this step's announcements wait for :meth:`flush` (their outbox opened)."""
        state = self.state
        hold = self.overlap and self._mod_free and not state.request.attention_all_layers \
            and state.sae_features is None
        if hold:
            self._outbox = []
        return hold

    def _end_sampled_step(self, hold: bool) -> bool:
        self._end_step()
        if hold and self.state.finish is not None:  # it leaves the batch now: nothing to overlap
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

    def _add_step_tokens(self, plan: StepPlan, sample: SampleResult | None) -> Phase[None]:
        """Commit and announce this step's tokens: reinjected, forced, or the sample."""
        state = self.state
        if plan.backtracked:
            if plan.reinject:
                yield from self._commit(plan.reinject, forced=True)
        elif state.forced_queue:
            yield from self._commit(state.take_queue(), forced=True)
        elif sample is not None:
            yield from self._commit([sample.token], forced=False, sample=sample)

    def _commit(self, tokens: list[int], *, forced: bool, sample: SampleResult | None = None) -> Phase[None]:
        """The step's tokens join the sequence, reach the stream, and Added is dispatched."""
        state = self.state
        tokens = self._join(tokens, forced, sample)
        if state.finish is not None:  # a sample the grammar refused: the request ended
            return
        if self._unheard(Added):
            self._record_later(Added, tokens, forced)
            return
        self.actions.apply_added_actions(
            (yield from self._dispatch(Added(state.request_id, state.step, list(tokens), forced))))

    def _join(self, tokens: list[int], forced: bool, sample: SampleResult | None) -> list[int]:
        """The tokens join the sequence and reach the stream; those that joined."""
        state = self.state
        features = attention = None
        if sample is not None and state.stream is not None:
            features = self._features(newest_only=True)
            if state.request.attention_all_layers:
                attention = attention_rows(state.output)  # type: ignore[arg-type]
        tokens = list(state.append(tokens, sample))
        if tokens and state.stream is not None:
            self._announce(state.stream.committed, (tokens, forced, sample, attention, features))
        return tokens

    def _end_step(self) -> None:
        state, request = self.state, self.state.request
        if state.finish is None:
            if state.grammar is not None and state.grammar.ended:
                self._finish_structured()
            elif state.step_committed and any(t in request.stop_ids for t in state.step_committed):
                state.finish_with(FinishReason.STOP)
            elif len(state.generated) >= state.max_tokens:
                state.finish_with(FinishReason.LENGTH)
            elif len(state.prompt_ids) + len(state.generated) >= self.max_sequence:
                state.finish_with(FinishReason.LENGTH)
            elif state.step + 1 >= request.step_limit:
                state.finish_with(FinishReason.LENGTH)
        state.step += 1

    def _finish_structured(self) -> None:
        """The grammar took its end token: the output is complete. An enforced tool choice's
        output becomes the request's tool call, as a mod's ToolCalls would report it."""
        state, grammar = self.state, self.state.grammar
        assert grammar is not None  # internal invariant: called only when the request's grammar ended
        if grammar.spec.is_tool_call:
            state.finish_with(FinishReason.TOOL_CALLS, tool_calls=[grammar.tool_call(state.generated)])
        else:
            state.finish_with(FinishReason.STOP)

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
        forward = isinstance(event, ForwardPass)
        state.events.append(event if self._keep_logits or not forward
                            else released_logits(event, shape=(1, self.actions.vocab_size)))
        if state.on_event is not None:
            try:
                state.on_event(event)
            finally:
                forget_decisions()  # a listener's code may rebind what mods' guards read (raising or not)
        top = self._top_of(state.output) if forward and state.output is not None else None
        return state.payload.event(event, top)

    def _top_of(self, output: Any) -> tuple[Any, Any, int] | None:
        """What the payload keeps of a forward's top log-probs: none unless it records them (a
        batch may hold other rows' top log-probs, and this row's slot in them is then arbitrary)."""
        return output.top_source if self._wants_top else None

    def _recorded_calls(self, event: ModEvent) -> tuple[int, list[PendingCall]]:
        """The event recorded: its payload index and the calls its mods are to get (none when every
        mod's guard turns it away). A mod-free request's event is only recorded (held, when
        announcements are): index -1, no calls."""
        if self._mod_free:
            self._announce(self._record, (event,))
            return -1, []
        return self._record(event), self.state.manager.calls_for(event)

    def _dispatch(self, event: ModEvent) -> Phase[list[Call]]:
        """The event is recorded, and the calls its mods are to get go to the driver (:func:`drive`,
        which runs the calls of every request of the step together) and come back made."""
        index, pending = self._recorded_calls(event)
        if not pending:  # no mod, or every mod's guard turns this event away: no call, no round
            return []
        calls = yield pending
        return self._items(index, calls)

    def _dispatch_now(self, event: ModEvent) -> list[Call]:
        """:meth:`_dispatch` on this thread, alone (a Prefilled no loop drives)."""
        index, pending = self._recorded_calls(event)
        return self._items(index, self.state.manager.run_traced(pending)) if pending else []

    def _items(self, index: int, calls: Sequence[ModCall]) -> list[Call]:
        """The calls to apply and record (a silent Noop has no record: nothing to do for it)."""
        if not calls:
            return []
        payload = self.state.payload
        items = [Call(call, payload.call(index, call)) for call in calls]
        return items if self.actions.check_fatal_calls(items) else []

    @property
    def manager(self) -> ModManager:
        """The request's mods (whose calls :func:`drive` makes)."""
        return self.state.manager

    def _features(self, newest_only: bool) -> SAEFeatures | None:
        """The inline SAE encoding of the newest forward, as the SDK's numpy object."""
        encoded = self.state.sae_features
        if encoded is None or not newest_only:
            return all_features(encoded)
        return self._newest_features(encoded)

    def _newest_features(self, encoded: Any) -> SAEFeatures | None:
        """The newest row of an inline SAE encoding (``(k,)`` indices and values): one host copy
        per forward, however many readers (ForwardPass and the stream), each given its own arrays."""
        if encoded is None:
            return None
        if self._newest is None or self._newest[0] is not encoded:
            self._newest = newest_row(encoded)
        return features_of(self._newest)

    def _prefilled_event(self) -> Prefilled:
        state = self.state
        return prefilled_event(state.request_id, state.prompt_ids, state.max_tokens, state.output,  # type: ignore[arg-type]
                               state.event_layer, self._features(newest_only=False))

    def _forward_event(self) -> ForwardPass:
        state = self.state
        assert state.output is not None  # built only when the step is ready
        return self._forward_event_of(state.output, state.step, state.token_ids(), state.sae_features, self._host)

    def _forward_event_of(self, output: RowOutput | RowCapture, step: int, input_ids: Sequence[int], encoded: Any,
                          host: Any = None, logits: Any = None) -> ForwardPass:
        return forward_event(self.state.request_id, step, output, self.state.event_layer, input_ids,
                             self._newest_features(encoded), host, logits)


class Unsettled:
    """What :meth:`RequestMachine.after_forward` returns when its step samples from logits a mod
    handed back whose check is left to :meth:`RequestMachine.settle`, called just before the
    step's draw."""

    __slots__ = ("plan",)

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


_SAMPLED_ADDED = (Sampled, Added)
_MOST_DEFER_AFTER = 1024  # hand-backs in a row before a deferral, at most (RequestMachine._defer_after)
_NO_ACTIONS = StepPlan()  # a step no mod acted on (never changed: read only)
