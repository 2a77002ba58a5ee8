"""The raylens CLI, run in-process through ``main(argv)``."""

from __future__ import annotations

import json

import pytest

from pipelines.cli import main
from tests.helpers import TEST_MODS


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_prints_the_answer(capsys):
    code, out, err = run(capsys, "generate", "--prompt", "What is the capital of France?", "--max-tokens", "32",
                         "--temperature", "0")
    assert code == 0
    assert out.strip() == "The capital of France is Paris."
    assert "finish=stop" in err


def test_generate_with_a_legacy_mod_and_messages_file_as_json(capsys, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "What is the capital of France?"}]))
    code, out, _ = run(capsys, "generate", "--messages-file", str(chat), "--mod",
                       str(TEST_MODS / "forward_pass" / "force_tokens.py"), "--max-tokens", "12", "--temperature", "0",
                       "--json")
    assert code == 0
    data = json.loads(out)
    assert data["output_text"].startswith(" [INJECTED]") and data["finish_reason"] in ("stop", "length")
    assert data["actions"][0] == {"type": "ForceTokens", "mod": "forward_pass_force_tokens"}
    assert data["payload"]["request"]["request_id"] == data["request_id"]
    # the payload it prints lists each step's top tokens (which only sent payloads get by default)
    forwards = [e for e in data["payload"]["events"] if e["event_type"] == "ForwardPass"]
    assert forwards and all(len(e["top_tokens"]) == 20 for e in forwards)


def test_generate_prints_tool_calls(capsys):
    code, out, err = run(capsys, "generate", "--prompt", "Weather?", "--mod",
                         str(TEST_MODS / "prefilled" / "tool_calls.py"))
    assert code == 0 and json.loads(out)["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "finish=tool_calls" in err


@pytest.mark.parametrize("argv,message", [
    (["--mod", "no/such/mod.py"], "mod file `no/such/mod.py` does not exist"),
    (["--mod-payload", "missing.json"], "mod payload `missing.json` does not exist"),
    (["--max-tokens", "0"], "`max_tokens` must be >= 1, got 0"),
    (["--config", "nope.yaml"], "config file `nope.yaml` does not exist"),
])
def test_user_mistakes_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, "generate", "--prompt", "hi", *argv)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert err.strip().count("\n") <= 1 or err.startswith("raylens: loading model")


def test_broken_mod_file_is_reported_with_its_line(capsys, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("from quote_mod_sdk import mod\n\n@mod\ndef m(event, actions, tokenizer)\n    pass\n")
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--mod", str(broken))
    assert code == 2 and "syntax error at line 4" in err


def test_empty_prompt_is_a_clear_error(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "  ")
    assert code == 2 and "`prompt` must be a non-empty string" in err


def test_unknown_or_unavailable_device_is_a_clear_error(capsys, monkeypatch):
    import torch

    monkeypatch.setenv("CONCORDANCE_DEVICE", "tpu")
    code, _, err = run(capsys, "generate", "--prompt", "hi")
    assert code == 2 and "`device` must be one of auto, cpu, mps, cuda" in err
    if not torch.cuda.is_available():
        monkeypatch.setenv("CONCORDANCE_DEVICE", "cuda")
        code, _, err = run(capsys, "generate", "--prompt", "hi")
        assert code == 2 and "must be available on this machine (cpu" in err and "CONCORDANCE_DEVICE" in err
