"""SAE features that mods can act on, on the embedded model and its committed SAE.

Inline mode encodes each forward before its events are dispatched: ``ForwardPass.sae_features``
(newest token) and ``Prefilled.sae_features`` (every prompt token) are the same numbers the store
keeps for that step. The feature helpers and ``Steer`` are checked against mod-free runs
(positive controls) and against their neighbours in a batch (isolation).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.core.result import FinishReason
from mods import ForwardPass, Prefilled, mod
from mods.features import backtrack_when, ban_tokens_while, force_tokens_when, steer_toward, top_features
from tests.helpers import assert_payload_valid, build_config

PROMPT = "Tell me about the ocean and the ships that sail on it."
MAX_TOKENS = 12


def _sae_engine(engine, tmp_path, mode):
    from engine import Engine

    cfg = build_config()
    cfg = dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp_path / f"{mode}.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode=mode))
    return Engine(cfg, backend=engine.backend)


@pytest.fixture(scope="module")
def inline(engine, tmp_path_factory):
    with _sae_engine(engine, tmp_path_factory.mktemp("inline"), "inline") as eng:
        yield eng


@pytest.fixture(scope="module")
def plain_run(inline):
    return inline.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, request_id="plain")


def _firing(run, step):
    """(feature id, value) of the strongest feature on the ForwardPass of ``step``."""
    event = next(e for e in run.events if isinstance(e, ForwardPass) and e.step == step)
    (feature, value), *_ = top_features(event, 1)
    return feature, value


def test_features_ride_on_events_only_in_inline_mode_and_match_the_stored_rows(engine, inline, plain_run,
                                                                                  tmp_path):
    with _sae_engine(engine, tmp_path, "nearline") as nearline:
        result = nearline.generate(PROMPT, max_tokens=4, temperature=0.0)
    assert all(getattr(e, "sae_features", None) is None for e in result.events), "nearline events carry features"

    k = inline.config.sae.top_k
    pre = plain_run.events[0]
    assert isinstance(pre, Prefilled)
    assert pre.sae_features.ids.shape == (len(plain_run.prompt_ids), k) == pre.sae_features.values.shape
    assert pre.sae_features.ids.dtype == np.int64 and pre.sae_features.values.dtype == np.float32
    inline.flush()
    cur = inline.store.cursor()
    forwards = [e for e in plain_run.events if isinstance(e, ForwardPass)]
    assert forwards and all(e.sae_features.ids.shape == (k,) for e in forwards)
    for event in forwards:
        position = len(event.input_ids) - 1
        rows = cur.execute("SELECT feature_id, activation_value FROM activations WHERE request_id = 'plain' "
                           "AND step = ? AND token_position = ? ORDER BY rank", [event.step, position]).fetchall()
        active = event.sae_features.values > 0
        assert [r[0] for r in rows] == event.sae_features.ids[active].tolist(), f"step {event.step}"
        np.testing.assert_allclose([r[1] for r in rows], event.sae_features.values[active], rtol=1e-5, atol=1e-5)
        assert list(event.sae_features.values) == sorted(event.sae_features.values, reverse=True)
    assert event.sae_features.release == inline.recorder.encoder.identity.release


def test_ban_tokens_while_a_feature_fires_changes_the_token_at_that_step(inline, plain_run):
    step = 4
    feature, value = _firing(plain_run, step)
    token = plain_run.sequence_ids[step]
    banned = inline.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                             mods=[ban_tokens_while(feature, value / 2, [token])])
    assert banned.sequence_ids[:step] == plain_run.sequence_ids[:step]
    assert banned.sequence_ids[step] != token, "the banned token was still generated while its feature fired"


def test_force_tokens_when_a_feature_fires_inserts_the_chunk_there(inline, plain_run):
    step = 3
    feature, value = _firing(plain_run, step)
    chunk = inline.tokenizer.encode(" Indeed,", add_special_tokens=False)
    forced = inline.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                             mods=[force_tokens_when(feature, value / 2, chunk)])
    first = next(e.step for e in forced.events if isinstance(e, ForwardPass) and e.sae_features.value_of(feature)
                 > value / 2)
    assert first <= step
    assert forced.sequence_ids[first:first + len(chunk)] == chunk


def test_backtrack_when_a_feature_fires_erases_and_bans_the_token_that_led_there(inline, plain_run):
    step = 5
    feature, value = _firing(plain_run, step)
    guarded = inline.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                              mods=[backtrack_when(feature, value * 0.9, n=1, max_times=2)])
    backtracks = [a for a in guarded.payload["actions"] if a["action_type"] == "Backtrack"]
    assert backtracks, "the feature fired but no Backtrack was applied"
    assert guarded.sequence_ids != plain_run.sequence_ids
    assert_payload_valid(guarded.payload)


def test_steer_with_scale_zero_changes_nothing_and_a_large_scale_changes_the_text(inline, plain_run):
    feature, _ = _firing(plain_run, 2)
    zero = inline.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, mods=[steer_toward(feature, 0.0)])
    assert zero.sequence_ids == plain_run.sequence_ids
    strong = inline.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, mods=[steer_toward(feature, 200.0)])
    assert strong.sequence_ids != plain_run.sequence_ids
    logs = [entry["log_message"] for entry in strong.payload["mod_logs"]]
    assert any(f"Steer feature_id={feature} scale=200.0" in m for m in logs), logs
    assert all(a["action_type"] != "Steer" for a in strong.payload["actions"])  # never an unknown action type
    assert_payload_valid(strong.payload)
    assert strong.metadata["steers"] == [{"step": 0, "feature_id": feature, "scale": 200.0}]


def test_steering_one_request_of_a_batch_leaves_its_neighbours_unchanged(inline, plain_run):
    feature, _ = _firing(plain_run, 2)
    others = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain."]
    alone = [inline.generate(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in others]
    handles = [inline.submit(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in others[:2]]
    steered = inline.submit(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, mods=[steer_toward(feature, 200.0)])
    handles.append(inline.submit(others[2], max_tokens=MAX_TOKENS, temperature=0.0))
    assert steered.result(timeout=300).sequence_ids != plain_run.sequence_ids
    for handle, reference in zip(handles, alone):
        assert handle.result(timeout=300).sequence_ids == reference.sequence_ids


def test_a_bad_steer_ends_only_its_request(inline):
    @mod
    def bad(event, actions, tokenizer):
        if isinstance(event, ForwardPass) and event.step == 1:
            return actions.steer(10**9, 1.0)
        return None

    result = inline.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, mods=[bad])
    assert result.finish_reason is FinishReason.ERROR and "Steer.feature_id" in result.error


def test_steer_without_an_sae_is_a_clear_error(engine):
    result = engine.generate(PROMPT, max_tokens=4, temperature=0.0, mods=[steer_toward(1, 1.0)])
    assert result.finish_reason is FinishReason.ERROR and "needs the engine's SAE" in result.error
