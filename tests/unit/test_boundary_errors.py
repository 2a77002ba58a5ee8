"""The issue's "unclear now" cases that need no model: each is one coded error naming its field
(``InvalidRequestError.parameter``), or one line and exit 2 from the CLI, never a traceback.
(The HTTP ones run against the model in tests/integration/test_boundary_errors_serve.py; a query
on a damaged store is in test_store_cli.py, blank lines of an embed texts file in
test_embed_files.py, the connect time-out in test_connect_timeout.py.)"""

from __future__ import annotations

import json

import pytest

from engine.config import SEED_MAX, choice_seed
from engine.core.inputs import GenerationRequest
from engine.errors import InvalidRequestError
from pipelines.cli import main
from pipelines.serve.openai_choices import seeded


@pytest.mark.parametrize("message,shown", [
    ({"role": "user", "content": None}, "null"),
    ({"role": "user"}, "nothing"),
    ({"role": "user", "content": {"text": "hi"}}, "dict {'text': 'hi'}"),
    ({"role": "assistant", "content": None}, "null"),  # null only with tool_calls
    ({"role": "user", "content": 5}, "int 5"),
])
def test_a_message_whose_content_is_not_a_string_is_refused_naming_it(message, shown):
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest(messages=[{"role": "system", "content": "be brief"}, message])
    assert err.value.parameter == "messages[1].content"
    assert str(err.value).startswith("`messages[1].content` must be a string (null only on an assistant message "
                                     f"with tool_calls), got {shown}"), str(err.value)


def test_an_assistant_tool_call_message_with_null_content_is_read_as_empty_text():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = GenerationRequest(messages=[{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": None, "tool_calls": [call]},
                                          {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    assert request.messages[1]["content"] == "" and request.messages[1]["tool_calls"] == [call]


@pytest.mark.parametrize("content,says", [
    (json.dumps([{"role": "user", "content": {"text": "hi"}}]).encode(), "`messages[0].content` must be a string"),
    (json.dumps([{"role": "user", "content": None}]).encode(), "`messages[0].content` must be a string"),
    (json.dumps({"messages": [{"role": "user", "content": "caf\u00e9"}]}, ensure_ascii=False).encode("latin-1"),
     "must be UTF-8 text, got byte 0xe9 at offset"),
])
def test_a_bad_messages_file_is_one_line_and_exit_2(tmp_path, capsys, content, says):
    path = tmp_path / "chat.json"
    path.write_bytes(content)
    assert main(["generate", "--messages-file", str(path)]) == 2  # refused before any model loads
    err = capsys.readouterr().err.strip()
    assert err.startswith("raylens: error: ") and says in err and "\n" not in err, err


def test_a_prompts_file_that_is_not_utf8_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert main(["submit", "--prompts", str(path), "--out", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "must be UTF-8 text, got byte 0xe9" in err and "\n" not in err, err


def test_choice_seeds_wrap_past_the_largest_seed_so_any_seed_works_with_any_n():
    assert [choice_seed(SEED_MAX, i) for i in range(3)] == [SEED_MAX, 0, 1]
    assert choice_seed(7, 2) == 9 and choice_seed(None, 3) is None
    request = GenerationRequest(prompt="hi", seed=SEED_MAX)
    assert [r.seed for r in seeded(request, 2)] == [SEED_MAX, 0]  # was: refused, naming seed + 1
