"""One request type through every door: the same bad value gets the same typed error, naming the
same field with the same message, from Python, the CLI, a prompts file, the OpenAI route and the
attention route — because each door builds the engine's one ``GenerationRequest``."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(600)

# (field, bad value, the message every door must carry)
BAD = [
    ("top_p", 1.5, "`top_p` must be in (0, 1], got 1.5"),
    ("temperature", -0.5, "`temperature` must be >= 0 and finite (0 is greedy), got -0.5"),
    ("seed", -1, "`seed` must be >= 0 and <= 2**64 - 1 (64 bits), or null, got -1"),
]


@pytest.fixture(scope="module")
def http(engine):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread

    with serve_in_thread(build_app(engine)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_python_refuses_the_bad_value_naming_the_field(engine, field, value, message):
    from engine.core.inputs import GenerationRequest
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        engine.generate("Say hi.", max_tokens=2, **{field: value})
    assert str(err.value) == message and err.value.parameter == field
    with pytest.raises(InvalidRequestError) as built:  # the request itself, before any engine
        GenerationRequest(prompt="Say hi.", **{field: value})
    assert str(built.value) == message


@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_a_prompts_file_refuses_the_bad_value_with_the_same_message(tmp_path, field, value, message):
    from pipelines.jobs.prompts_file import InputError, read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Say hi.", field: value}) + "\n", encoding="utf-8")
    with pytest.raises(InputError) as err:
        read_prompts(path)
    assert str(err.value) == f"{path}:1: {message}" and err.value.parameter == field


@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_the_cli_refuses_the_bad_value_in_one_line_before_loading_the_model(capsys, field, value, message):
    from pipelines.cli import main

    flag = "--" + field.replace("_", "-")
    code = main(["generate", "--config", str(REPO / "configs" / "local.yaml"), f"{flag}={value}",
                 "--prompt", "Say hi."])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "loading model" not in err and "Traceback" not in err


@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_both_http_apis_answer_400_with_the_same_message(http, engine, field, value, message):
    chat = http.post("/v1/chat/completions", json={"model": engine.backend.info.model_id, "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "Say hi."}],
                                                   field: value})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["message"] == message and chat.json()["error"]["param"] == field
    ids = engine.encode("Say hi.")
    gen = http.post("/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 2, field: value})
    assert gen.status_code == 400, gen.text
    body = gen.json()
    assert body["error"] == message and body["parameter"] == field


def test_a_good_request_passes_every_door_positive_control(http, engine):
    chat = http.post("/v1/chat/completions", json={"model": engine.backend.info.model_id, "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "Say hi."}],
                                                   "top_p": 0.5, "temperature": 0.5, "seed": 1})
    assert chat.status_code == 200, chat.text
    gen = http.post("/api/v1/generate", json={"input_ids": engine.encode("Say hi."), "max_new_tokens": 2,
                                              "top_p": 0.5, "temperature": 0.5, "seed": 1})
    assert gen.status_code == 200, gen.text
    assert engine.generate("Say hi.", max_tokens=2, top_p=0.5, temperature=0.5, seed=1).output_ids
