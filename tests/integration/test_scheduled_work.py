"""Embeddings, prompt scoring and named capture are jobs the step loop schedules
(engine/core/jobs.py): a unit per step within the step's token budget, stopped by their deadline
or their caller's cancel before the next unit, scoring over KV blocks reserved from the
scheduler's KV manager — so no such call can keep the engine busy after its caller gave up, and
none stops the streams beside it."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.errors import JobCancelledError, RequestTimeoutError
from tests.helpers import build_config

pytestmark = pytest.mark.slow
BUDGET = 32  # the module's engine feeds at most 32 tokens a step: many units from little work


@pytest.fixture(scope="module")
def eng(engine):
    """The embedded model with a small step budget, sharing the session's loaded model."""
    from engine import Engine
    from engine.model import create_backend

    backend = create_backend(build_config(max_step_tokens=BUDGET, max_batch=8).backend)
    with Engine(build_config(max_step_tokens=BUDGET, max_batch=8), backend=backend) as e:
        yield e
    backend.shutdown()


def _wait_until(done, polls: int = 400) -> None:
    """Poll ``done`` every 50 ms, at most ``polls`` times (the route notices a client that left
    within a poll of its own, the loop stops a job before its next unit)."""
    for _ in range(polls):
        if done():
            return
        threading.Event().wait(0.05)


def _texts(tokenizer, n: int, words: int) -> list[list[int]]:
    return [tokenizer.encode(" ".join(f"word{i}x{j}" for j in range(words)), add_special_tokens=False)
            for i in range(n)]


def test_a_large_embeddings_call_past_its_timeout_stops_and_frees_the_engine(eng):
    ids = _texts(eng.tokenizer, 48, 40)  # 48 texts of ~100+ tokens: one text a unit at this budget
    units = eng.loop.stats.job_units
    with pytest.raises(RequestTimeoutError, match="must finish within"):
        eng.embed_tokens(ids, timeout=0.5)
    ran = eng.loop.stats.job_units - units
    assert ran < len(ids), f"the job ran all {ran} units past its deadline"
    result = eng.generate("Say hi.", max_tokens=3, temperature=0.0)  # the loop serves at once
    assert len(result.sequence_ids) == 3
    assert eng.loop.jobs_waiting == 0 and eng.cache_stats()["blocks_used"] == 0


def test_a_cancelled_job_stops_at_its_next_unit(eng):
    ids = _texts(eng.tokenizer, 40, 40)
    started = threading.Event()
    outcome: list[BaseException] = []

    def run():
        try:
            eng.embed_tokens(ids, job_id="job-to-cancel")
        except BaseException as err:  # what the caller sees
            outcome.append(err)

    units = eng.loop.stats.job_units
    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(600):  # bounded: the first unit runs within a step
        if eng.loop.stats.job_units > units:
            started.set()
            break
        threading.Event().wait(0.05)
    assert started.is_set(), "the job never ran a unit"
    assert eng.cancel("job-to-cancel")
    thread.join(120)
    assert outcome and isinstance(outcome[0], JobCancelledError), outcome
    assert eng.loop.stats.job_units - units < len(ids), "every unit ran despite the cancel"
    assert not eng.cancel("job-to-cancel"), "a finished job is not running any more"


def test_streams_keep_stepping_beside_a_long_embeddings_job(eng):
    """One job unit per step: a request generating beside a long job finishes long before it."""
    ids = _texts(eng.tokenizer, 24, 40)
    units = eng.loop.stats.job_units
    job = threading.Thread(target=lambda: eng.embed_tokens(ids))
    job.start()
    result = eng.generate("Count to three.", max_tokens=6, temperature=0.0, ignore_eos=True)
    units_when_done = eng.loop.stats.job_units - units
    job.join(600)
    assert len(result.sequence_ids) == 6
    assert units_when_done < len(ids), (f"the stream waited for the whole job ({units_when_done} of {len(ids)} "
                                        "units ran before it finished)")


def test_scoring_is_chunked_over_reserved_kv_blocks_and_equals_one_full_forward(eng):
    ids = eng.encode("Describe, in a few careful sentences, how a bicycle's gears let a rider climb a steep hill, "
                     "why a lower gear makes each turn of the pedals easier, and what the rider gives up for it.")
    assert len(ids) > 2 * BUDGET, "positive control: the prompt needs several chunks"
    units = eng.loop.stats.job_units
    scores = eng.score(ids, top_k=3)
    assert eng.loop.stats.job_units - units >= 3
    model = eng.backend.reference_model
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, V)
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert scores.logprobs[0] is None and len(scores.logprobs) == len(ids)
    assert scores.logprobs[1:] == pytest.approx(want, abs=1e-4)
    best = logp[:-1].topk(3, dim=-1).indices.tolist()
    assert [[t for t, _ in row] for row in scores.top[1:]] == best
    assert eng.cache_stats()["blocks_used"] == 0 and eng.cache_stats()["blocks_reserved"] == 0


def test_a_capture_is_a_job_and_refuses_bad_names_before_queueing(eng):
    from engine.errors import InvalidRequestError

    units = eng.loop.stats.job_units
    tensors = eng.capture(input_ids=eng.encode("Hello there."), names=["blocks.0.hook_resid_post"])
    assert list(tensors) == ["blocks.0.hook_resid_post"] and eng.loop.stats.job_units == units + 1
    with pytest.raises(InvalidRequestError):
        eng.capture(input_ids=eng.encode("Hello there."), names=["blocks.0.not_a_hook"])
    assert eng.loop.stats.job_units == units + 1


def test_over_http_a_timed_out_embeddings_call_is_a_504_and_a_client_that_left_stops_its_job(eng):
    """``/v1/embeddings`` under ``request_timeout_s``: a call too large for it answers 504 TIMEOUT
    and its job stops; a client that gives up before that has its job cancelled (the server polls
    the connection), and the server answers the next request at once."""
    import httpx

    from tests.serve_helpers import openai_server

    texts = [" ".join(f"word{i}x{j}" for j in range(40)) for i in range(48)]
    model = eng.backend.info.model_id
    with openai_server(eng, request_timeout_s=1.0) as url:
        stopped = eng.loop.stats.jobs_stopped
        response = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": texts}, timeout=120)
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout", response.text
        _wait_until(lambda: eng.loop.stats.jobs_stopped > stopped and eng.loop.jobs_waiting == 0)
        assert eng.loop.stats.jobs_stopped == stopped + 1, "the timed-out job kept running"
    with openai_server(eng, request_timeout_s=600.0) as url:
        stopped, units = eng.loop.stats.jobs_stopped, eng.loop.stats.job_units
        with pytest.raises(httpx.ReadTimeout):  # the client leaves after half a second
            httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": texts}, timeout=0.5)
        _wait_until(lambda: eng.loop.stats.jobs_stopped > stopped and eng.loop.jobs_waiting == 0)
        assert eng.loop.stats.jobs_stopped == stopped + 1, "the job of a client that left kept running"
        assert eng.loop.stats.job_units - units < len(texts)
        small = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": "hello"}, timeout=60)
        assert small.status_code == 200 and len(small.json()["data"]) == 1
