"""The project's FlowEngine/SelfPrompt mods, written against the original SDK's names, on the
embedded model — through Engine.generate and through the CLI (--mod, --mod-payload)."""

from __future__ import annotations

import json

import jsonschema

from mods.loading import bundle_payload
from pipelines.cli import main
from tests.helpers import TEST_MODS, assert_payload_valid

SDK_MODS = TEST_MODS.parent / "sdk_mods"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def test_json_schema_mod_gives_schema_valid_json(engine):
    result = engine.generate(messages=[{"role": "user", "content": "Describe a person as JSON."}],
                             response_format=RESPONSE_FORMAT, mods=[SDK_MODS / "json_schema_mod.py"],
                             max_tokens=300, temperature=0.0)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.output_text), SCHEMA)
    kinds = [type(a).__name__ for a in result.actions]
    assert kinds[-1] == "ForceOutput" and kinds.count("Backtrack") == 4  # one erased question per property
    assert_payload_valid(result.payload)


def test_flow_agent_ends_in_a_tool_call(engine):
    result = engine.generate(messages=[{"role": "user", "content": "I want to cancel my reservation ABC123, please."}],
                             mods=[SDK_MODS / "flow_agent_mod.py"], max_tokens=200, temperature=0.0)
    assert result.finish_reason == "tool_calls" and result.output_text == ""
    call = result.tool_calls[0]
    assert call["function"]["name"] == "cancel_reservation"
    assert json.loads(call["function"]["arguments"]) == {"reservation_id": "ABC123"}
    assert call["id"] == "call_" + result.request_id.split("-")[0]
    assert_payload_valid(result.payload)


def test_the_cli_runs_both_mods_unchanged(capsys, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Describe a person as JSON."}],
                                "response_format": RESPONSE_FORMAT}))
    assert main(["generate", "--messages-file", str(chat), "--mod", str(SDK_MODS / "json_schema_mod.py"),
                 "--max-tokens", "300", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(out["output_text"]), SCHEMA)

    chat.write_text(json.dumps([{"role": "user", "content": "Please cancel reservation QWE987."}]))
    assert main(["generate", "--messages-file", str(chat), "--mod", str(SDK_MODS / "flow_agent_mod.py"),
                 "--max-tokens", "200", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "tool_calls" and out["tool_calls"][0]["function"]["name"] == "cancel_reservation"


def test_the_cli_takes_a_bundle_payload_file(capsys, tmp_path):
    payload = tmp_path / "greeter.json"
    payload.write_text(json.dumps(bundle_payload(SDK_MODS / "examples" / "greeter" / "mod.py", "greeter")))
    assert main(["generate", "--prompt", "Hello", "--mod-payload", str(payload), "--max-tokens", "12",
                 "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output_text"].startswith(" Greetings from a package!")
