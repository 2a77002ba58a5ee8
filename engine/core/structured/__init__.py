"""Structured outputs: a request's ``response_format`` / ``tool_choice`` as a grammar
(:mod:`.spec`, plain data), compiled once per distinct text (:mod:`.compiler`, llguidance) — its
text bounded first (:mod:`.budget`) and compiled in a child process before this one builds it
(:mod:`.isolation`, :mod:`.compile_worker`, :mod:`.native` says why) — and one matcher per request
(:mod:`.state`) whose token mask the batched sampler applies."""

from engine.core.structured.compiler import CompiledGrammar, GrammarCompiler
from engine.core.structured.spec import GrammarSpec, grammar_spec, tool_call_schema

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarSpec", "grammar_spec", "tool_call_schema"]
