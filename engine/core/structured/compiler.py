"""Grammar specs compiled with llguidance against the engine's tokenizer.

llguidance over xgrammar (``docs/bench/grammar-libraries.md``): it refuses a JSON-schema keyword it
cannot enforce and names it (xgrammar accepted six of the 25 probed features without enforcing
them), and it builds a grammar in about a millisecond (its token masks are computed lazily), so a
new schema never stalls the step loop. Its per-step mask costs more than xgrammar's precomputed
one (tenths of a millisecond per request on this CPU), small beside a forward.

A grammar is native code's input, and a deep enough one crashes llguidance's compiler
(:mod:`.native`). So a compile goes: the text's size and rule count (:mod:`.budget`), then a child
process compiles it and takes its first step under the ``structured`` limits (:mod:`.isolation`),
and only then does this process build it — once per distinct grammar, on a thread with four times
the child's stack — and hand each request a copy (:class:`~engine.core.structured.state.GrammarState`).
Every refusal is a :class:`~engine.errors.GrammarError` naming the request's field, raised when the
request is processed, before anything runs. Grammars and refusals are cached by the spec's text,
so a grammar that crashed a child is refused again without another child.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from engine.config import StructuredConfig
from engine.core.structured.budget import check_budget
from engine.core.structured.compile_worker import JSON_OPTIONS
from engine.core.structured.isolation import CompilePool, token_table_setup
from engine.core.structured.native import LIMIT_KEYS, PARENT_STACK_BYTES, parser_limits, run_with_stack
from engine.core.structured.spec import GrammarSpec
from engine.errors import GrammarError

if TYPE_CHECKING:
    from engine.core.structured.state import GrammarState

__all__ = ["CompiledGrammar", "GrammarCompiler", "JSON_OPTIONS"]

CACHE_SIZE = 256


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked llguidance grammar for one tokenizer. ``eos``: the token that ends it (allowed
    only where the grammar may end). ``vocab_size``: the logits' width its masks cover.
    ``matcher``: the grammar built once in this process, at its start; each request's state is a
    ``deep_copy`` of it (copying never re-runs the compile)."""

    spec: GrammarSpec
    grammar: str
    eos: int
    vocab_size: int
    tokenizer: Any = field(repr=False, compare=False)  # llguidance.LLTokenizer
    matcher: Any = field(default=None, repr=False, compare=False)  # llguidance.LLMatcher, never advanced

    def new_state(self) -> GrammarState:
        from engine.core.structured.state import GrammarState

        return GrammarState(self)


class GrammarCompiler:
    """One per engine (its tokenizer): the llguidance tokenizer is built on first use (about half
    a second), and so is the pool of compile children; grammars are built and checked once per
    distinct spec text."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: StructuredConfig | None = None) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits if limits is not None else StructuredConfig()
        ends = {int(t) for t in eos_token_ids}
        eos = getattr(tokenizer, "eos_token_id", None)
        # the grammar's end token: the tokenizer's EOS when the model stops on it, else the model's first
        self.eos: int | None = int(eos) if eos is not None and (eos in ends or not ends) else min(ends, default=None)
        self._tokenizer: Any = None
        self._pool: CompilePool | None = None
        # a spec's text -> its grammar and pristine matcher, or why it was refused
        self._cache: collections.OrderedDict[tuple[str, str], tuple[str, Any] | _Refusal] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = _llg_tokenizer(self._hf_tokenizer, self.vocab_size, self.eos)
        return self._tokenizer

    @property
    def pool(self) -> CompilePool:
        """The compile children (started on first use; each child on its first job)."""
        tokenizer = self.tokenizer
        with self._lock:
            if self._pool is None:
                limits = {key: getattr(self.limits, key) for key in LIMIT_KEYS}
                setup = token_table_setup(tokenizer, self.vocab_size, self.eos, limits)  # type: ignore[arg-type]
                self._pool = CompilePool(setup, workers=self.limits.compile_workers,
                                         timeout_s=self.limits.compile_timeout_s)
            return self._pool

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if self.eos is None:
            raise GrammarError(f"`{spec.parameter}` must be left out for this model: structured outputs need "
                               "an end-of-sequence token and its tokenizer has none", parameter=spec.parameter)
        key = (spec.kind, spec.source)
        with self._lock:
            built = self._cache.get(key)
            if built is not None:
                self._cache.move_to_end(key)
        if built is None:
            check_budget(spec, max_bytes=self.limits.max_grammar_bytes, max_rules=self.limits.max_grammar_rules)
            built = self._build(spec)
            if not (isinstance(built, _Refusal) and built.timed_out):  # a time-out may pass on a quieter machine
                with self._lock:
                    self._cache[key] = built
                    while len(self._cache) > CACHE_SIZE:
                        self._cache.popitem(last=False)
        if isinstance(built, _Refusal):
            raise built.error(spec)
        grammar, matcher = built
        return CompiledGrammar(spec, grammar, self.eos, self.vocab_size, self.tokenizer, matcher)

    def _build(self, spec: GrammarSpec) -> tuple[str, Any] | _Refusal:
        """``spec``'s grammar text and its pristine matcher — compiled in a child, then built here
        (see the module's docstring) — or why it cannot be (a refusal, cached like a grammar)."""
        import llguidance

        verdict = self.pool.check(spec.kind, spec.source)
        if verdict.grammar is None:
            return _Refusal(_short(verdict.reason), verdict.crashed, verdict.timed_out)
        grammar, tokenizer = verdict.grammar, self.tokenizer
        limits = {key: getattr(self.limits, key) for key in LIMIT_KEYS}
        matcher = run_with_stack(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                                              limits=parser_limits(limits)), PARENT_STACK_BYTES)
        if matcher.is_error():  # it compiled in the child under the same limits: not expected
            return _Refusal(_short(matcher.get_error()), crashed=False)
        return grammar, matcher

    def close(self) -> None:
        """Stop the compile children (a later compile starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


_WHAT = {"json": "only JSON-schema features raylens enforces",
         "tool_call": "tools whose parameters use only JSON-schema features raylens enforces",
         "regex": "a regex raylens can compile", "grammar": "a Lark grammar raylens can compile"}


@dataclass(frozen=True)
class _Refusal:
    """Why a spec's text cannot be a grammar: llguidance refused it (``crashed`` False: a feature,
    a syntax error, a limit), or its compile killed the child or ran past the time-out (``timed_out``:
    not cached)."""

    reason: str
    crashed: bool
    timed_out: bool = False

    def error(self, spec: GrammarSpec) -> GrammarError:
        if self.crashed:
            return GrammarError(f"`{spec.parameter}` must be a grammar llguidance can compile within the "
                                f"structured.* limits, got one that {self.reason}; simplify it (fewer or shallower "
                                "rules)", parameter=spec.parameter, value=self.reason)
        return GrammarError(f"`{spec.parameter}` must be {_WHAT[spec.kind]}, got: {self.reason}; remove or rewrite "
                            "that part (docs/structured-outputs.md lists what is supported and the limits)",
                            parameter=spec.parameter, value=self.reason)


def _short(reason: str) -> str:
    """One line of llguidance's reason, without its marker for left-out details."""
    return " ".join(reason.replace("<non-verbose/>", "").split())[:400] or "rejected"


class _TokenTable:
    """What llguidance's ``TokenizerWrapper`` reads, from any tokenizer with ``encode``/``decode``
    (a slow or a test tokenizer): each id's text as bytes; ids that decode to nothing with
    ``skip_special_tokens`` are special."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int | None) -> None:
        self.eos_token_id, self.bos_token_id = eos, getattr(tokenizer, "bos_token_id", None)
        self.tokens = [tokenizer.decode([i]).encode("utf-8") for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if not tokenizer.decode([i], skip_special_tokens=True)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos: int | None) -> Any:
    """llguidance's view of ``tokenizer``: from its fast (Rust) tokenizer when it has one."""
    import llguidance
    import llguidance.hf

    if getattr(tokenizer, "is_fast", False):
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer, vocab_size, eos)))
