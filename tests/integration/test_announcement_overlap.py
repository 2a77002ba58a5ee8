"""The step loop announces a mod-free request's Sampled, stream token and Added after the next
forward is launched (on a GPU the device then works while the host announces). Nothing a user, a
mod or the ingest backend sees may change: the same tokens, the same events in the same order, the
same payload records and the same stream as with every step announced in place (the switch off) —
on a batch that mixes mod-free requests with ones whose mods act on Sampled and Added."""

from __future__ import annotations

import contextlib

import pytest

from engine.core.stream import Erased, TokenEvent
from mods import Added, Sampled, mod

PROMPTS = ["What is the capital of France?", "Hi", "Write a haiku about the sea.", "List three prime numbers."]
MAX_TOKENS = 8


@mod
def backtrack_on_added(event, actions, tokenizer):
    if isinstance(event, Added) and event.step == 2 and not event.forced:
        return actions.backtrack(steps=1)
    if isinstance(event, Sampled) and event.step == 4:
        return actions.force_tokens(tokenizer.encode(" ok", add_special_tokens=False))
    return None


@contextlib.contextmanager
def _announcements(engine, overlap: bool):
    loop = engine.loop
    before = loop.defer_announcements
    loop.defer_announcements = overlap
    try:
        yield loop.stats
    finally:
        loop.defer_announcements = before


def _run(engine):
    seen: dict[int, list[tuple[str, int]]] = {}
    handles = []
    # admitted together, so both runs prefill the same left-padded batch (another batch rounds the
    # float32 log-probs differently in the sixth decimal, which is no announcement's doing)
    with engine.loop.admission_held():
        for i, prompt in enumerate(PROMPTS):
            seen[i] = []
            on_event = (lambda e, i=i: seen[i].append((type(e).__name__, e.step)))
            mods = [backtrack_on_added] if i == 2 else None
            handles.append(engine.submit(prompt, max_tokens=MAX_TOKENS + 4 * (i == 3), temperature=0.0, mods=mods,
                                         on_event=on_event, top_logprobs=2))
    streams = []
    for handle in handles:
        streams.append([(type(e).__name__, getattr(e, "token_ids", None), getattr(e, "n", None),
                         getattr(e, "logprobs", None),
                         getattr(e, "top_logprobs", None)) for e in handle if isinstance(e, (TokenEvent, Erased))])
    results = [h.result(timeout=300) for h in handles]
    return results, streams, seen


def _records(result):
    return [{k: v for k, v in record.items() if k != "created_at"} for record in result.payload["events"]]


def test_overlapped_announcements_change_nothing_anyone_sees(engine):
    with _announcements(engine, overlap=False) as stats:
        before = stats.deferred_announcements
        in_place = _run(engine)
        assert stats.deferred_announcements == before, "the switch did not turn the overlap off"
    with _announcements(engine, overlap=True) as stats:
        before = stats.deferred_announcements
        overlapped = _run(engine)
        assert stats.deferred_announcements > before, "no announcement was deferred: the test proved nothing"
    (a, stream_a, seen_a), (b, stream_b, seen_b) = in_place, overlapped
    for i, (x, y) in enumerate(zip(a, b)):
        assert y.sequence_ids == x.sequence_ids, f"request {i}: tokens differ"
        assert y.finish_reason == x.finish_reason
        assert y.token_logprobs == x.token_logprobs
        assert [(type(e).__name__, e.step) for e in y.events] == [(type(e).__name__, e.step) for e in x.events]
        assert _records(y) == _records(x), f"request {i}: payload records differ"
        assert stream_b[i] == stream_a[i], f"request {i}: the stream differs"
        assert seen_b[i] == seen_a[i], f"request {i}: on_event saw a different order"
    assert any(isinstance(e, Sampled) for e in b[0].events) and b[2].actions, "the mod never acted"


def test_a_request_cancelled_mid_stream_with_the_overlap_on_announces_every_token_it_took(engine):
    """A cancel can land between a deferred step and its announcement: every token the request
    took is still announced (stream, Sampled, Added) before it ends as cancelled."""
    with _announcements(engine, overlap=True):
        handle = engine.submit(PROMPTS[0], max_tokens=64, temperature=0.0, ignore_eos=True)
        tokens = []
        for event in handle:
            if isinstance(event, TokenEvent):
                tokens.extend(event.token_ids)
                if len(tokens) == 3:
                    handle.cancel()
        result = handle.result(timeout=300)
    assert result.finish_reason.value == "cancelled"
    assert tokens == list(result.output_ids)
    added = [t for e in result.events if isinstance(e, Added) for t in e.added_tokens]
    assert added == list(result.output_ids)
    assert [e.step for e in result.events if isinstance(e, Sampled)] == list(range(len(result.output_ids)))


@pytest.mark.parametrize("overlap", [True, False])
def test_the_loop_measures_the_host_gap_before_each_launch(engine, overlap):
    with _announcements(engine, overlap=overlap) as stats:
        before = stats.launch_gaps
        engine.generate(PROMPTS[1], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert stats.launch_gaps - before == 3  # one per decode forward after a sample
        assert stats.mean_launch_gap_ms > 0.0
