"""Chunked prefill on the embedded model: with a small step budget (``backend.max_step_tokens``) a
long prompt is fed over several steps while a decoding neighbour keeps stepping, and nothing a mod,
a stream or the activation store sees changes — Prefilled's hidden states and attention, every
ForwardPass, the tokens and the SAE rows equal a run that fed the prompt in one forward (the
session engine, budget 512). A request cancelled mid-prefill ends at the next step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from engine.core.result import FinishReason
from engine.core.stream import TokenEvent
from mods import ForwardPass, Prefilled
from tests.helpers import build_config

BUDGET = 16
LONG = ("The lighthouse keeper kept a log of every ship that passed the rocks: the name, the flag, the "
        "hour and the weather. Over forty years the log grew to nine volumes, and when she retired she "
        "gave them to the harbour museum. Summarise what the keeper recorded and why it mattered.")
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def chunked():
    """A second copy of the embedded model whose steps feed at most BUDGET tokens (no prefix
    cache: these tests count chunks, which a cached system prompt would save; chunks and the
    cache together are tests/integration/test_prefix_cache.py's)."""
    from engine import Engine

    with Engine(build_config(max_step_tokens=BUDGET, prefix_caching=False)) as eng:
        yield eng


@pytest.fixture(scope="module")
def long_ids(engine):
    ids = engine.encode(LONG)
    assert len(ids) > 4 * BUDGET, "the prompt must need several chunks"
    return ids


def _close(a, b, what):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    scale = max(float(np.abs(b).max()), 1e-12)
    assert float(np.abs(a - b).max()) <= 1e-4 * scale, f"{what}: max diff {np.abs(a - b).max()} at scale {scale}"


def _neighbour_steps_during_prefill(eng, long_ids):
    """Start a neighbour decoding, then submit the long prompt; how many ForwardPass events the
    neighbour had between that submit and the long prompt's Prefilled, and the prefill chunks fed."""
    log: list[tuple[str, str]] = []  # appended on the loop thread, in the order events happen
    neighbour = eng.submit("Count slowly from one to fifty.", max_tokens=64, temperature=0.0, ignore_eos=True,
                           on_event=lambda e: log.append(("n", type(e).__name__)))
    stream = iter(neighbour)
    next(e for e in stream if isinstance(e, TokenEvent))  # it is decoding now
    chunks_before, mark = eng.loop.stats.prefill_chunks, len(log)
    long = eng.submit(input_ids=long_ids, max_tokens=4, temperature=0.0,
                      on_event=lambda e: log.append(("l", type(e).__name__)))
    long_result = long.result(timeout=600)
    neighbour.cancel()
    neighbour.result(timeout=600)
    prefilled = log.index(("l", "Prefilled"))
    between = sum(1 for who, kind in log[mark:prefilled] if who == "n" and kind == "ForwardPass")
    assert long_result.finish_reason is FinishReason.LENGTH
    return between, eng.loop.stats.prefill_chunks - chunks_before


def test_a_long_prompt_is_prefilled_in_chunks_while_a_decoding_neighbour_keeps_stepping(chunked, engine,
                                                                                        long_ids):
    chunks = math.ceil(len(long_ids) / (BUDGET - 1))  # one token of each step goes to the neighbour
    between, fed_in_parts = _neighbour_steps_during_prefill(chunked, long_ids)
    assert fed_in_parts == chunks - 1  # every chunk but the last is a part
    assert between >= chunks - 1, f"the neighbour stepped {between} times during a {chunks}-chunk prefill"
    # positive control: with the default budget the prompt goes in one forward, and the neighbour
    # gets at most the step it was submitted next to
    between, fed_in_parts = _neighbour_steps_during_prefill(engine, long_ids)
    assert fed_in_parts == 0 and between <= 1


def _run(eng, long_ids):  # the events' logits are compared after the run: kept
    return eng.generate(input_ids=long_ids, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, keep_logits=True)


def test_a_chunked_prompt_gives_the_same_events_and_tokens_as_one_forward(chunked, engine, long_ids):
    before = chunked.loop.stats.prefill_chunks
    ours, whole = _run(chunked, long_ids), _run(engine, long_ids)
    assert chunked.loop.stats.prefill_chunks - before >= len(long_ids) // BUDGET  # it really was chunked
    assert ours.sequence_ids == whole.sequence_ids
    a, b = ours.events[0], whole.events[0]
    assert isinstance(a, Prefilled) and isinstance(b, Prefilled) and a.input_ids == b.input_ids == long_ids
    n = len(long_ids)
    assert a.hidden_states.to_numpy().shape == (n, chunked.backend.info.hidden_size)
    assert a.attention_patterns.to_numpy().shape == (chunked.backend.info.num_attention_heads, n, n)
    _close(a.hidden_states.to_numpy(), b.hidden_states.to_numpy(), "Prefilled hidden states")
    _close(a.attention_patterns.to_numpy(), b.attention_patterns.to_numpy(), "Prefilled attention")
    assert np.allclose(a.attention_patterns.to_numpy().sum(-1), 1.0, rtol=1e-4)  # every row a distribution
    forwards = [(x, y) for x, y in zip(ours.events, whole.events) if isinstance(x, ForwardPass)]
    assert len(forwards) == NEW_TOKENS
    for x, y in forwards:
        assert (type(y), x.step) == (ForwardPass, y.step)
        _close(x.logits.to_numpy(), y.logits.to_numpy(), f"ForwardPass {x.step} logits")
        _close(x.hidden_states.to_numpy(), y.hidden_states.to_numpy(), f"ForwardPass {x.step} hidden states")
        _close(x.attention_patterns.to_numpy(), y.attention_patterns.to_numpy(), f"ForwardPass {x.step} attention")
    assert [type(e).__name__ for e in ours.events] == [type(e).__name__ for e in whole.events]


def test_greedy_tokens_of_a_chunked_prompt_equal_transformers_generate(chunked, long_ids):
    model = chunked.backend.reference_model
    eos = set(chunked.backend.info.eos_token_ids)
    with torch.inference_mode():
        reference = model.generate(torch.tensor([long_ids]), attention_mask=torch.ones(1, len(long_ids),
                                   dtype=torch.long), max_new_tokens=16, do_sample=False)[0, len(long_ids):].tolist()
    ours = chunked.generate(input_ids=long_ids, max_tokens=16, temperature=0.0)
    assert ours.output_ids == [t for t in reference if t not in eos]


def _sae_engine(base, tmp_path, name):
    from engine import Engine

    cfg = base.config
    cfg = dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp_path / f"{name}.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode="inline"))
    return Engine(cfg, backend=base.backend)


def _prompt_rows(eng, request_id):
    eng.flush()
    return eng.store.cursor().execute(
        "SELECT step, token_position, token_id, feature_id, activation_value, rank FROM activations "
        "WHERE request_id = ? AND step = 0 ORDER BY token_position, rank", [request_id]).fetchall()


def test_sae_rows_and_features_of_a_chunked_prompt_equal_one_forward(chunked, engine, long_ids, tmp_path):
    with _sae_engine(chunked, tmp_path, "chunked") as a, _sae_engine(engine, tmp_path, "whole") as b:
        ours = a.generate(input_ids=long_ids, max_tokens=2, temperature=0.0, request_id="sae")
        whole = b.generate(input_ids=long_ids, max_tokens=2, temperature=0.0, request_id="sae")
        rows_a, rows_b = _prompt_rows(a, "sae"), _prompt_rows(b, "sae")
    positions = {r[1] for r in rows_b}
    assert positions == set(range(1, len(long_ids))), "every prompt token but the first has rows"
    assert [r[:4] + (r[5],) for r in rows_a] == [r[:4] + (r[5],) for r in rows_b]  # ids, positions, ranks
    _close([r[4] for r in rows_a], [r[4] for r in rows_b], "activation values")
    fa, fb = ours.events[0].sae_features, whole.events[0].sae_features
    assert fa.ids.shape == (len(long_ids), a.config.sae.top_k)
    assert np.array_equal(fa.ids, fb.ids)
    _close(fa.values, fb.values, "Prefilled SAE features")


def test_a_request_cancelled_mid_prefill_ends_at_the_next_step(chunked, long_ids):
    """Cancelled from a neighbour's ForwardPass (on the loop thread) right after the long prompt's
    first chunk went in: at the next step it leaves, with no Prefilled and no second chunk."""
    stats = chunked.loop.stats
    handles: dict[str, object] = {}
    before = {"chunks": stats.prefill_chunks}

    def cancel_after_first_chunk(event):
        if isinstance(event, ForwardPass) and "long" in handles and stats.prefill_chunks > before["chunks"]:
            handles["long"].cancel()

    neighbour = chunked.submit("Name the planets.", max_tokens=48, temperature=0.0, ignore_eos=True,
                               on_event=cancel_after_first_chunk)
    next(e for e in neighbour if isinstance(e, TokenEvent))
    before["chunks"] = stats.prefill_chunks
    handles["long"] = long = chunked.submit(input_ids=long_ids, max_tokens=8, temperature=0.0)
    result = long.result(timeout=600)
    neighbour.cancel()
    neighbour.result(timeout=600)
    assert result.finish_reason is FinishReason.CANCELLED
    assert result.events == [] and result.output_ids == []
    assert stats.prefill_chunks - before["chunks"] == 1, "it was fed again after its cancel"
    # its slot is free: a full prompt runs after it
    again = chunked.generate(input_ids=long_ids[:BUDGET * 2], max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(again.output_ids) == 3
