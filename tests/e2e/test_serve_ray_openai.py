"""The OpenAI routes that need more than a generation stream, under ``raylens serve`` on a loopback
Ray head: prompt scoring (completions ``echo`` + ``logprobs``), embeddings and captures run in the
shared GeneratorActor (``score``, ``embed_tokens``, ``capture``) through the replica's
RemoteEngine, and equal the in-process engine on the same weights; ``n`` choices run there too."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.e2e.test_serve_ray import served  # noqa: F401  (the module's deployment, reused)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"


def test_scoring_embeddings_captures_and_n_run_in_the_generator_actor(served, engine):  # noqa: F811
    import openai

    url, config, _ = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        scored = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        vectors = client.embeddings.create(model=model, input=["The cat sat.", "a"], encoding_format="float")
        captured = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={
            "raylens": {"capture": {"names": ["blocks.1.hook_resid_post"], "start": 0}}})
        several = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=1.0, n=2, seed=5)

    expected = engine.score(engine.tokenizer(PROMPT)["input_ids"], top_k=2)
    got = scored.choices[0].logprobs
    assert got.token_logprobs[0] is None
    assert got.token_logprobs[1:] == pytest.approx(list(expected.logprobs[1:]), rel=1e-4, abs=1e-5)
    assert scored.choices[0].text == PROMPT

    reference = engine.embed(["The cat sat.", "a"])
    got_vectors = np.asarray([d.embedding for d in vectors.data], dtype=np.float32)
    assert np.abs(got_vectors - reference).max() <= 1e-5 * np.abs(reference).max()

    info = captured.choices[0].model_extra["raylens"]["captures"]
    sequence = info["token_ids"]
    assert sequence[: len(engine.tokenizer(PROMPT)["input_ids"])] == engine.tokenizer(PROMPT)["input_ids"]
    tensor = info["tensors"]["blocks.1.hook_resid_post"]
    array = np.frombuffer(base64.b64decode(tensor["data"]), dtype="<f4").reshape(tensor["shape"])
    local = engine.capture(input_ids=sequence, names=["blocks.1.hook_resid_post"])["blocks.1.hook_resid_post"]
    np.testing.assert_allclose(array, local.float().numpy(), rtol=1e-4, atol=1e-5 * float(local.abs().max()))

    assert [c.index for c in several.choices] == [0, 1]
