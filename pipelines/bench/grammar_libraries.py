"""xgrammar beside llguidance with the embedded model's tokenizer: how long a JSON schema takes to
compile, what filling the next-token mask costs for 8 requests at once, and which JSON-schema
features each library enforces, accepts without enforcing, or refuses.

Why it exists: structured outputs (``engine/core/structured``) needed one grammar library; this is
the comparison that picked it, kept runnable (``raylens bench --grammar-libraries``) so the choice
can be checked again when either library moves. Mask cost is measured on a real token path: each
schema's example instance, tokenized, fed token by token to 8 matchers while every step fills the
(8, ceil(V/32)) bitmask with the library's batched call.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["SCHEMAS", "FEATURES", "LibraryResult", "run_grammar_library_bench", "format_grammar_libraries"]

BATCH = 8

# name -> (schema, one valid instance): the instance is the token path the mask cost is measured on
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "enum+int": ({"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["colour", "count"], "additionalProperties": False},
        {"colour": "green", "count": 3}),
    "person": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}),
    "anyOf+$defs": ({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                         "y": {"type": "number"}},
                                         "required": ["x", "y"], "additionalProperties": False}},
                     "type": "object", "properties": {
                         "shape": {"anyOf": [{"const": "circle"}, {"const": "polygon"}]},
                         "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1}},
                     "required": ["shape", "points"], "additionalProperties": False},
                    {"shape": "polygon", "points": [{"x": 0, "y": 1.5}, {"x": 2, "y": -3}]}),
    "tool-call": ({"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}),
}

# feature -> (schema, an instance it allows, an instance it forbids)
FEATURES: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcdef"),
    "pattern": ({"type": "string", "pattern": "^[a-z]+[0-9]$"}, "ab1", "1ab"),
    "format: date": ({"type": "string", "format": "date"}, "2024-02-29", "yesterday"),
    "format: email": ({"type": "string", "format": "email"}, "a@b.io", "not an email"),
    "format: uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "123"),
    "minimum/maximum": ({"type": "integer", "minimum": 3, "maximum": 7}, 5, 9),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, 7),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
                          [1], [1, 2, 3]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
                    ["a", 1], [1, "a"]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, [1, 7], [1, 2]),
    "enum/const": ({"enum": ["a", "b"]}, "a", "c"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "ab", "abcd"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 1),
    "not": ({"not": {"type": "string"}}, 1, "s"),
    "if/then/else": ({"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {"type": "string"}}, 4, 1),
    "additionalProperties: false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    "additionalProperties: schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                     {"k": 1}, {"k": "v"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 2}}, {"ab": 1}, {"abcd": 1}),
    "min/maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                          {"a": 1}, {"a": 1, "b": 2}),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    "$ref recursive": ({"$defs": {"n": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"},
                                                                                         {"type": "null"}]}},
                                        "required": ["next"], "additionalProperties": False}},
                        "$ref": "#/$defs/n"}, {"next": {"next": None}}, {"next": 1}),
}


@dataclass(frozen=True)
class LibraryResult:
    """One library's numbers: compile ms per schema (cold, then from its cache when it has one), mask
    µs per step for the whole batch, and per feature "enforced" / "accepted, not enforced" /
    "refused: <message>"."""

    library: str
    version: str
    compile_ms: dict[str, float]
    mask_us_per_step: dict[str, float]
    accept_us_per_step: dict[str, float]
    features: dict[str, str] = field(default_factory=dict)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr, self.version = xgr, _version("xgrammar")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size, self.eos = vocab_size, eos

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], bitmask: Any) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.version = llguidance, _version("llguidance")
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos[0])
        self.executor = llguidance.LLExecutor()
        self.eos = eos
        self.fill_par = llguidance.torch.fill_next_token_bitmask_par

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        self.llg.LLMatcher(self.tok, grammar)  # the tokenizer-dependent part of building it
        return grammar

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.llg.LLMatcher(self.tok, compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], bitmask: Any) -> None:
        self.fill_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped()) and not matcher.is_error()


def _tokens(tokenizer: Any, instance: Any) -> list[int]:
    return list(tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False))


def _passes(lib: Any, compiled: Any, tokens: list[int]) -> bool:
    matcher = lib.matchers(compiled, 1)[0]
    return all(lib.accept(matcher, t) for t in tokens) and lib.accept(matcher, lib.eos[0]) and lib.done(matcher)


def _measure(lib: Any, tokenizer: Any, vocab_size: int) -> LibraryResult:
    import torch

    compile_ms, mask_us, accept_us, features = {}, {}, {}, {}
    for name, (schema, instance) in SCHEMAS.items():
        started = time.perf_counter()
        compiled = lib.compile(schema)
        compile_ms[name] = round((time.perf_counter() - started) * 1000.0, 2)
        tokens = _tokens(tokenizer, instance) + [lib.eos[0]]
        matchers = lib.matchers(compiled, BATCH)
        bitmask = torch.full((BATCH, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        fill_s = accept_s = 0.0
        for token in tokens:
            t0 = time.perf_counter()
            lib.fill(matchers, bitmask)
            t1 = time.perf_counter()
            ok = [lib.accept(m, token) for m in matchers]
            accept_s += time.perf_counter() - t1
            fill_s += t1 - t0
            if not all(ok):
                raise RuntimeError(f"{lib.name} refused its own example of {name} at token {token}")
        mask_us[name] = round(fill_s / len(tokens) * 1e6, 1)
        accept_us[name] = round(accept_s / len(tokens) * 1e6, 1)
    for feature, (schema, good, bad) in FEATURES.items():
        try:
            compiled = lib.compile(schema)
        except Exception as err:  # the library's own refusal, kept as its message says it
            features[feature] = "refused: " + str(err).splitlines()[0][:90]
            continue
        ok_good = _passes(lib, compiled, _tokens(tokenizer, good))
        ok_bad = _passes(lib, compiled, _tokens(tokenizer, bad))
        features[feature] = ("enforced" if ok_good and not ok_bad
                             else "accepted, NOT enforced" if ok_good else "rejects a valid instance")
    return LibraryResult(lib.name, lib.version, compile_ms, mask_us, accept_us, features)


def run_grammar_library_bench(tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                              progress: Callable[[str], None] = lambda _: None) -> list[LibraryResult]:
    """Both libraries on the same tokenizer, one after the other (each on its own warm-up first)."""
    results = []
    for cls in (_Xgrammar, _Llguidance):
        progress(f"grammar libraries: {cls.name}")
        lib = cls(tokenizer, vocab_size, list(eos_token_ids))
        lib.compile(SCHEMAS["enum+int"][0])  # warm-up: first-call costs are not a schema's
        results.append(_measure(lib, tokenizer, vocab_size))
    return results


def format_grammar_libraries(results: list[LibraryResult]) -> str:
    names = [r.library + " " + r.version for r in results]
    lines = ["| schema | " + " | ".join(f"{n} compile ms | {n} mask µs/step (batch {BATCH}) | "
                                          f"{n} accept µs/step (batch {BATCH})" for n in names) + " |",
             "|---" * (1 + 3 * len(results)) + "|"]
    for schema in SCHEMAS:
        lines.append(f"| {schema} | " + " | ".join(f"{r.compile_ms[schema]} | {r.mask_us_per_step[schema]} | "
                                                    f"{r.accept_us_per_step[schema]}" for r in results) + " |")
    lines += ["", "| JSON-schema feature | " + " | ".join(names) + " |", "|---" * (1 + len(results)) + "|"]
    for feature in FEATURES:
        lines.append(f"| {feature} | " + " | ".join(r.features[feature] for r in results) + " |")
    return "\n".join(lines)
