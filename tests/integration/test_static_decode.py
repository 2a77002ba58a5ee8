"""The graph decode path's logic on CPU: static buffers, bucketed batches and lengths, padding rows,
position moves on Backtrack, graph selection by capture plan — the same code a GPU captures as CUDA
graphs, run here without capture (``backend.graph_decode: static``). Every output must equal the
eager path's, token for token, at temperature 0."""

from __future__ import annotations

import pytest

from engine.core.stream import TokenEvent
from mods import Added, ForwardPass, mod
from tests.helpers import build_config

PROMPTS = ["What is the capital of France?", "Hi", "Write a haiku about the sea.", "List three prime numbers.",
           "Why do cats purr?"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def static_engine():
    from engine import Engine

    with Engine(build_config(graph_decode="static", max_sequence=512, max_batch=4)) as eng:
        yield eng


@mod
def backtrack_and_force(event, actions, tokenizer):
    if isinstance(event, Added) and event.step == 3 and not event.forced:
        return actions.backtrack(steps=2)
    if isinstance(event, ForwardPass) and event.step == 6:
        return actions.force_tokens(tokenizer.encode(" and so on", add_special_tokens=False))
    return None


def _run_all(eng, mods=None):
    first = [eng.submit(p, max_tokens=MAX_TOKENS, temperature=0.0, mods=mods) for p in PROMPTS[:3]]
    for event in first[0]:  # join mid-flight: the first rows have streamed a token
        if isinstance(event, TokenEvent):
            break
    rest = [eng.submit(p, max_tokens=MAX_TOKENS, temperature=0.0, mods=mods, top_logprobs=0,
                       attention="all") for p in PROMPTS[3:]]  # another capture plan
    return [h.result(timeout=300) for h in first + rest]


@pytest.mark.parametrize("mods", [None, [backtrack_and_force]], ids=["plain", "backtrack+force"])
def test_static_decode_equals_eager_token_for_token(engine, static_engine, mods):
    eager = [engine.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, mods=mods) for p in PROMPTS]
    before = dict(static_engine.backend.graph_stats)
    static = _run_all(static_engine, mods)
    for prompt, a, b in zip(PROMPTS, eager, static):
        assert b.sequence_ids == a.sequence_ids, f"{prompt!r}: the static decode path differs from eager"
    stats = static_engine.backend.graph_stats
    assert stats["static_steps"] > before["static_steps"], "the static path never ran: the test proved nothing"
    assert stats["eager_steps"] > before["eager_steps"]  # prefills and forced chunks stay eager
    keys = static_engine.backend._graphs.keys()
    assert len({(k.hidden_layers, k.attention_layers) for k in keys}) >= 2, "a plan change reused one graph"
    assert len({k.batch for k in keys}) >= 2


def test_static_decode_events_carry_the_same_internals(engine, static_engine):
    a = engine.generate(PROMPTS[0], max_tokens=4, temperature=0.0, keep_logits=True)  # compared after the run
    b = static_engine.generate(PROMPTS[0], max_tokens=4, temperature=0.0, keep_logits=True)
    import torch

    for ea, eb in zip(a.events, b.events):
        if isinstance(ea, ForwardPass):
            torch.testing.assert_close(eb.logits.tensor, ea.logits.tensor, atol=1e-4, rtol=0)
            torch.testing.assert_close(eb.hidden_states.tensor, ea.hidden_states.tensor, atol=1e-4, rtol=0)
            torch.testing.assert_close(eb.attention_patterns.tensor, ea.attention_patterns.tensor, atol=1e-5, rtol=0)


@pytest.mark.parametrize("which", ["eager", "static"])
def test_payload_top_tokens_come_from_the_batched_forward_and_equal_a_per_request_softmax(engine, static_engine,
                                                                                         which):
    """The backend computes every forward's top-20 log-probs once per batch (inside the graph on a
    GPU); each ForwardPass record must hold exactly what a log-softmax of that event's logits gives."""
    import torch

    eng = engine if which == "eager" else static_engine
    handles = [eng.submit(p, max_tokens=4, temperature=0.0, keep_logits=True, payload_top_tokens=True)
               for p in PROMPTS[:3]]  # batched rows
    for result in [h.result(timeout=300) for h in handles]:
        forwards = [e for e in result.events if isinstance(e, ForwardPass)]
        records = [r for r in result.payload["events"] if r["event_type"] == "ForwardPass"]
        assert len(records) == len(forwards) >= 4
        for event, record in zip(forwards, records):
            values, indices = torch.log_softmax(event.logits.tensor.reshape(-1).float(), dim=-1).topk(20)
            assert [t["token"] for t in record["top_tokens"]] == indices.tolist()
            torch.testing.assert_close(torch.tensor([t["logprob"] for t in record["top_tokens"]]), values,
                                       atol=1e-5, rtol=0)


def test_compiled_decode_equals_eager_token_for_token_and_carries_the_same_internals(engine):
    """``graph_decode: compile`` runs the static path through torch.compile (the CPU question: is a
    compiled step faster?). Whatever it does to speed, its tokens and internals must be eager's,
    including a Backtrack (a position move inside one compiled shape) and a multi-token force."""
    import torch
    from torch._dynamo.utils import counters

    from engine import Engine

    before = counters["stats"]["unique_graphs"]
    with Engine(build_config(graph_decode="compile", max_sequence=128, max_batch=1)) as compiled:
        for mods in (None, [backtrack_and_force]):
            a = engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, mods=mods, keep_logits=True)
            b = compiled.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, mods=mods, keep_logits=True)
            assert b.sequence_ids == a.sequence_ids, f"mods={mods}: the compiled decode differs from eager"
        for ea, eb in zip(a.events, b.events):
            if isinstance(ea, ForwardPass):
                torch.testing.assert_close(eb.logits.tensor, ea.logits.tensor, atol=1e-3, rtol=0)
                torch.testing.assert_close(eb.hidden_states.tensor, ea.hidden_states.tensor, atol=1e-3, rtol=0)
                torch.testing.assert_close(eb.attention_patterns.tensor, ea.attention_patterns.tensor, atol=1e-4,
                                           rtol=0)
        decodes = list(compiled.backend._graphs.values())
        assert decodes and compiled.backend.graph_stats["static_steps"] > 0
        assert all(d.compile_error is None for d in decodes), [d.compile_error for d in decodes]
    assert counters["stats"]["unique_graphs"] > before, "nothing was compiled: the test proved nothing"


def test_an_eager_forward_after_a_static_decode_reads_what_the_static_decode_wrote(static_engine, monkeypatch):
    """On a CPU the eager forwards keep the rows they gathered from one forward to the next
    (``engine/model/gathered_rows.py``); a static decode writes the pool past them, so the runner
    forgets them there. A static decode that writes a position again (as after a Backtrack), then
    an eager forward reading it: the same logits as with every forward gathering afresh."""
    import torch

    from engine.model import gathered_rows
    from engine.model.backend import ForwardBatch, ForwardRow

    monkeypatch.setattr(gathered_rows, "GATHERED_MIN_BYTES", 0)  # the test model's rows are small
    backend = static_engine.backend
    table = tuple(range(backend.cache.num_blocks - 2, backend.cache.num_blocks))  # blocks no request holds now
    prompt = tuple(static_engine.encode("The sea is wide and deep"))[:8]

    def run() -> torch.Tensor:
        backend.execute(ForwardBatch((ForwardRow("a", 0, prompt, table=table),)))  # eager: the prompt
        backend.execute(ForwardBatch((ForwardRow("a", 3, (prompt[1],), table=table),)))  # static: position 3 again
        return backend.execute(ForwardBatch((ForwardRow("a", 4, prompt[4:6], table=table),))).logits  # eager

    steps = dict(backend.graph_stats)
    kept = run()
    assert backend.graph_stats["static_steps"] == steps["static_steps"] + 1, "the middle forward was not static"
    keep, backend._gathered = backend._gathered, None
    try:
        fresh = run()
    finally:
        backend._gathered = keep
    assert keep is not None and keep.keys, "a CPU runner keeps the rows it gathers"
    assert torch.equal(kept, fresh)


def test_a_forward_that_raises_makes_the_runner_forget_the_rows_it_kept(static_engine, monkeypatch):
    """An eager forward that raises after its first layer has left the later layers' kept rows
    unrefreshed: the runner forgets them, so the next forward copies everything again."""
    from engine.model import gathered_rows
    from engine.model.backend import ForwardBatch, ForwardRow
    from engine.model.kv_cache import BatchCacheView

    monkeypatch.setattr(gathered_rows, "GATHERED_MIN_BYTES", 0)  # the test model's rows are small
    backend = static_engine.backend
    table = tuple(range(backend.cache.num_blocks - 2, backend.cache.num_blocks))  # blocks no request holds now
    prompt = tuple(static_engine.encode("The sea is wide and deep"))[:8]
    backend.execute(ForwardBatch((ForwardRow("a", 0, prompt, table=table),)))
    assert backend._gathered._slots is not None, "the rows were kept"
    real = BatchCacheView.update

    def failing(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 1:
            raise RuntimeError("a layer failed")
        return real(self, key_states, value_states, layer_idx, *args, **kwargs)
    monkeypatch.setattr(BatchCacheView, "update", failing)
    with pytest.raises(Exception):
        backend.execute(ForwardBatch((ForwardRow("a", 4, prompt[4:6], table=table),)))
    assert backend._gathered._slots is None
