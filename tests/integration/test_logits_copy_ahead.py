"""A step's logits are copied for its mods ahead of the mods (started from the step loop's thread,
made on a thread of its own while the step's events are built) when a mod of a request read its
logits the step before; otherwise at the first read, as always. Which of the two made the copy
changes nothing a mod or a result can see. (A row lent in place is never copied: these requests
keep their logits, so their rows are copied.)"""

from __future__ import annotations

import pytest

from engine.model.tensor import HostLogits
from mods import ForwardPass
from tests.helpers import CharTokenizer, ban_best_mod, scripted_engine

TOK = CharTokenizer()


def _run(mod, **generation):
    """Three requests admitted together (one batch, at the same step throughout)."""
    eng = scripted_engine(**generation)
    try:
        with eng.loop.admission_held():
            handles = [eng.submit(input_ids=TOK.encode("Q:"), mods=[mod]) for _ in range(3)]
        return [h.result(timeout=60) for h in handles]
    finally:
        eng.close()


def _copy_made_before_the_mod(event) -> bool:
    """Whether the step's copy was started before its first mod ran."""
    host = event.logits._host
    return host is not None and (host._host is not None or host._ahead is not None)


@pytest.fixture(params=["on the copier", "on the loop's thread"])
def copy_where(request, monkeypatch):
    """The test's small batches are copied on the loop's thread; AHEAD_MIN_BYTES 0 sends them to
    the copier, as a real vocabulary's rows are."""
    import engine.model.tensor as tensor

    if request.param == "on the copier":
        monkeypatch.setattr(tensor, "AHEAD_MIN_BYTES", 0)
    return request.param


@pytest.mark.parametrize("reads_at", [None, {0}, {0, 1, 3}], ids=["every step", "step 0", "steps 0, 1, 3"])
def test_the_copy_is_made_ahead_exactly_on_steps_after_a_read(reads_at, copy_where):
    seen: dict[int, bool] = {}  # step -> whether the copy was there when the step's first mod ran

    def reader(event, tokenizer=None):
        if isinstance(event, ForwardPass):
            seen.setdefault(event.step, _copy_made_before_the_mod(event))
            if reads_at is None or event.step in reads_at:
                event.logits.to_numpy()
        return None

    results = _run(reader, keep_logits=True)  # kept logits: the rows are copied, never lent in place
    assert all(r.output_text == "hello world" for r in results)
    steps = sorted(seen)
    assert len(steps) == len("hello world") + 1
    for step in steps:
        read_before = step > 0 and (reads_at is None or step - 1 in reads_at)
        assert seen[step] == read_before, (step, seen)


def test_a_logits_mod_gets_the_same_results_with_the_copy_made_ahead_or_at_its_read(monkeypatch, copy_where):
    """A mod that bans each step's best token and hands the row back: the same outputs, events
    and adjusted logits whichever thread copied the step's logits."""
    ban_best = ban_best_mod(6)

    ahead = _run(ban_best, keep_logits=True)
    monkeypatch.setattr(HostLogits, "copy_ahead", lambda self: None)
    at_read = _run(ban_best, keep_logits=True)
    assert ahead[0].output_text != "hello world"  # the bans took effect
    for a, b in zip(ahead, at_read):
        assert a.output_text == b.output_text and a.sequence_ids == b.sequence_ids
        assert [type(e).__name__ for e in a.events] == [type(e).__name__ for e in b.events]
        assert [x.logits.to_numpy().tolist() for x in a.actions] == [x.logits.to_numpy().tolist() for x in b.actions]
