"""A payload's top tokens cost a log-softmax and a top-k over the vocabulary on every step, so a
request's forwards compute them only when its payload will list them: when the engine sends
payloads (an ingest URL), or when the request or the config asks (``payload_top_tokens``). Not
computing them changes nothing else: the same tokens, events and internals."""

from __future__ import annotations

import dataclasses

import pytest

from engine import Engine
from engine.config.sections import GenerationConfig
from engine.core.inputs import GenerationRequest
from engine.errors import ConfigError, InvalidRequestError
from mods import ForwardPass, mod
from tests.helpers import build_config

PROMPTS = ["Name a colour.", "Count to three.", "Say hello."]


@mod
def _halving(event, actions, tokenizer):
    """A logits mod (the README's shape): reads the logits, hands back changed ones."""
    if isinstance(event, ForwardPass):
        logits = event.logits.to_numpy()
        return actions.adjust_logits(type(event.logits).from_numpy(logits * 0.5))
    return None


def _batch(engine, top_tokens):
    rows = []
    runner = engine.loop.runner
    execute = runner.execute

    def watched(batch):
        rows.extend(batch.rows)
        return execute(batch)

    runner.execute = watched
    try:
        with engine.loop.admission_held():  # one batch: the same rows each run
            handles = [engine.submit(p, max_tokens=5, temperature=0.0, payload_top_tokens=top_tokens,
                                     mods=[_halving] if i == 1 else None) for i, p in enumerate(PROMPTS)]
        return [h.result(timeout=300) for h in handles], rows
    finally:
        del runner.execute  # the instance's patch: the class's method again


def _forward_records(result):
    return [e for e in result.payload["events"] if e["event_type"] == "ForwardPass"]


def test_a_payload_nothing_sends_lists_no_top_tokens_and_its_forwards_compute_none(engine):
    assert engine.config.ingest.url is None and engine.config.generation.payload_top_tokens is None
    plain, plain_rows = _batch(engine, None)
    listed, listed_rows = _batch(engine, True)
    # no forward computed them, for the mod-free rows nor for the row lent to its one mod in place
    assert plain_rows and not any(r.top for r in plain_rows)
    assert listed_rows and all(r.top for r in listed_rows)
    for a, b in zip(plain, listed):
        assert a.sequence_ids == b.sequence_ids  # greedy draws read the logits themselves
        assert [type(e).__name__ for e in a.events] == [type(e).__name__ for e in b.events]
        assert all("top_tokens" not in record for record in _forward_records(a))
        records = _forward_records(b)
        assert records and all(len(record["top_tokens"]) == 20 for record in records)
        assert records[0]["top_tokens"][0]["logprob"] <= 0.0


def test_the_default_follows_whether_the_engine_sends_payloads(engine, tmp_path):
    cfg = build_config()
    request = GenerationRequest(prompt="Hello", max_tokens=2)
    assert engine.processor.process(request).payload_top_tokens is False
    assert engine.processor.process(request.replace(payload_top_tokens=True)).payload_top_tokens is True
    sending = dataclasses.replace(cfg, ingest=dataclasses.replace(cfg.ingest, url="http://127.0.0.1:9/v1/ingest",
                                                                  spool_dir=str(tmp_path / "spool")))
    for generation, asked, expected in [(None, None, True), (None, False, False), (False, None, False),
                                        (False, True, True)]:
        config = dataclasses.replace(sending, generation=dataclasses.replace(cfg.generation,
                                                                            payload_top_tokens=generation))
        sender = Engine(config, backend=engine.backend)  # shares the loaded model; sends nothing here
        try:
            processed = sender.processor.process(request.replace(payload_top_tokens=asked))
            assert processed.payload_top_tokens is expected, (generation, asked)
        finally:
            sender.close()


def test_a_bad_value_is_refused_with_the_setting_named():
    with pytest.raises(ConfigError, match="payload_top_tokens"):
        GenerationConfig(payload_top_tokens="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="payload_top_tokens"):
        GenerationRequest(prompt="Hello", payload_top_tokens=1)  # type: ignore[arg-type]


def test_the_generator_actors_engine_lists_them_when_the_cluster_sends_payloads():
    """The actor's own engine sends nothing (its IngestActor does): the cluster's ingest URL decides."""
    from actors.generator import local_engine_config

    cfg = build_config()
    sending = dataclasses.replace(cfg, ingest=dataclasses.replace(cfg.ingest, url="http://127.0.0.1:9/v1/ingest"))
    assert local_engine_config(cfg).generation.payload_top_tokens is False
    inner = local_engine_config(sending)
    assert inner.ingest.url is None and inner.generation.payload_top_tokens is True
    never = dataclasses.replace(sending, generation=dataclasses.replace(cfg.generation, payload_top_tokens=False))
    assert local_engine_config(never).generation.payload_top_tokens is False
