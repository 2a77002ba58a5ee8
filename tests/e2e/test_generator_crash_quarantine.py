"""What a request that crashes native code does to ``raylens serve``'s shared generator, on a
loopback Ray head of the test's own:

* a request that kills the generator's process (a mod that dereferences NULL, the stand-in for any
  native crash) gets a retryable 503 the first time — the server cannot be sure it was the cause —
  but it was running alone, so an identical retry is a 400 ``QUARANTINED`` that never reaches the
  generator, while a different request runs on the restarted generator;
* the issue's 5,000-rule grammar, with the limits raised so that it reaches the compiler, kills a
  compile child of the actor, never the actor: a 400 naming ``response_format.grammar``."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from tests.e2e.conftest import kill_namespace_actors, ray_config, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SEGV = textwrap.dedent('''
    import ctypes
    from quote_mod_sdk import Sampled, mod

    @mod
    def segv(event, actions, tokenizer):
        if isinstance(event, Sampled):
            ctypes.string_at(0)  # SIGSEGV: the generator's process dies here
''')


def _pid(actor) -> int:
    import os

    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _answers(actor) -> bool:
    try:
        _pid(actor)
        return True
    except Exception:  # still restarting
        return False


def test_a_request_that_killed_the_generator_alone_is_quarantined_and_an_identical_retry_is_a_400(
        ray_head, tmp_path):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.remote_engine import RemoteEngine
    from pipelines.serve.settings import ServeSettings

    base = ray_config(tmp_path)
    config = dataclasses.replace(base, sae=dataclasses.replace(base.sae, enabled=False))
    try:
        engine = RemoteEngine.connect(config)
        generator = engine.generators[0]
        model = engine.backend.info.model_id
        settings = ServeSettings(max_new_tokens=16, request_timeout_s=300, allow_mod_registration=True)
        with serve_in_thread(build_app(engine, settings)) as url, httpx.Client(base_url=url, timeout=300) as http:
            registered = http.post("/v1/mods", json={"name": "segv", "language": "python", "entrypoint": "segv",
                                                     "source": SEGV})
            assert registered.status_code == 200, registered.text
            body = {"model": f"{model}/segv", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            pid = _pid(generator)
            crashed = http.post("/v1/chat/completions", json=body)
            assert crashed.status_code == 503, crashed.text
            assert crashed.json()["error"]["code"] == "unavailable" and int(crashed.headers["Retry-After"]) > 0
            assert engine.quarantine.quarantined == 1

            retry = http.post("/v1/chat/completions", json=body)
            assert retry.status_code == 400, retry.text
            error = retry.json()["error"]
            assert error["code"] == "quarantined" and "running alone on a generator" in error["message"], error
            assert "Retry-After" not in retry.headers

            # the restarted generator reloads its model (meanwhile a request gets a 503: unavailable for now)
            wait_until(lambda: _answers(generator), timeout=300, what="the generator to restart")
            plain = http.post("/v1/chat/completions", json={**body, "model": model})
            assert plain.status_code == 200, plain.text
            assert plain.json()["choices"][0]["message"]["content"]
            assert _pid(generator) != pid, "the generator's process should have died and been restarted"
            assert http.get("/health").status_code == 200
    finally:
        kill_namespace_actors(config)


def test_the_5000_rule_grammar_crashes_a_compile_child_of_the_generator_actor_never_the_actor(ray_head, tmp_path):
    """The issue's crash under ``raylens serve``, where the compile runs in the shared
    GeneratorActor: with the limits raised so that the grammar reaches the compiler, it kills a
    compile child of the actor, the request is a 400 naming ``response_format.grammar``, and the
    actor's process is the same one that then answers a structured request."""
    import json

    import httpx

    from engine.config import StructuredConfig
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.remote_engine import RemoteEngine
    from pipelines.serve.settings import ServeSettings
    from tests.helpers import lark_chain

    base = ray_config(tmp_path)
    config = dataclasses.replace(base, sae=dataclasses.replace(base.sae, enabled=False),
                                 structured=StructuredConfig(max_grammar_rules=100_000, max_grammar_bytes=1_000_000))
    try:
        engine = RemoteEngine.connect(config)
        generator, model = engine.generators[0], engine.backend.info.model_id
        settings = ServeSettings(max_new_tokens=32, request_timeout_s=300)
        with serve_in_thread(build_app(engine, settings)) as url, httpx.Client(base_url=url, timeout=300) as http:
            pid = _pid(generator)
            body = {"model": model, "messages": [{"role": "user", "content": "Give me a number."}], "max_tokens": 32}
            crashed = http.post("/v1/chat/completions", json={**body, "response_format": {
                "type": "grammar", "grammar": lark_chain(5000)}})
            assert crashed.status_code == 400, crashed.text
            error = crashed.json()["error"]
            assert error["param"] == "response_format.grammar" and "crashed the grammar compiler" in error["message"]
            schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                      "additionalProperties": False}
            shaped = http.post("/v1/chat/completions", json={**body, "response_format": {
                "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
            assert shaped.status_code == 200, shaped.text
            assert isinstance(json.loads(shaped.json()["choices"][0]["message"]["content"])["n"], int)
            assert _pid(generator) == pid, "the generator's process must not have died"
            assert engine.quarantine.quarantined == 0
    finally:
        kill_namespace_actors(config)
