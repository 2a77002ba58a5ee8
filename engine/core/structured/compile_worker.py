"""The child process that compiles grammars for :class:`~engine.core.structured.isolation.CompilePool`
(:func:`main`), so that a grammar crashing llguidance's
compiler kills this process, never the engine's.

Protocol (``multiprocessing.connection`` framing over its stdin and a private copy of its stdout;
fd 1 itself is pointed at stderr, so nothing a library prints can corrupt a reply):

1. the parent sends a :class:`WorkerSetup`'s fields (a dict); the child builds the llguidance tokenizer and answers
   ``("ready", None)``;
2. then, per job, the parent sends ``(kind, source)`` (a :class:`GrammarSpec`'s) and the child
   answers ``("ok", grammar)`` — the llguidance grammar text, which compiled and took its first
   step — or ``("refused", reason)``.

The child exits when its stdin closes (the parent closed the pool, or died).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from engine.core.structured.native import CHILD_STACK_BYTES, parser_limits, run_with_stack

__all__ = ["WorkerSetup", "TokenTable", "llg_grammar", "check_grammar", "main"]

#: JSON grammars: no free whitespace (a small model given free whitespace can spend its budget on
#: it); the separators are the ones models write (and json.dumps' defaults)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class WorkerSetup:
    """What the child needs to compile exactly as the engine does: the tokenizer's token table
    (each id's bytes, the special ids, the end and start tokens, the logits' width) and the
    ``structured`` config's llguidance limits."""

    tokens: Sequence[bytes]
    special_token_ids: Sequence[int]
    eos: int
    bos: int | None
    vocab_size: int
    limits: Mapping[str, int]


class TokenTable:
    """What llguidance's ``TokenizerWrapper`` reads. Compiling and masking read only the token
    table; text is tokenized (rarely, e.g. a grammar's literal special token) greedily, by the
    llguidance tokenizer built over this same table."""

    def __init__(self, setup: WorkerSetup) -> None:
        self.tokens = list(setup.tokens)
        self.special_token_ids = list(setup.special_token_ids)
        self.eos_token_id, self.bos_token_id = setup.eos, setup.bos
        self.tokenizer: Any = None

    def __call__(self, text: str) -> list[int]:
        return list(self.tokenizer.greedy_tokenize(text))


def llg_grammar(kind: str, source: str) -> str:
    """The llguidance grammar of a spec (``kind``, ``source``: see :class:`GrammarSpec`);
    ``ValueError`` for JSON it cannot read."""
    import llguidance

    matcher = llguidance.LLMatcher
    if kind in ("json", "tool_call"):
        return matcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(source)
    return matcher.grammar_from_lark(source)


def check_grammar(tokenizer: Any, limits: Mapping[str, int], kind: str, source: str) -> tuple[str, str]:
    """Compile ``source`` and take its first step: ``("ok", grammar)`` or ``("refused", reason)``."""
    import llguidance

    try:
        grammar = llg_grammar(kind, source)
    except (ValueError, TypeError) as err:
        return "refused", str(err)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits(limits))
    if matcher.is_error():
        return "refused", matcher.get_error()
    matcher.compute_bitmask()  # the first step's mask, under the step limits
    if matcher.is_error():
        return "refused", f"its first step failed: {matcher.get_error()}"
    return "ok", grammar


def _tokenizer(setup: WorkerSetup) -> Any:
    import llguidance

    table = TokenTable(setup)
    table.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), n_vocab=setup.vocab_size,
                                             eos_token=setup.eos)
    return table.tokenizer


def main() -> int:
    from multiprocessing.connection import Connection

    replies = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inbox, outbox = Connection(0, writable=False), Connection(replies, readable=False)
    try:
        setup = WorkerSetup(**inbox.recv())
    except EOFError:
        return 0
    tokenizer = _tokenizer(setup)
    outbox.send(("ready", None))
    while True:
        try:
            kind, source = inbox.recv()
        except EOFError:  # the pool closed this worker, or its process is gone
            return 0
        outbox.send(run_with_stack(lambda: check_grammar(tokenizer, setup.limits, kind, source), CHILD_STACK_BYTES))

