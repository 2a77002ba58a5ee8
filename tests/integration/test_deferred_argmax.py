"""A greedy row lent to its one mod in place has its argmax found by the runner before the mod runs,
so that the draw ignores what the mod wrote there. Once the mod has handed back logits of its own,
the runner leaves that argmax unfound (its pass over the vocabulary is wasted while the mod keeps
handing rows back) and keeps the output head's input instead: if the mod then does not hand the
row back, the argmax is found in the batch's logits recomputed exactly. Either way each step's
token, event and payload are what they were with the search made before the mod."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.model.backend import DeferredArgmax
from engine.model.head_replay import HeadReplay
from mods import AdjustedLogits, ForwardPass
from tests.core_fixtures import _payload as timeless  # the payload less its times and request id

PROMPTS = ("Name a colour.", "Count to three.", "Say hello.")


def _moody(hand_back_on: set[int]):
    """Bans the best token and hands the row back on the steps in ``hand_back_on``; on any other
    step it scribbles over the row it was lent (another token raised far above the rest) and
    hands nothing back — a write the draw must ignore."""
    def moody(event, tokenizer=None):
        if not isinstance(event, ForwardPass):
            return None
        logits = event.logits.to_numpy()
        best = int(logits.argmax())
        if event.step in hand_back_on:
            logits[0, best] = -1e9
            return AdjustedLogits(type(event.logits).from_numpy(logits))
        logits[0, (best + 11) % logits.shape[1]] = 1e9
        return None
    return moody


def _run(engine, mod, *, max_tokens: int = 8):
    """The prompts admitted together, each with ``mod``; every step's rows and output
    kept, with each asked row's argmax taken when the forward returned (before any mod wrote)."""
    seen = []
    runner = engine.loop.runner
    execute = runner.execute

    def watched(batch):
        out = execute(batch)
        seen.append((batch.rows, out, out.logits.argmax(dim=-1).tolist()))
        return out
    runner.execute = watched
    try:
        with engine.loop.admission_held():
            handles = [engine.submit(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, mods=[mod])
                       for p in PROMPTS]
        results = [h.result(timeout=300) for h in handles]
    finally:
        del runner.execute
    return results, seen


def _no_deferral(monkeypatch):
    monkeypatch.setattr(HeadReplay, "deferred", lambda self, logits, rows: None)


def _same(a, b) -> None:
    assert a.sequence_ids == b.sequence_ids and a.output_text == b.output_text
    assert [type(e).__name__ for e in a.events] == [type(e).__name__ for e in b.events]
    for part in ("events", "mod_calls", "actions", "mod_logs"):
        assert timeless(a.payload[part]) == timeless(b.payload[part]), part


def test_a_mod_that_hands_its_row_back_every_step_has_no_argmax_searched_before_it(engine, monkeypatch):
    results, seen = _run(engine, _moody(set(range(100))))
    deferred = [b for rows, out, _ in seen for b, row in enumerate(rows) if row.defer_argmax]
    assert deferred, "no row deferred its argmax"
    for rows, out, _ in seen:
        for b, row in enumerate(rows):
            if row.defer_argmax:
                assert row.argmax and out.argmax[b] is None and out.deferred is not None
                assert b in out.deferred.rows
    prefill_rows, _, _ = seen[0]  # the prompts' forward: no mod has handed anything back yet
    assert len(prefill_rows) == len(PROMPTS) and not any(r.defer_argmax for r in prefill_rows)
    with monkeypatch.context() as m:
        _no_deferral(m)
        reference, seen_ref = _run(engine, _moody(set(range(100))))
    assert all(out.deferred is None for _, out, _ in seen_ref)
    for a, b in zip(results, reference):
        _same(a, b)


def test_a_row_deferred_but_not_handed_back_is_drawn_from_the_logits_its_forward_made(engine, monkeypatch):
    """Its mod handed back on steps 0-2, then scribbled over the row lent to it and handed nothing
    back: the draw is the forward's own argmax (recomputed), as if the mod had never written."""
    recomputed = []
    argmax = DeferredArgmax.argmax

    def counted(self, row):
        found = argmax(self, row)
        recomputed.append(found)
        return found
    monkeypatch.setattr(DeferredArgmax, "argmax", counted)
    hand_back = {0, 1, 2, 5, 6, 8, 9, 10, 11}
    results, seen = _run(engine, _moody(hand_back), max_tokens=14)
    assert recomputed, "no deferred argmax was needed"
    by_request = {}
    for rows, out, before in seen:
        for b, row in enumerate(rows):
            by_request.setdefault(row.request_id, []).append((row, before[b]))
    for result in results:
        steps = by_request[result.request_id]
        for step, (token, (row, best)) in enumerate(zip(result.sequence_ids, steps)):
            if step not in hand_back:  # nothing handed back: the model's own greedy choice
                assert token == best, (step, token, best)
        deferring = [s for s, (row, _) in enumerate(steps) if row.defer_argmax]
        # from the step after the first hand-back. Step 3 handed nothing back, so its deferral cost a
        # recomputation: from then on two hand-backs in a row are needed (steps 5 and 6). Step 7's
        # deferral was wasted too: then four (steps 8 to 11)
        assert deferring == [1, 2, 3, 7, 12]
    with monkeypatch.context() as m:
        _no_deferral(m)
        reference, _ = _run(engine, _moody(hand_back), max_tokens=14)
    for a, b in zip(results, reference):
        _same(a, b)


def test_a_step_that_joins_decode_and_prefill_forwards_finds_the_deferred_rows_argmax(engine):
    """A request admitted while another decodes: their rows run as two forwards whose logits are
    joined into one batch (a copy), so a deferred argmax is found there, from the joined logits."""
    runner = engine.loop.runner
    execute = runner.execute
    joined = []

    def watched(batch):
        out = execute(batch)
        if len({len(r.tokens) for r in batch.rows}) > 1:
            joined.append((batch.rows, out, out.logits.argmax(dim=-1).tolist()))
        return out
    runner.execute = watched
    decoding = threading.Event()
    ban = _moody(set(range(100)))

    def ban_and_tell(event, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step == 2:
            decoding.set()
        return ban(event, tokenizer)
    try:
        first = engine.submit("Name a colour.", max_tokens=24, temperature=0.0, mods=[ban_and_tell])
        assert decoding.wait(timeout=300)
        late = engine.submit("Write a long sentence about the sea, please.", max_tokens=2, temperature=0.0)
        first.result(timeout=300), late.result(timeout=300)
    finally:
        del runner.execute
    asked = [(out.argmax[b], before[b]) for rows, out, before in joined for b, row in enumerate(rows)
             if row.defer_argmax]
    assert asked, "no step joined a deferring decode row with a prefill"
    for found, best in asked:
        assert found == best


def test_the_head_replay_refuses_a_model_whose_logits_are_not_its_heads_output():
    """A model that scales its head's output (as Gemma soft-caps it) gets no deferral: the first
    comparison of the recomputed logits with the forward's fails, and every later one is skipped."""
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(8, 32, bias=False)
            self.scale = 1.0

        def get_output_embeddings(self):
            return self.head

        def forward(self, x):
            return self.head(x) * self.scale

    model = Tiny()
    x = torch.randn(4, 1, 8)
    replay = HeadReplay(model)
    replay.arm()
    logits = model(x)[:, -1].float()
    deferred = replay.deferred(logits, frozenset({0, 2}))
    assert replay.exact is True and deferred is not None
    expected = logits.argmax(dim=-1).tolist()
    logits.fill_(0.0)  # what a mod lent the rows in place might leave: the recomputed logits do not see it
    assert [deferred.argmax(0), deferred.argmax(2)] == [expected[0], expected[2]]

    replay.close()
    model.scale = 2.0
    other = HeadReplay(model)
    other.arm()
    scaled = model(x)[:, -1].float()
    assert other.deferred(scaled, frozenset({1})) is None and other.exact is False
    other.arm()
    model(x)
    assert other.deferred(scaled, frozenset({1})) is None  # not compared again
    other.close()
    assert not model.head._forward_pre_hooks


def test_the_head_replay_keeps_only_the_arming_threads_forward():
    """A forward another thread runs meanwhile (a caller's reference forward) is not taken for
    the engine's; once disarmed, nothing is kept."""
    head = torch.nn.Linear(8, 16, bias=False)
    model = type("Tiny", (), {"get_output_embeddings": lambda self: head})()
    replay = HeadReplay(model)
    replay.arm()
    x = torch.randn(2, 1, 8)
    other = threading.Thread(target=lambda: head(x))
    other.start(), other.join()
    logits = torch.nn.functional.linear(x, head.weight)[:, -1]  # (not through the head module)
    assert replay.deferred(logits, frozenset({0})) is None  # its own thread ran no forward yet
    y = torch.randn(2, 1, 8)
    logits = head(y)[:, -1]
    deferred = replay.deferred(logits, frozenset({1}))
    assert deferred is not None and deferred.argmax(1) == int(logits[1].argmax())
    replay.disarm()
    head(y)
    assert replay.deferred(logits, frozenset({1})) is None
    replay.close()


def test_another_hook_on_the_head_stops_deferral_for_as_long_as_it_is_there():
    """A tap that changes what the head gives (as a write to ``unembed.hook_out`` would) is not in
    a recomputation of the head: while such a hook is on the head, no argmax is deferred."""
    head = torch.nn.Linear(8, 16, bias=False)
    model = type("Tiny", (), {"get_output_embeddings": lambda self: head})()
    replay = HeadReplay(model)
    x = torch.randn(3, 1, 8)
    handle = head.register_forward_hook(lambda module, args, out: out * 2)
    replay.arm()
    logits = head(x)[:, -1]
    assert replay.deferred(logits, frozenset({0})) is None and replay.exact is None
    handle.remove()
    replay.arm()
    logits = head(x)[:, -1]
    assert replay.deferred(logits, frozenset({0})) is not None and replay.exact is True
    replay.close()


@pytest.mark.parametrize("searched_now", [1, 3])
def test_the_runner_searches_the_rows_that_do_not_defer_and_leaves_the_others(searched_now):
    """A batch of six rows, each asking its argmax: those that may defer are left None and found
    on demand; the others are searched at once, gathered when they are few, in place when most."""
    from engine.model.backend import ForwardRow
    from engine.model.hf import _asked_argmax

    torch.manual_seed(1)
    head = torch.nn.Linear(8, 300, bias=False)
    model = type("Tiny", (), {"get_output_embeddings": lambda self: head})()
    replay = HeadReplay(model)
    replay.arm()
    logits = head(torch.randn(6, 1, 8))[:, -1]
    rows = [ForwardRow(f"r{b}", 0, (1,), argmax=True, defer_argmax=b >= searched_now) for b in range(6)]
    rows[-1] = ForwardRow("r5", 0, (1,), argmax=False)  # a row that did not ask
    expected = logits.argmax(dim=-1).tolist()
    found, deferred = _asked_argmax(logits, rows, None, replay)
    assert deferred is not None and deferred.rows == frozenset(range(searched_now, 5))
    assert found == expected[:searched_now] + [None] * (6 - searched_now)
    logits.fill_(0.0)  # a mod's writes, say: the deferred rows are found in the logits recomputed
    assert [deferred.argmax(b) for b in range(searched_now, 5)] == expected[searched_now:5]
    replay.close()


def test_no_head_input_no_deferral():
    replay = HeadReplay(torch.nn.Module.__new__(type("NoHead", (torch.nn.Module,), {
        "get_output_embeddings": lambda self: None})))
    assert replay.deferred(torch.zeros(2, 4), frozenset({0})) is None
    assert replay.exact is None
