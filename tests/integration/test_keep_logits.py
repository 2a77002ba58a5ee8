"""``keep_logits``: a result's ForwardPass events (and applied AdjustedLogits) keep their step's
logits only when asked. Kept, each step's whole batch of logits (rows x vocabulary floats) stays
alive until the batch's results are dropped; released, mods and listeners still read them live,
and a later read is a clear error naming the switch."""

from __future__ import annotations

import gc
import pickle
import weakref

import numpy as np
import pytest

from engine.errors import LogitsNotKeptError
from mods import ForwardPass, mod
from mods.types import AdjustedLogits

PROMPTS = ["Name a colour.", "Count to three.", "Say hello."]


def _banning_mod(seen: list[float]):
    @mod
    def ban_and_note(event, actions, tokenizer):
        if isinstance(event, ForwardPass):
            logits = event.logits.to_numpy()  # live, during the step, whatever keep_logits says
            seen.append(float(logits.max()))
            logits[0, int(logits.argmax())] = -1e9  # never the greedy choice
            return actions.adjust_logits(type(event.logits).from_numpy(logits))
        return None

    return ban_and_note


def _run(engine, keep: bool, mods=None, n: int = 3, max_tokens: int = 4, top_tokens: bool | None = None):
    handles = [engine.submit(p, max_tokens=max_tokens, temperature=0.0, keep_logits=keep,
                             mods=mods(i) if mods else None, payload_top_tokens=top_tokens)
               for i, p in enumerate(PROMPTS[:n])]
    return [h.result(timeout=300) for h in handles]


def test_released_logits_read_live_same_tokens_and_a_clear_error_after(engine):
    seen = {True: [[] for _ in PROMPTS], False: [[] for _ in PROMPTS]}
    results = {keep: _run(engine, keep, mods=lambda i, keep=keep: [_banning_mod(seen[keep][i])]) for keep in (True, False)}
    vocab = engine.backend.info.vocab_size
    for kept, released, seen_kept, seen_released in zip(results[True], results[False], seen[True], seen[False]):
        assert released.sequence_ids == kept.sequence_ids  # the mod acted the same on live logits
        assert len(seen_released) == len(seen_kept) == 4
        np.testing.assert_allclose(seen_released, seen_kept, atol=1e-3)  # batched forwards: float32 noise
        forwards = [e for e in released.events if isinstance(e, ForwardPass)]
        assert len(forwards) == 4
        for event, twin in zip(forwards, [e for e in kept.events if isinstance(e, ForwardPass)]):
            assert event.logits.shape == (1, vocab) and event.step == twin.step
            with pytest.raises(LogitsNotKeptError, match="keep_logits=True"):
                event.logits.to_numpy()
            np.testing.assert_allclose(event.hidden_states.to_numpy(), twin.hidden_states.to_numpy(), atol=1e-3)
            assert float(twin.logits.to_numpy().max()) in seen_kept  # kept: readable after the fact
        adjusted = [a for a in released.actions if isinstance(a, AdjustedLogits)]
        assert len(adjusted) == 4 and all(a._source == "ban_and_note" for a in adjusted)
        with pytest.raises(LogitsNotKeptError):
            adjusted[0].logits.to_numpy()
        assert [a for a in kept.actions if isinstance(a, AdjustedLogits)][0].logits.to_numpy().shape == (1, vocab)
        portable = pickle.loads(pickle.dumps(released.portable()))  # what a GeneratorActor sends back
        assert portable.actions[0].logits.shape == (1, vocab)
        # a step's released ForwardPass and AdjustedLogits share one marker (as every request's of
        # that step do): a request keeps no object per step it does not need
        assert all(action.logits is event.logits for action, event in zip(adjusted, forwards))
    first = [[e.logits for e in r.events if isinstance(e, ForwardPass)] for r in results[False]]
    assert all(a is b for a, b in zip(first[0], first[1]))


def test_the_first_step_after_prefill_and_a_request_without_mods_release_too(engine):
    (result,) = _run(engine, False, n=1, max_tokens=3, top_tokens=True)
    forwards = [e for e in result.events if isinstance(e, ForwardPass)]
    assert [e.step for e in forwards] == [0, 1, 2]
    for event in forwards:
        with pytest.raises(LogitsNotKeptError, match="step"):
            np.asarray(event.logits)
    assert result.payload["events"][1]["top_tokens"], "the payload's top log-probs are computed in the step"


@pytest.mark.parametrize("with_mod", [False, True], ids=["mod-free", "logits mod"])
def test_each_steps_batch_logits_are_freed_unless_kept(engine, with_mod):
    """The forward's ``(B, V)`` logits of every step: alive while the results are held when kept,
    freed when not (at most the newest one may still be referenced by the engine)."""
    backend = engine.backend
    inner = backend.execute
    for keep in (True, False):
        alive: list[weakref.ref] = []

        def recording(batch, inner=inner, alive=alive):
            out = inner(batch)
            alive.append(weakref.ref(out.logits))
            return out

        backend.execute = recording
        try:
            results = _run(engine, keep, mods=(lambda i: [_banning_mod([])]) if with_mod else None, max_tokens=6)
        finally:
            del backend.execute
        gc.collect()
        living = sum(ref() is not None for ref in alive)
        assert len(alive) >= 6
        if keep:
            assert living >= 6, f"kept logits were freed ({living} of {len(alive)} alive)"
        else:
            assert living <= 1, f"{living} of {len(alive)} steps' logits still alive with keep_logits off"
        del results
