"""A prompts file is checked up front with the engine's own rules, and its mods are parsed, never run."""

from __future__ import annotations

import json

import pytest

from engine.config import REQUEST_ID_MAX_CHARS
from pipelines.jobs.prompts_file import InputError, read_prompts

FINE = {"prompt": "Say hi.", "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 2**64 - 1,
        "stop_tokens": [1, 2], "request_id": "r" * REQUEST_ID_MAX_CHARS}

# (the raw JSON value, the field the message must name)
BAD_VALUES = [
    ('"top_p": 1.5', "top_p"),
    ('"top_p": 0', "top_p"),
    ('"max_tokens": -3', "max_tokens"),
    ('"max_tokens": 4294967296', "max_tokens"),
    ('"temperature": -0.1', "temperature"),
    ('"temperature": 1e999', "temperature"),  # Python's json reads this as inf
    ('"top_k": -1', "top_k"),
    ('"seed": 18446744073709551616', "seed"),
    ('"seed": -1', "seed"),
    ('"stop_tokens": ["a"]', "stop_tokens"),
    (f'"request_id": "{"x" * 300}"', "request_id"),
    ('"request_id": ""', "request_id"),
]


def write(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_line_with_every_value_at_its_bound_is_accepted(tmp_path):
    [line] = read_prompts(write(tmp_path / "p.jsonl", json.dumps(FINE)))
    assert line.request.top_p == 0.9 and line.request.request_id == FINE["request_id"]


@pytest.mark.parametrize(("raw", "field"), BAD_VALUES)
def test_an_out_of_range_value_is_refused_with_its_line_and_field_named(tmp_path, raw, field):
    path = write(tmp_path / "p.jsonl", '{"prompt": "fine"}', '{"prompt": "x", ' + raw + "}")
    # a list's bad entry is named with its position (`stop_tokens[0]`), by the rule every door uses
    with pytest.raises(InputError, match=rf"^{path}:2: `{field}(\[\d+\])?` must be") as err:
        read_prompts(path)
    assert err.value.parameter.split("[")[0] == field


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_as_json(tmp_path, constant):
    path = write(tmp_path / "p.jsonl", '{"prompt": "x", "temperature": ' + constant + "}")
    with pytest.raises(InputError, match=rf"^{path}:1: not valid JSON \({constant} is not a JSON number"):
        read_prompts(path)


@pytest.mark.parametrize("source", ['{"input_ids": []}', '{"input_ids": [1, -2]}', '{"prompt": "  "}',
                                    '{"messages": []}', '{"messages": [{"content": "no role"}]}'])
def test_an_empty_or_malformed_source_is_refused(tmp_path, source):
    path = write(tmp_path / "p.jsonl", source)
    with pytest.raises(InputError, match=rf"^{path}:1: `(input_ids|prompt|messages)(\[\d+\])?` must be"):
        read_prompts(path)


def test_the_job_exits_2_with_one_line_for_a_bad_value(tmp_path, capsys):
    from pipelines.jobs.generate import main

    path = write(tmp_path / "p.jsonl", '{"prompt": "x", "top_p": 7}')
    assert main(["--prompts", str(path), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}:1: `top_p` must be in (0, 1], got 7" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_raylens_submit_refuses_a_bad_line_before_contacting_any_cluster(tmp_path, capsys):
    from pipelines.cli import main

    path = write(tmp_path / "p.jsonl", '{"prompt": "x", "seed": 99999999999999999999999}')
    # the dashboard address is closed: reaching it would be a different error
    assert main(["submit", "--prompts", str(path), "--address", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "`seed` must be >= 0 and <= 2**64 - 1" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- mods: parsed, never run


def _marker_payload(marker) -> dict:
    source = (f"open({str(marker)!r}, 'w').write('ran')\n"
              "from quote_mod_sdk import mod\n\n@mod\ndef m(event, actions, tokenizer):\n    return None\n")
    return {"language": "python", "entrypoint": "m", "source": source}


def test_checking_a_payload_never_runs_its_code(tmp_path):
    from mods.loading import load_mod_from_payload

    marker = tmp_path / "ran.txt"
    path = write(tmp_path / "p.jsonl", json.dumps({"prompt": "x", "mods": [_marker_payload(marker)]}))
    [line] = read_prompts(path)
    assert line.request.mods[0]["entrypoint"] == "m"
    assert not marker.exists(), "checking a prompts file ran the payload's code"
    load_mod_from_payload(_marker_payload(marker))  # positive control: loading it does run it
    assert marker.read_text() == "ran"


def test_shipping_a_mod_file_never_runs_its_code(tmp_path):
    marker = tmp_path / "ran.txt"
    mod_file = tmp_path / "my_mod.py"
    mod_file.write_text(_marker_payload(marker)["source"])
    [line] = read_prompts(write(tmp_path / "p.jsonl", json.dumps({"prompt": "x", "mods": [str(mod_file)]})))
    payload = line.request.mods[0]
    assert payload["entrypoint"] == "m" and payload["source"] == mod_file.read_text()
    assert not marker.exists(), "shipping a mod file ran its code"


@pytest.mark.parametrize(("payload", "message"), [
    ({"language": "python", "entrypoint": "m", "source": "def m(:\n"}, "syntax error at line 1"),
    ({"language": "python", "entrypoint": "missing", "source": "def m(e, t):\n    pass\n"}, "no callable named `missing`"),
    ({"language": "rust", "entrypoint": "m", "source": "x"}, "Only Python mods"),
    ({"language": "python", "entrypoint": "m", "source": {"pkg/a.py": "def m(e, t): pass"}, "module": "pkg.b"},
     "bundle has no module `pkg.b`"),
])
def test_a_broken_payload_is_refused_up_front_with_its_line(tmp_path, payload, message):
    path = write(tmp_path / "p.jsonl", '{"prompt": "ok"}', json.dumps({"prompt": "x", "mods": [payload]}))
    with pytest.raises(InputError, match=rf"^{path}:2: bad mod: .*{message}"):
        read_prompts(path)


def test_a_results_file_is_put_in_input_order_keeping_every_line(tmp_path):
    import json

    from pipelines.jobs.generate import _order_by_line

    out = tmp_path / "results.jsonl"
    rows = [{"line": 3, "x": "c"}, {"line": 1, "x": "a"}, {"line": 2, "x": "b"}]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"line": 4, "x": "to', encoding="utf-8")
    _order_by_line(out)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(t)["line"] for t in lines[:3]] == [1, 2, 3]
    assert lines[3] == '{"line": 4, "x": "to'  # a torn line is kept, at the end
    assert not list(tmp_path.glob(".results.jsonl.*"))  # no staging file left behind
