"""A mod's token ids are checked before anything decodes or stores them: a mod that forces a
negative id (or one past the vocabulary) ends its request with finish reason ``error`` naming the
mod — in Python, on the CLI (exit 1, no traceback) and over HTTP — and its payload still builds,
recording what the mod handed back."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(300)

BAD_MODS = textwrap.dedent('''
    from quote_mod_sdk import Added, Sampled, mod

    @mod
    def negative_force(event, actions, tokenizer):
        if isinstance(event, Sampled) and event.step == 1:
            return actions.force_tokens([-5])
        return None

    @mod
    def huge_output(event, actions, tokenizer):
        if isinstance(event, Added) and event.step == 1:
            return actions.force_output([5, 2**40])
        return None
''')


@pytest.fixture(scope="module")
def mod_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mods") / "bad_ids.py"
    path.write_text(BAD_MODS, encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["negative_force", "huge_output"])
def test_a_bad_id_from_a_mod_ends_the_request_naming_the_mod_and_the_payload_builds(engine, mod_file, name):
    result = engine.generate("Say hi.", max_tokens=6, temperature=0.0, mods=[f"{mod_file}:{name}"])
    assert str(result.finish_reason) == "error" and f"mod {name} returned an unusable" in result.error
    actions = result.payload["actions"]
    assert actions and all(isinstance(a.get("tokens_preview", ""), str) for a in actions)
    clean = engine.generate("Say hi.", max_tokens=6, temperature=0.0)  # positive control: no mod, no error
    assert str(clean.finish_reason) == "length" and clean.error is None


def test_the_cli_exits_1_with_the_result_and_no_traceback(mod_file, capsys):
    from pipelines.cli import main

    code = main(["generate", "--config", str(REPO / "configs" / "local.yaml"), "--prompt", "Say hi.",
                 "--max-tokens", "6", "--temperature", "0", "--mod", f"{mod_file}:negative_force", "--json"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    result = json.loads(captured.out)
    assert result["finish_reason"] == "error" and "negative_force" in result["error"]
    assert "Traceback" not in captured.err


def test_http_answers_a_coded_mod_error_not_a_500(engine):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(allow_mod_registration=True, max_new_tokens=16, request_timeout_s=120)
    with serve_in_thread(build_app(engine, settings)) as url, httpx.Client(base_url=url, timeout=120) as http:
        registered = http.post("/v1/mods", json={"name": "neg", "language": "python", "source": BAD_MODS,
                                                 "entrypoint": "negative_force"})
        assert registered.status_code in (200, 201), registered.text
        model = engine.backend.info.model_id
        reply = http.post("/v1/chat/completions", json={"model": f"{model}/neg", "max_tokens": 6,
                                                        "messages": [{"role": "user", "content": "Say hi."}]})
        assert reply.status_code != 500, reply.text
        assert "negative_force" in reply.text
        assert http.get("/health").status_code == 200
