"""Grammar specs compiled with llguidance against the engine's tokenizer.

llguidance over xgrammar (``docs/bench/grammar-libraries.md``): it refuses a JSON-schema keyword it
cannot enforce and names it (xgrammar accepted six of the 25 probed features without enforcing
them), and it builds a grammar in about a millisecond (its token masks are computed lazily), so a
new schema never stalls the step loop. Its per-step mask costs more than xgrammar's precomputed
one (tenths of a millisecond per request on this CPU), small beside a forward.

A compile is checked here, when the request is processed, so a bad schema, regex or grammar is an
:class:`~engine.errors.InvalidRequestError` naming what it cannot do, never a mid-generation fault.
Compiled grammars are cached by the spec's text; each request gets its own matcher
(:class:`~engine.core.structured.state.GrammarState`).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from engine.core.structured.spec import GrammarSpec
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.core.structured.state import GrammarState

__all__ = ["CompiledGrammar", "GrammarCompiler", "JSON_OPTIONS"]

# no free whitespace in JSON: a small model given free whitespace can spend its budget on it; the
# separators are the ones models write (and json.dumps' defaults)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked llguidance grammar for one tokenizer. ``eos``: the token that ends it (allowed
    only where the grammar may end). ``vocab_size``: the logits' width its masks cover."""

    spec: GrammarSpec
    grammar: str
    eos: int
    vocab_size: int
    tokenizer: Any = field(repr=False, compare=False)  # llguidance.LLTokenizer

    def new_state(self) -> GrammarState:
        from engine.core.structured.state import GrammarState

        return GrammarState(self)


class GrammarCompiler:
    """One per engine (its tokenizer): the llguidance tokenizer is built on first use (about half
    a second), grammars are built and checked once per distinct spec text."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        ends = {int(t) for t in eos_token_ids}
        eos = getattr(tokenizer, "eos_token_id", None)
        # the grammar's end token: the tokenizer's EOS when the model stops on it, else the model's first
        self.eos: int | None = int(eos) if eos is not None and (eos in ends or not ends) else min(ends, default=None)
        self._tokenizer: Any = None
        self._cache: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = _llg_tokenizer(self._hf_tokenizer, self.vocab_size, self.eos)
        return self._tokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if self.eos is None:
            raise InvalidRequestError(f"`{spec.parameter}` must be left out for this model: structured outputs need "
                                      "an end-of-sequence token and its tokenizer has none", parameter=spec.parameter)
        key = (spec.kind, spec.source)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
        if grammar is None:
            grammar = self._build(spec)
            with self._lock:
                self._cache[key] = grammar
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return CompiledGrammar(spec, grammar, self.eos, self.vocab_size, self.tokenizer)  # type: ignore[arg-type]

    def _build(self, spec: GrammarSpec) -> str:
        """The llguidance grammar of ``spec``, checked against the tokenizer."""
        import llguidance

        matcher = llguidance.LLMatcher
        try:
            if spec.kind in ("json", "tool_call"):
                grammar = matcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = matcher.grammar_from_regex(spec.source)
            else:
                grammar = matcher.grammar_from_lark(spec.source)
            failed, messages = matcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        except (ValueError, TypeError) as err:
            failed, messages = True, [str(err)]
        if failed:
            what = {"json": "only JSON-schema features raylens enforces", "tool_call": "tools whose parameters use "
                    "only JSON-schema features raylens enforces", "regex": "a regex raylens can compile",
                    "grammar": "a Lark grammar raylens can compile"}[spec.kind]
            reason = " ".join(messages[0].split())[:400] if messages else "rejected"
            raise InvalidRequestError(f"`{spec.parameter}` must be {what}, got: {reason}; remove or rewrite that "
                                      "part (docs/structured-outputs.md lists what is supported)",
                                      parameter=spec.parameter, value=reason)
        return grammar


class _TokenTable:
    """What llguidance's ``TokenizerWrapper`` reads, from any tokenizer with ``encode``/``decode``
    (a slow or a test tokenizer): each id's text as bytes; ids that decode to nothing with
    ``skip_special_tokens`` are special."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int) -> None:
        self.eos_token_id, self.bos_token_id = eos, getattr(tokenizer, "bos_token_id", None)
        self.tokens = [tokenizer.decode([i]).encode("utf-8") for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if not tokenizer.decode([i], skip_special_tokens=True)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos: int) -> Any:
    """llguidance's view of ``tokenizer``: from its fast (Rust) tokenizer when it has one."""
    import llguidance
    import llguidance.hf

    if getattr(tokenizer, "is_fast", False):
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer, vocab_size, eos)))
