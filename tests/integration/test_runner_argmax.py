"""A greedy row that nothing can change before its draw (no penalty, bias, ban, grammar or stop
token held back by ``min_tokens``; no mod, or one whose row is lent to it in place and drawn from
as it was before the mod ran) has its argmax found by the model runner with the forward, while the
logits are fresh in the cache, as vLLM's runner samples; any other row is drawn by the step's
sampler as before. Either way the token is the row's first maximum."""

from __future__ import annotations

import torch

from mods import ForwardPass, mod


@mod
def _reader(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        event.logits.to_numpy()  # reads, hands nothing back
    return None


def _watch(engine):
    seen = []
    runner = engine.loop.runner
    execute = runner.execute

    def watched(batch):
        out = execute(batch)
        seen.append((batch.rows, out))
        return out
    runner.execute = watched
    return seen, runner


def test_the_runner_finds_the_argmax_of_the_rows_that_ask_and_only_those(engine):
    seen, runner = _watch(engine)
    try:
        with engine.loop.admission_held():
            handles = {
                "greedy": engine.submit("Name a colour.", max_tokens=5, temperature=0.0),
                "held": engine.submit("Count to three.", max_tokens=5, temperature=0.0, min_tokens=3),
                "sampled": engine.submit("Say hello.", max_tokens=5, temperature=0.7, seed=1),
                "mod": engine.submit("Say hi.", max_tokens=5, temperature=0.0, mods=[_reader]),
                "listened": engine.submit("Say hey.", max_tokens=5, temperature=0.0, mods=[_reader],
                                          on_event=lambda event: None),
            }
            ids = {h.request_id: name for name, h in handles.items()}
        results = {name: h.result(timeout=300) for name, h in handles.items()}
    finally:
        del runner.execute
    asked: dict[str, list[bool]] = {name: [] for name in handles}
    for rows, out in seen:
        for b, row in enumerate(rows):
            asked[ids[row.request_id]].append(row.argmax)
            if row.argmax:
                assert out.argmax[b] == int(torch.argmax(out.logits[b]))
            else:  # a row that did not ask has no argmax to be drawn from (its draw may differ)
                assert out.argmax is None or out.argmax[b] is None
    assert asked["greedy"] == [True] * 5
    assert asked["held"] == [False] * 3 + [True] * 2  # its stop tokens are held back for three tokens
    assert not any(asked["sampled"])
    assert asked["mod"] == [True] * 5  # its row is lent to its one mod in place: drawn as the runner found it
    assert not any(asked["listened"])  # a listener reads the row too: copied for the mod, drawn by the sampler
    assert all(r.finish_reason.value == "length" for r in results.values())


def test_the_runner_reads_the_argmax_off_the_forwards_top_log_probs_with_no_second_pass(engine, monkeypatch):
    """A request whose payload lists the top log-probs (as when payloads are sent) has them computed
    with every forward: a row whose best log-prob is strictly above its second takes its best id,
    so the runner searches no row whole."""
    import engine.model.vocab_search as vocab_search

    searched: list[int] = []
    real = vocab_search.row_max
    monkeypatch.setattr(vocab_search, "row_max", lambda scores: (searched.append(scores.shape[0]), real(scores))[1])
    seen, runner = _watch(engine)
    try:
        with engine.loop.admission_held():
            handles = [engine.submit(p, max_tokens=4, temperature=0.0, payload_top_tokens=True)
                       for p in ("Name a colour.", "Say hi.")]
        for h in handles:
            h.result(timeout=300)
    finally:
        del runner.execute
    asked = [(rows, out) for rows, out in seen if any(r.argmax for r in rows)]
    assert asked and all(out.top is not None for _, out in asked)
    for rows, out in asked:
        for b, row in enumerate(rows):
            if row.argmax:
                assert out.argmax[b] == int(torch.argmax(out.logits[b]))
    assert searched == []  # the embedded model's logits have no tie at their top here
