"""Prefix caching on the paged KV cache, on the embedded model: a request whose prompt starts with
blocks an earlier request computed reuses their keys/values and the internals their forward
captured, and nothing a mod, a stream, the payload or the activation store sees changes.

Every test compares a run with the cache (``prefix_cache`` on, after a warm-up that cached the
shared prefix) with the same request run without it (``prefix_cache=False``, which neither
reuses nor caches), and checks that the hit really happened (the backend's hit counter — the
positive control) and that no block stays held once the engine is idle.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from engine.core.result import FinishReason
from mods import Added, ForwardPass, Prefilled, mod
from mods.features import steer_toward
from tests.helpers import build_config, keeping_logits

BLOCK = 8  # the module's engine pages its cache in blocks of 8 positions: many block boundaries
SYSTEM = ("You are a patient tutor for a class of curious twelve-year-olds. Answer in plain words, one idea "
          "per sentence, and give a concrete everyday example whenever you can. If a question mixes two "
          "topics, answer the first one only and say so. Never use jargon without explaining it first.")
NEW_TOKENS = 10
STEER = 200.0
IGNORED_PAYLOAD_KEYS = {"created_at", "completed_at", "execution_time_ms", "request_id"}


def _config(**backend):
    """Every engine here keeps its logits: the comparisons read every ForwardPass's after the run."""
    return keeping_logits(build_config(**backend))


def _chat(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def eng():
    from engine import Engine

    with Engine(_config(kv_block_size=BLOCK)) as e:
        yield e


def _hits(e) -> int:
    return e.cache_stats()["hit_tokens"]


def _close(a, b, what):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    scale = max(float(np.abs(b).max()) if b.size else 0.0, 1e-12)
    assert float(np.abs(a - b).max(initial=0.0)) <= 1e-4 * scale, f"{what}: max diff {np.abs(a - b).max()}"


def _same_payload(a, b, path="payload"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys differ"
        for key in a:
            if key not in IGNORED_PAYLOAD_KEYS:
                _same_payload(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _same_payload(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1.0), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _same_results(on, off):
    """Tokens, every event with its internals, and the payload (times and ids aside) are equal."""
    assert on.sequence_ids == off.sequence_ids and on.prompt_ids == off.prompt_ids
    assert on.finish_reason == off.finish_reason
    assert [type(e).__name__ for e in on.events] == [type(e).__name__ for e in off.events]
    for x, y in zip(on.events, off.events):
        what = f"{type(x).__name__} {x.step}"
        assert x.step == y.step
        for name in ("logits", "hidden_states", "attention_patterns"):
            xa, ya = getattr(x, name, None), getattr(y, name, None)
            assert (xa is None) == (ya is None), f"{what}: {name} present in one run only"
            if xa is not None:
                _close(xa.to_numpy(), ya.to_numpy(), f"{what} {name}")
        if getattr(x, "input_ids", None) is not None:
            assert list(x.input_ids) == list(y.input_ids)
        fx, fy = getattr(x, "sae_features", None), getattr(y, "sae_features", None)
        assert (fx is None) == (fy is None)
        if fx is not None:
            assert np.array_equal(fx.ids, fy.ids), f"{what}: SAE feature ids differ"
            _close(fx.values, fy.values, f"{what} SAE features")
    _same_payload(on.payload, off.payload)


def _idle_blocks(e) -> int:
    return e.cache_stats()["blocks_used"]


def test_a_shared_system_prompt_is_reused_and_everything_downstream_is_unchanged(eng):
    question = "Why do leaves change colour in autumn?"
    cached = eng.cache_stats()["blocks_cached"]
    off = eng.generate(messages=_chat(question), max_tokens=NEW_TOKENS, temperature=0.0, prefix_cache=False)
    assert eng.cache_stats()["blocks_cached"] == cached, "a request with the cache off offered blocks"
    other = eng.generate(messages=_chat("What is a lever?"), max_tokens=2, temperature=0.0)  # caches the system prompt
    assert eng.cache_stats()["blocks_cached"] > cached
    with pytest.raises(AssertionError):  # positive control: the comparison tells other requests apart
        _same_results(other, off)
    hits, fed = _hits(eng), eng.loop.stats.tokens_fed
    on = eng.generate(messages=_chat(question), max_tokens=NEW_TOKENS, temperature=0.0)
    hit = _hits(eng) - hits
    n = len(on.prompt_ids)
    assert hit >= n // 2 and hit % BLOCK == 0, f"the system prompt ({n} prompt tokens) was not reused: {hit}"
    assert eng.loop.stats.tokens_fed - fed <= n - hit + NEW_TOKENS, "the reused prefix was fed again"
    prefilled = on.events[0]
    assert prefilled.hidden_states.to_numpy().shape == (n, eng.backend.info.hidden_size)
    assert prefilled.attention_patterns.to_numpy().shape == (eng.backend.info.num_attention_heads, n, n)
    assert np.allclose(prefilled.attention_patterns.to_numpy().sum(-1), 1.0, rtol=1e-4)
    _same_results(on, off)
    # a second identical request reuses everything but the last prompt token, with the same result
    hits = _hits(eng)
    again = eng.generate(messages=_chat(question), max_tokens=NEW_TOKENS, temperature=0.0)
    assert _hits(eng) - hits == (n - 1) // BLOCK * BLOCK
    _same_results(again, off)
    assert _idle_blocks(eng) == 0


@mod
def rethink(event, actions, tokenizer):
    """Twice, erase more than a block of what was just written (blocks the request itself cached
    when they filled): the last kept token is fed again and decoding goes on from there."""
    if isinstance(event, Added) and event.step in (10, 20) and not event.forced:
        return actions.backtrack(steps=BLOCK + 3)
    return None


def test_a_mod_that_backtracks_over_cached_blocks_sees_the_same_and_leaves_the_cache_right(eng):
    question = "How does a bicycle stay upright?"
    kwargs = dict(messages=_chat(question), max_tokens=30, temperature=0.0, ignore_eos=True, mods=[rethink])
    off = eng.generate(**kwargs, prefix_cache=False)
    eng.generate(messages=_chat("What is rain?"), max_tokens=2, temperature=0.0)
    hits = _hits(eng)
    on = eng.generate(**kwargs)
    assert _hits(eng) > hits, "the backtracking request reused no prefix"
    assert sum(1 for a in on.actions if type(a).__name__ == "Backtrack") == 2
    _same_results(on, off)
    # the next turn of that conversation starts with every block the request wrote — the ones it
    # erased and wrote again included; a wrong block would change its output
    follow = list(on.prompt_ids) + list(on.sequence_ids) + eng.encode("Thanks!")[:4]
    off2 = eng.generate(input_ids=follow, max_tokens=NEW_TOKENS, temperature=0.0, prefix_cache=False)
    hits = _hits(eng)
    on2 = eng.generate(input_ids=follow, max_tokens=NEW_TOKENS, temperature=0.0)
    assert _hits(eng) - hits > len(on.prompt_ids), "the follow-up did not reuse the generated blocks"
    _same_results(on2, off2)
    assert _idle_blocks(eng) == 0


def test_candidates_share_their_prompt_and_equal_uncached_candidates(eng):
    kwargs = dict(messages=_chat("Give me a name for a red kite."), n=3, seed=5, temperature=0.9, max_tokens=8)
    off = eng.candidates(**kwargs, prefix_cache=False)
    eng.generate(messages=kwargs["messages"], max_tokens=1, temperature=0.0)  # caches the prompt
    hits = _hits(eng)
    on = eng.candidates(**kwargs)
    assert _hits(eng) > hits
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    _close([c.log_prob for c in on], [c.log_prob for c in off], "candidate log-probs")
    assert len({tuple(c.token_ids) for c in on}) > 1, "the seeds drew one candidate: nothing was compared"
    assert _idle_blocks(eng) == 0


def _sae_engine(base, tmp_path):
    from engine import Engine

    cfg = base.config
    cfg = dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp_path / "sae.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode="inline"))
    return Engine(cfg, backend=base.backend)


def _prompt_rows(e, request_id):
    e.flush()
    return e.store.cursor().execute(
        "SELECT step, token_position, token_id, feature_id, activation_value, rank FROM activations "
        "WHERE request_id = ? ORDER BY step, token_position, rank", [request_id]).fetchall()


def test_sae_rows_and_steering_are_the_same_with_a_hit(eng, tmp_path):
    question = "What do bees do in winter?"
    with _sae_engine(eng, tmp_path) as sae:
        off = sae.generate(messages=_chat(question), max_tokens=6, temperature=0.0, request_id="off",
                           prefix_cache=False)
        sae.generate(messages=_chat("Why is ice slippery?"), max_tokens=2, temperature=0.0)
        hits = _hits(sae)
        on = sae.generate(messages=_chat(question), max_tokens=6, temperature=0.0, request_id="on")
        assert _hits(sae) - hits >= len(on.prompt_ids) // 2
        _same_results(on, off)
        rows_on, rows_off = _prompt_rows(sae, "on"), _prompt_rows(sae, "off")
        assert {r[1] for r in rows_on if r[0] == 0} == set(range(1, len(on.prompt_ids))), "a prompt row is missing"
        assert [r[:4] + (r[5],) for r in rows_on] == [r[:4] + (r[5],) for r in rows_off]
        _close([r[4] for r in rows_on], [r[4] for r in rows_off], "stored activation values")

        # steering: the steered request reuses the unsteered system prompt, and equals its uncached run
        feature = int(on.events[0].sae_features.ids[-1, 0])
        steer = dict(messages=_chat(question), max_tokens=8, temperature=0.0, mods=[steer_toward(feature, STEER)])
        steered_off = sae.generate(**steer, prefix_cache=False)
        hits = _hits(sae)
        steered_on = sae.generate(**steer)
        assert _hits(sae) > hits
        _same_results(steered_on, steered_off)
        # what was fed under the steer is never cached: a plain request reading the steered
        # request's tokens equals its uncached run (steered keys/values would change it)
        follow = list(steered_on.prompt_ids) + list(steered_on.sequence_ids)
        plain_off = sae.generate(input_ids=follow, max_tokens=4, temperature=0.0, prefix_cache=False)
        hits = _hits(sae)
        plain_on = sae.generate(input_ids=follow, max_tokens=4, temperature=0.0)
        assert _hits(sae) - hits > 0
        _same_results(plain_on, plain_off)
    assert _idle_blocks(eng) == 0


def test_steering_changes_the_text_positive_control(eng, tmp_path):
    """The steer above is strong enough to matter: without it the tokens differ."""
    with _sae_engine(eng, tmp_path) as sae:
        plain = sae.generate(messages=_chat("What do bees do in winter?"), max_tokens=8, temperature=0.0)
        feature = int(plain.events[0].sae_features.ids[-1, 0])
        steered = sae.generate(messages=_chat("What do bees do in winter?"), max_tokens=8, temperature=0.0,
                               mods=[steer_toward(feature, STEER)])
    assert steered.sequence_ids != plain.sequence_ids


@pytest.fixture(scope="module")
def chunked():
    """Steps feed at most 16 tokens: a long prompt is prefilled over many steps."""
    from engine import Engine

    with Engine(_config(max_step_tokens=16, kv_block_size=BLOCK)) as e:
        yield e


def test_a_request_arriving_while_the_prefix_is_prefilled_reuses_the_blocks_done(chunked):
    system = SYSTEM.replace("tutor", "guide") + " " + SYSTEM.replace("tutor", "coach")
    first_ids = chunked.encode(messages=_chat("What is a shadow?", system))
    second_ids = chunked.encode(messages=_chat("Why do we yawn?", system))
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    assert shared > 6 * 16, "the shared prefix must take several chunks"
    run = dict(max_tokens=NEW_TOKENS, temperature=0.0)
    first_off = chunked.generate(input_ids=first_ids, **run, prefix_cache=False)
    second_off = chunked.generate(input_ids=second_ids, **run, prefix_cache=False)

    cached_before = chunked.cache_stats()["blocks_cached"]
    handles: dict[str, object] = {}
    submitted, first_prefilled = threading.Event(), threading.Event()
    arrived_mid_prefill: list[bool] = []

    def on_neighbour_event(event):  # on the loop thread, once per neighbour step
        blocks = chunked.cache_stats()["blocks_cached"] - cached_before
        if isinstance(event, ForwardPass) and blocks >= 3 and not submitted.is_set():
            arrived_mid_prefill.append(not first_prefilled.is_set())
            handles["second"] = chunked.submit(input_ids=second_ids, **run, block=False)
            submitted.set()

    def on_first_event(event):
        if isinstance(event, Prefilled):
            first_prefilled.set()

    # a neighbour decodes one token per step (uncached, so only the first request's blocks count)
    neighbour = chunked.submit("Count from one to a hundred.", max_tokens=200, temperature=0.0, ignore_eos=True,
                               prefix_cache=False, on_event=on_neighbour_event)
    hits = _hits(chunked)
    first = chunked.submit(input_ids=first_ids, **run, on_event=on_first_event)
    first_on = first.result(timeout=600)
    assert submitted.wait(600)
    second_on = handles["second"].result(timeout=600)
    neighbour.cancel()
    assert neighbour.result(timeout=600).finish_reason is FinishReason.CANCELLED
    assert arrived_mid_prefill == [True], "the second request arrived after the first one's prefill"
    hit = _hits(chunked) - hits
    # it reuses at least the blocks finished when it arrived, and at most the shared prefix (it
    # looks up when its own first chunk is due, by which time more may be finished)
    assert BLOCK * 3 <= hit <= shared, f"the second request reused {hit} of {shared} shared tokens"
    _same_results(first_on, first_off)
    _same_results(second_on, second_off)
    assert _idle_blocks(chunked) == 0


@pytest.fixture(scope="module")
def small_pool():
    """A pool of 20 blocks of 16 tokens (320 tokens) for four batch places."""
    from engine import Engine

    with Engine(_config(kv_cache_tokens=320, max_batch=4)) as e:
        yield e


def test_a_small_pool_admits_by_reserved_tokens_evicts_cached_blocks_and_keeps_every_request_right(small_pool):
    systems = [SYSTEM, SYSTEM.replace("tutor", "coach"), SYSTEM.replace("tutor", "librarian")]
    questions = ["What is a magnet?", "Why is the sea salty?", "How do plants drink?", "What is an echo?"]
    run = dict(max_tokens=6, temperature=0.0)
    requests = [_chat(q, s) for s in systems for q in questions[:2]] + [_chat(q, systems[0]) for q in questions[2:]]
    off = [small_pool.generate(messages=m, **run, prefix_cache=False) for m in requests]
    need = len(off[0].prompt_ids) + run["max_tokens"]
    per_request = -(-need // 16)
    assert 2 * per_request <= 20 < 4 * per_request, "the pool must hold two to three requests, not four"

    waits = small_pool.loop.stats.waits_for_blocks
    with small_pool.loop.admission_held():  # all at once: more than the pool's reservations hold
        handles = [small_pool.submit(messages=m, **run) for m in requests]
    on = [h.result(timeout=900) for h in handles]
    stats = small_pool.cache_stats()
    assert small_pool.loop.stats.waits_for_blocks > waits, "no request waited for blocks"
    assert small_pool.loop.stats.max_active < 4, "the batch was not limited by the tokens in use"
    assert stats["evictions"] > 0, "the small pool never evicted a cached block"
    assert stats["hit_tokens"] > 0
    for a, b in zip(on, off):
        _same_results(a, b)
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == stats["blocks_total"] == 20


def test_static_decode_reads_reused_blocks_through_its_block_tables():
    """The static-buffer decode (the CUDA-graph path, run here without capture) reads each row's
    blocks through the block tables it is handed each step, reused prefix blocks included."""
    from engine import Engine

    with Engine(_config(graph_decode="static", max_sequence=512, max_batch=4, kv_block_size=BLOCK)) as e:
        question = "Why does bread rise?"
        off = e.generate(messages=_chat(question), max_tokens=NEW_TOKENS, temperature=0.0, prefix_cache=False)
        e.generate(messages=_chat("What is a comet?"), max_tokens=2, temperature=0.0)
        steps, hits = e.backend.graph_stats["static_steps"], _hits(e)
        on = e.generate(messages=_chat(question), max_tokens=NEW_TOKENS, temperature=0.0)
        assert e.backend.graph_stats["static_steps"] > steps, "the static path never ran"
        assert _hits(e) > hits
        _same_results(on, off)
        assert _idle_blocks(e) == 0


def test_the_prefix_bench_runs_small_and_reports_reuse(eng):
    """``raylens bench --prefix`` at toy sizes: its rows exist and the cached runs reused tokens
    (no timing is asserted)."""
    from pipelines.bench.prefix_cache import measure_prefix_ttft, measure_shared_system_prompt

    ttft = measure_prefix_ttft(eng, prefix_tokens=40, suffix_tokens=6, repeats=1)
    assert ttft["reused_tokens"] == [40 // BLOCK * BLOCK] and ttft["ratio"] > 0
    chats = measure_shared_system_prompt(eng, requests=3, system_tokens=40, new_tokens=2)
    assert chats["off"]["reused_tokens"] == 0 and chats["on_cached"]["reused_tokens"] >= 3 * (40 // BLOCK) * BLOCK
    assert chats["off"]["generated_tokens"] == chats["on_cached"]["generated_tokens"] == 3 * 2
    assert _idle_blocks(eng) == 0


def test_the_cached_rows_stay_within_their_budget_and_a_hit_after_evictions_is_still_right():
    """``prefix_cache_rows_mb`` bounds the attention and hidden rows cached blocks keep: prompts
    whose rows pass it evict older prefixes (tail first), and what stays cached is reused exactly."""
    from engine import Engine

    with Engine(_config(prefix_cache_rows_mb=1, max_batch=2)) as e:
        budget = e.cache_stats()["cached_rows_budget_bytes"]
        assert budget == 2**20
        systems = [SYSTEM + " " + SYSTEM.replace("tutor", role) for role in ("coach", "librarian", "pilot")]
        for system in systems:
            e.generate(messages=_chat("What is a magnet?", system), max_tokens=2, temperature=0.0)
            stats = e.cache_stats()
            assert 0 < stats["cached_rows_bytes"] <= budget, stats
        assert stats["evictions"] > 0, "three prompts' rows fit one MiB: make them longer"
        hits = _hits(e)
        on = e.generate(messages=_chat("Why is the sea salty?", systems[-1]), max_tokens=NEW_TOKENS, temperature=0.0)
        assert _hits(e) > hits, "the newest prompt's head was not kept"
        off = e.generate(messages=_chat("Why is the sea salty?", systems[-1]), max_tokens=NEW_TOKENS, temperature=0.0,
                         prefix_cache=False)
        _same_results(on, off)
        assert e.cache_stats()["cached_rows_bytes"] <= budget
