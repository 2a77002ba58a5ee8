"""Continuous batching on the embedded model: many requests share one step loop, each exactly as
if it ran alone.

The reference is always the same engine running one request at a time (differential), and every
mod test compares with the mod-free output (positive control). Requests join while others are
mid-generation: later ones are submitted only after the first ones have streamed tokens.
"""

from __future__ import annotations

import threading

import pytest

from engine.core.result import FinishReason
from engine.core.stream import TokenEvent
from mods import Added, ForwardPass, Sampled, mod
from tests.helpers import TEST_MODS, assert_payload_valid, build_config

PROMPTS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence why the sky is blue, as if to a small child who keeps asking why.",
    "2+2=",
    "Name a colour.",
    "Translate 'good morning' into German and say which words you used.",
    "What is a lighthouse for?",
]
MAX_TOKENS = 12


def _alone(engine, prompts, **kw):
    return [engine.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, **kw) for p in prompts]


def _wait_for_tokens(handle, n):
    """Consume ``handle``'s stream until ``n`` tokens were committed (or it ended)."""
    seen = 0
    for event in handle:
        if isinstance(event, TokenEvent):
            seen += len(event.token_ids)
            if seen >= n:
                return


@pytest.fixture(scope="module")
def sequential(engine):
    return _alone(engine, PROMPTS)


def test_batched_greedy_outputs_equal_one_at_a_time_with_requests_joining_mid_flight(engine, sequential):
    first = [engine.submit(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in PROMPTS[:4]]
    _wait_for_tokens(first[0], 3)  # the first requests are mid-generation when the rest join
    rest = [engine.submit(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in PROMPTS[4:]]
    results = [h.result(timeout=300) for h in first + rest]
    for prompt, alone, batched in zip(PROMPTS, sequential, results):
        assert batched.output_ids == alone.output_ids, f"{prompt!r}: batched output differs from the lone run"
        assert_payload_valid(batched.payload)
    assert engine.loop.stats.max_active >= 5, "the requests never shared a step"


def test_concurrent_generate_calls_from_threads_share_the_loop(engine, sequential):
    results: dict[int, object] = {}

    def worker(i):
        results[i] = engine.generate(PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0.0)

    before = engine.loop.stats.steps
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [results[i].output_ids for i in range(len(PROMPTS))] == [r.output_ids for r in sequential]
    steps = engine.loop.stats.steps - before
    tokens = sum(len(r.sequence_ids) for r in results.values())
    assert steps < tokens, f"{steps} steps for {tokens} tokens: the threads did not batch"


@mod
def force_then_backtrack(event, actions, tokenizer):
    if isinstance(event, ForwardPass) and event.step == 1:
        return actions.force_tokens(tokenizer.encode(" Paris, of course", add_special_tokens=False))
    if isinstance(event, Added) and event.step == 4:
        return actions.backtrack(steps=2, tokens=tokenizer.encode(" indeed", add_special_tokens=False))
    return None


@mod
def ban_top_token(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        logits = event.logits.to_numpy()
        logits[0, logits[0].argmax()] = -1e9
        return actions.adjust_logits(type(event.logits).from_numpy(logits))
    return None


@mod
def force_output(event, actions, tokenizer):
    if isinstance(event, Sampled) and event.step == 2:
        return actions.force_output(tokenizer.encode("done.", add_special_tokens=False))
    return None


@mod
def emit_error(event, actions, tokenizer):
    if isinstance(event, ForwardPass) and event.step == 3:
        return actions.emit_error("stopped by the mod")
    return None


@pytest.mark.parametrize("the_mod", [force_then_backtrack, ban_top_token, force_output, emit_error],
                         ids=lambda m: m.__name__)
def test_a_mod_in_one_request_leaves_its_neighbours_unchanged(engine, sequential, the_mod):
    target = 2
    handles = [engine.submit(p, max_tokens=MAX_TOKENS, temperature=0.0,
                             mods=[the_mod] if i == target else None) for i, p in enumerate(PROMPTS[:6])]
    results = [h.result(timeout=300) for h in handles]
    modded_alone = engine.generate(PROMPTS[target], max_tokens=MAX_TOKENS, temperature=0.0, mods=[the_mod])
    assert results[target].output_ids == modded_alone.output_ids, "the modded request depends on its neighbours"
    assert results[target].output_ids != sequential[target].output_ids, "positive control: the mod changed nothing"
    for i, (alone, batched) in enumerate(zip(sequential[:6], results)):
        if i != target:
            assert batched.output_ids == alone.output_ids, f"request {i} changed because request {target} had a mod"


def test_legacy_test_mods_run_unchanged_while_other_requests_run(engine):
    mod_files = sorted((TEST_MODS / "forward_pass").glob("*.py"))[:3] + sorted((TEST_MODS / "added").glob("*.py"))[:3]
    assert mod_files, "the legacy-style test mods are missing"
    alone = {f.name: engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, mods=[str(f)])
             for f in mod_files}
    background = [engine.submit(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in PROMPTS[1:4]]
    handles = {f.name: engine.submit(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, mods=[str(f)])
               for f in mod_files}
    for name, handle in handles.items():
        result = handle.result(timeout=300)
        assert result.output_ids == alone[name].output_ids, f"legacy mod {name} behaved differently in a batch"
        assert result.finish_reason == alone[name].finish_reason
    for handle in background:
        handle.result(timeout=300)


def test_seeded_sampling_is_the_same_whatever_else_is_in_the_batch(engine):
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=7)
    alone = engine.generate(PROMPTS[3], **kw)
    others = [engine.submit(p, max_tokens=MAX_TOKENS, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS[4:8])]
    batched = engine.submit(PROMPTS[3], **kw)
    assert batched.result(timeout=300).output_ids == alone.output_ids
    for handle in others:
        handle.result(timeout=300)
    other_seed = engine.generate(PROMPTS[3], **{**kw, "seed": 8})
    assert other_seed.output_ids != alone.output_ids, "positive control: the seed had no effect"


def test_sae_rows_of_a_batched_run_equal_the_sequential_run(engine, tmp_path):
    import dataclasses

    from engine import Engine

    def sae_engine(name):
        cfg = build_config()
        cfg = dataclasses.replace(
            cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp_path / f"{name}.db")),
            sae=dataclasses.replace(cfg.sae, enabled=True, mode="inline"))
        return Engine(cfg, backend=engine.backend)

    def rows(eng):
        return eng.store.cursor().execute(
            "SELECT request_id, step, token_position, token_id, feature_id, rank, activation_value "
            "FROM activations ORDER BY request_id, step, token_position, rank").fetchall()

    prompts = PROMPTS[:4]
    with sae_engine("sequential") as eng:
        for i, p in enumerate(prompts):
            eng.generate(p, max_tokens=8, temperature=0.0, request_id=f"r{i}")
        eng.flush()
        alone = rows(eng)
    with sae_engine("batched") as eng:
        handles = [eng.submit(p, max_tokens=8, temperature=0.0, request_id=f"r{i}") for i, p in enumerate(prompts)]
        for h in handles:
            assert_payload_valid(h.result(timeout=300).payload)
        eng.flush()
        batched = rows(eng)
    assert len(alone) > 0, "positive control: no SAE rows were stored"
    assert [r[:4] for r in batched] == [r[:4] for r in alone]  # same tokens at the same steps and positions
    same = sum(a[4] == b[4] for a, b in zip(alone, batched))
    assert same / len(alone) > 0.97, f"only {same}/{len(alone)} top-k feature ids agree between batched and sequential"
    drift = max(abs(a[6] - b[6]) for a, b in zip(alone, batched) if a[4] == b[4])
    assert drift < 1e-2, f"activation values drift by {drift} between batched and sequential"


@pytest.fixture(scope="module")
def small_engine():
    """Two batch slots and a wait queue of one: more requests than places."""
    from engine import Engine

    with Engine(build_config(max_batch=2, max_waiting=1)) as eng:
        yield eng


def test_more_requests_than_slots_all_finish_and_a_cancel_leaves_the_rest_running(small_engine):
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            results[i] = small_engine.generate(PROMPTS[i], max_tokens=6, temperature=0.0)
        except BaseException as err:  # noqa: BLE001 - collected for the assertion below
            errors.append(err)

    victim = small_engine.submit(PROMPTS[4], max_tokens=200, temperature=0.0, ignore_eos=True)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    _wait_for_tokens(victim, 2)
    victim.cancel()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sorted(results) == list(range(5)), "a request was dropped"
    assert all(r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for r in results.values())
    cancelled = victim.result(timeout=60)
    assert cancelled.finish_reason is FinishReason.CANCELLED and 2 <= len(cancelled.sequence_ids) < 200
    assert small_engine.loop.stats.waits_for_room > 0, "back-pressure never engaged: the test proved nothing"


def test_a_full_queue_refuses_a_non_blocking_submit(small_engine):
    from engine.errors import QueueFullError

    held = [small_engine.submit(PROMPTS[0], max_tokens=400, temperature=0.0, ignore_eos=True) for _ in range(3)]
    try:
        with pytest.raises(QueueFullError, match="retry later"):
            small_engine.submit(PROMPTS[1], max_tokens=4, block=False)
    finally:
        for h in held:
            h.cancel()
        for h in held:
            assert h.result(timeout=60).finish_reason is FinishReason.CANCELLED


def test_a_prompt_that_can_never_fit_fails_alone_with_a_clear_error(engine):
    from engine.errors import ContextOverflowError

    neighbour = engine.submit(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
    with pytest.raises(ContextOverflowError, match="must be shorter than"):
        engine.submit(input_ids=[1] * (engine.backend.max_sequence + 1), max_tokens=2)
    assert neighbour.result(timeout=300).finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_streamed_tokens_add_up_to_the_result(engine):
    @mod
    def rewrite(event, actions, tokenizer):
        if isinstance(event, Added) and event.step == 3 and not event.forced:
            return actions.backtrack(steps=2, tokens=tokenizer.encode(" so", add_special_tokens=False))
        return None

    handle = engine.submit(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, mods=[rewrite], top_logprobs=3)
    streamed: list[int] = []
    for event in handle:
        if isinstance(event, TokenEvent):
            streamed.extend(event.token_ids)
            if not event.forced:
                assert event.logprobs[0] is not None and event.logprobs[0] <= 0
                assert len(event.top_logprobs[0]) == 3
        else:
            del streamed[len(streamed) - event.n:]
    result = handle.result(timeout=60)
    assert streamed == result.sequence_ids
    assert len(result.token_logprobs) == len(result.sequence_ids)
