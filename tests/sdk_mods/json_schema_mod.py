"""A JSON-schema mod written against the original SDK's names (FlowEngine + strategies + get_schemas).

For a request with a ``response_format`` JSON schema of flat properties (string, integer, number,
boolean, enum), it self-prompts one question per property inside the assistant turn, erases each
exchange (EraseMode.ALL), and ends with ForceOutput of the assembled JSON object. A schema with
a required property it cannot fill ends the request with EmitError. Without a schema: no effect.
"""

import json

from quote_mod_sdk import Prefilled, get_schemas, mod
from quote_mod_sdk.flow import FlowEngine, FlowQuestion, route_output
from quote_mod_sdk.self_prompt import EraseMode
from quote_mod_sdk.strategies.strategy_constructor import CharsMode, CharsStrat, ChoicesStrat

_engines = {}
_SUPPORTED = ("string", "integer", "number", "boolean")


def _question(name, spec):
    kind = spec.get("type")
    if "enum" in spec:
        return FlowQuestion(name=name, prompt=f"\nThe {name} (one of {', '.join(map(str, spec['enum']))}) is: ",
                            strategy=ChoicesStrat([str(v) for v in spec["enum"]]), erase_mode=EraseMode.ALL)
    if kind == "string":
        return FlowQuestion(name=name, prompt=f'\nThe {name} as a JSON string is: "',
                            strategy=CharsStrat(CharsMode.STRING, stop='"', min=1), erase_mode=EraseMode.ALL)
    if kind == "integer":
        return FlowQuestion(name=name, prompt=f"\nThe {name} as a whole number is: ",
                            strategy=CharsStrat(CharsMode.NUMERIC, stop=3), erase_mode=EraseMode.ALL)
    if kind == "number":
        return FlowQuestion(name=name, prompt=f"\nThe {name} as a number is: ",
                            strategy=CharsStrat(CharsMode.JS_FLOAT, stop="\n", min=1), erase_mode=EraseMode.ALL)
    return FlowQuestion(name=name, prompt=f"\nIs it true that {name}? Answer true or false: ",
                        strategy=ChoicesStrat(["true", "false"]), erase_mode=EraseMode.ALL)


def _value(spec, text):
    kind = spec.get("type")
    if kind == "integer":
        return int(text)
    if kind == "number":
        return float(text)
    if kind == "boolean":
        return text == "true"
    return text


def _build(schema):
    props = schema.get("properties") or {}
    names = [n for n in props if "enum" in props[n] or props[n].get("type") in _SUPPORTED]
    if any(n not in names for n in schema.get("required", [])) or not names:
        return None
    questions = [_question(n, props[n]) for n in names]

    def finish(state):
        obj = {n: _value(props[n], state.answers.get(n, "")) for n in names}
        return route_output(json.dumps(obj))

    for question, nxt in zip(questions, questions[1:] + [None]):
        question.then(nxt if nxt is not None else finish)
    return FlowEngine(entry_question=questions[0])


@mod
def json_schema_mod(event, actions, tokenizer):
    rid = event.request_id
    if isinstance(event, Prefilled):
        schemas = [s for s in get_schemas() if isinstance(s, dict) and s.get("type") == "object"]
        if not schemas:
            return actions.noop()
        engine = _build(schemas[0])
        if engine is None:
            return actions.emit_error("JSON schema has required fields this mod cannot fill; generation aborted.")
        _engines[rid] = engine
    engine = _engines.get(rid)
    if engine is None:
        return actions.noop()
    return engine.handle_event(event, actions, tokenizer)
