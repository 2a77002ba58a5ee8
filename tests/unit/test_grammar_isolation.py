"""A grammar cannot take the engine's process down: its text is bounded (bytes, rules) before any
native code sees it, it is compiled in a child process first (a grammar that crashes llguidance's
compiler kills the child and is a :class:`GrammarError` naming its field), its steps run under
llguidance's limits, and a step past one fails that request alone, naming its field — never a mod.

The crashing grammar is the one the issue reported: a Lark grammar chaining 5,000 rules. A
positive control shows it really kills a process that compiles it."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from engine.config import StructuredConfig
from engine.core.result import FinishReason
from engine.core.structured import GrammarCompiler, grammar_spec
from engine.core.structured.budget import count_rules
from engine.errors import GrammarError
from tests.helpers import CharTokenizer, lark_chain as chain

pytestmark = pytest.mark.timeout(300)

TOK = CharTokenizer()
EOS = TOK.eos_token_id
# the limits that let the 5,000-rule chain through to a child (by default it is refused earlier)
OPEN = StructuredConfig(max_grammar_rules=100_000, max_grammar_bytes=1_000_000)


def lark(text: str):
    return grammar_spec({"type": "grammar", "grammar": text}, None, None)


@pytest.fixture
def compiler_of():
    made: list[GrammarCompiler] = []

    def make(limits: StructuredConfig = StructuredConfig()) -> GrammarCompiler:
        made.append(GrammarCompiler(TOK, vocab_size=TOK.vocab_size, eos_token_ids=[EOS], limits=limits))
        return made[-1]

    yield make
    for compiler in made:
        pids = compiler.pool.pids if compiler._pool is not None else []
        compiler.close()
        for pid in pids:  # cleanup check: no compile child outlives its compiler
            assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"compile child {pid} still runs after close()"


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] == "Z"


def test_the_5000_rule_chain_really_crashes_a_process_that_compiles_it():
    """Positive control for the tests below: compiled directly (on the child's stack size), the
    grammar kills its process with SIGSEGV; 500 rules compile."""
    script = textwrap.dedent(f"""
        import sys, llguidance
        from engine.core.structured.native import CHILD_STACK_BYTES, run_with_stack
        from tests.helpers import lark_chain as chain
        grammar = llguidance.LLMatcher.grammar_from_lark(chain(int(sys.argv[1])))
        print(run_with_stack(lambda: llguidance.LLMatcher.validate_grammar(grammar), CHILD_STACK_BYTES) or "valid")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    small = subprocess.run([sys.executable, "-c", script, "500"], env=env, capture_output=True, timeout=120)
    assert small.returncode == 0 and small.stdout.strip() == b"valid", small.stderr[-500:]
    big = subprocess.run([sys.executable, "-c", script, "5000"], env=env, capture_output=True, timeout=120)
    assert big.returncode == -signal.SIGSEGV, f"expected SIGSEGV, got exit {big.returncode}: {big.stderr[-500:]!r}"


def test_the_5000_rule_chain_is_refused_by_the_rule_limit_before_any_compile(compiler_of):
    compiler = compiler_of()
    with pytest.raises(GrammarError, match=r"`response_format.grammar` must define at most 2000 rules "
                                           r"\(structured.max_grammar_rules\), got 5001") as err:
        compiler.compile(lark(chain(5000)))
    assert err.value.parameter == "response_format.grammar" and isinstance(err.value, ValueError)
    assert compiler._pool is None, "no child should have been started for a grammar over the rule limit"
    with pytest.raises(GrammarError, match=r"must be at most 1000 bytes \(structured.max_grammar_bytes\), got 15"):
        compiler_of(StructuredConfig(max_grammar_bytes=1000)).compile(lark(chain(1000)))


def test_a_grammar_that_crashes_the_compiler_kills_a_child_only_and_is_refused_naming_its_field(compiler_of):
    compiler = compiler_of(OPEN)
    before = compiler.compile(lark(chain(10)))  # a child is running and answering
    first_child = compiler.pool.pids
    with pytest.raises(GrammarError, match=r"`response_format.grammar` must be a grammar llguidance can compile "
                                           r"within the structured.\* limits, got one that crashed the grammar "
                                           r"compiler \(killed by SIGSEGV\)") as err:
        compiler.compile(lark(chain(5000)))
    assert err.value.parameter == "response_format.grammar"
    assert compiler.pool.crashes == 1 and compiler.pool.pids == []
    # this process is alive (the test runs on), and the next grammar compiles in a new child
    after = compiler.compile(lark(chain(20)))
    assert after.new_state().advance(TOK.encode("a0a1")) == 4 and before.grammar != after.grammar
    assert compiler.pool.pids and compiler.pool.pids != first_child
    # the same grammar again: refused from the cache, without crashing another child
    with pytest.raises(GrammarError, match="crashed the grammar compiler"):
        compiler.compile(lark(chain(5000)))
    assert compiler.pool.crashes == 1


def test_a_json_schema_chaining_refs_is_isolated_like_a_lark_chain(compiler_of):
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(1500)}
    defs["d1500"] = {"type": "string"}
    spec = grammar_spec({"type": "json_schema", "json_schema": {"name": "deep", "schema": {
        "$ref": "#/$defs/d0", "$defs": defs}}}, None, None)
    assert count_rules(spec) == 3 * 1500 + 3  # per definition: it, its properties, its $ref; the root, $defs, the last
    with pytest.raises(GrammarError, match="must define at most 2000 rules"):
        compiler_of().compile(spec)
    compiler = compiler_of(OPEN)
    with pytest.raises(GrammarError, match="crashed the grammar compiler") as err:
        compiler.compile(spec)
    assert err.value.parameter == "response_format.json_schema.schema" and compiler.pool.crashes == 1


def test_a_compile_past_the_time_out_stops_its_child_and_is_not_cached(compiler_of):
    compiler = compiler_of(dataclasses.replace(OPEN, compile_timeout_s=1e-6))
    for attempt in (1, 2):
        with pytest.raises(GrammarError, match=r"did not compile within 1e-06 s \(structured.compile_timeout_s\)"):
            compiler.compile(lark(chain(1000)))
        assert compiler.pool.crashes == attempt and compiler.pool.pids == []


def test_a_step_past_the_step_limit_ends_that_request_alone_naming_its_field():
    """The grammar compiles and takes its first step; its second step needs more Earley items than
    ``structured.step_max_items`` allows. That request ends in an error naming
    ``response_format.grammar`` (``error_parameter``), while a plain request beside it and the
    same grammar under the default limits run to the end."""
    from engine import Engine
    from engine.config import RaylensConfig
    from tests.helpers import ScriptedBackend, build_generation_cfg

    grammar = "start: " + " | ".join(f"a{i}" for i in range(50)) + "\n" + "\n".join(
        f'a{i}: "w" "{i}"' for i in range(50))
    fmt = {"type": "grammar", "grammar": grammar}
    gen = build_generation_cfg(temperature=0.0, max_tokens=8)
    for limits, ends in ((StructuredConfig(), FinishReason.STOP), (StructuredConfig(step_max_items=5),
                                                                    FinishReason.ERROR)):
        with Engine(RaylensConfig(generation=gen, structured=limits), backend=ScriptedBackend("w7")) as eng:
            handles = [eng.submit(prompt="q", response_format=fmt), eng.submit(prompt="q")]
            limited, plain = (h.result(timeout=120) for h in handles)
        assert plain.finish_reason is not FinishReason.ERROR and plain.output_text.startswith("w7")
        assert limited.finish_reason is ends, (limits, limited.error)
        if ends is FinishReason.ERROR:
            assert limited.error_parameter == "response_format.grammar"
            assert "Too many items (limit 5" in limited.error and "mod" not in limited.error
        else:
            assert limited.output_text == "w7" and limited.error_parameter is None


def test_a_schema_nested_past_pythons_recursion_limit_is_refused_naming_it_not_a_recursion_error():
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError, match=r"`response_format.json_schema.schema` must nest at most 128 levels"):
        grammar_spec({"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}, None, None)
    shallow = grammar_spec({"type": "json_schema", "json_schema": {"name": "ok", "schema": {"type": "string"}}},
                           None, None)
    assert shallow.parameter == "response_format.json_schema.schema"  # positive control
