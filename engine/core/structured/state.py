"""One request's place in its grammar: which tokens may come next (a packed bitmask the batched
sampler applies), and the matcher kept in step with the request's committed tokens — advanced by
every token that joins the sequence (sampled, forced, reinjected) and rolled back by exactly the
tokens a Backtrack erases (``engine/core/request.py`` calls both; nothing else moves it).

Forced tokens the grammar rejects bypass it: a mod may force text of its own (a question to the
model, a scratchpad) and erase it later, as the SDK's flows do. From the first rejected token the
state is *detached*: the matcher stays where it was, the tokens after it are only counted, nothing
is masked. A Backtrack erases the counted tokens first and then rolls the matcher back, so once the
off-grammar tokens are gone the grammar applies again from exactly where it left off.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Sequence

import torch

from engine.errors import GrammarError

__all__ = ["GrammarState"]


class GrammarState:
    """``mask()`` ``(W,)`` int32, ``W = ceil(V / 32)``: bit ``t % 32`` of word ``t // 32`` set when
    token ``t`` may come next. The bitmask is this request's own and is refilled each step."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        # a copy of the matcher the compiler built once: a grammar is compiled by this process
        # only after a child process compiled it (engine/core/structured/native.py says why)
        self.matcher = compiled.matcher.deep_copy()
        self.bitmask = torch.full((1, (compiled.vocab_size + 31) // 32), -1, dtype=torch.int32)
        self.eos = compiled.eos
        self.detached = 0  # tokens committed after the first one the grammar rejected

    @property
    def spec(self) -> Any:
        return self.compiled.spec

    @property
    def attached(self) -> bool:
        """Every committed token followed the grammar: it masks the next one."""
        return self.detached == 0

    @property
    def ended(self) -> bool:
        """The output is complete: the grammar took its end token, or nothing can follow what it
        took (and no off-grammar token came after)."""
        return self.detached == 0 and bool(self.matcher.is_stopped()) and not self.matcher.is_error()

    def mask(self, *, hold_end: bool = False) -> torch.Tensor:
        """The next token's allowed set. ``hold_end`` (``min_tokens`` not reached): the end token is
        left out, unless it is the only token allowed (the grammar decides when its output ends)."""
        # what llguidance.torch.fill_next_token_bitmask does, without importing that module (it
        # compiles a torch kernel at import, which the sampler's own unpacking makes unneeded)
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)
        if self.matcher.is_error():
            raise self._failure("failed")
        row = self.bitmask[0]
        if hold_end:
            word, bit = divmod(self.eos, 32)
            kept = int(row[word]) & ~(1 << bit)
            if kept != 0 or bool(torch.cat([row[:word], row[word + 1:]]).any()):
                row[word] = kept  # Python ints are two's complement: an int32 stays in range
        return row

    def advance(self, tokens: Sequence[int]) -> int:
        """Take ``tokens`` in order; how many the grammar accepted (the matcher stops before the
        first it rejects, which detaches the state; detached, it accepts none)."""
        if not tokens:
            return 0
        if self.detached:
            self.detached += len(tokens)
            return 0
        ok = int(self.matcher.validate_tokens(list(tokens)))
        if ok and not self.matcher.consume_tokens(list(tokens[:ok])):
            raise self._failure("failed")
        self.detached = len(tokens) - ok
        return ok

    def rollback(self, n: int) -> None:
        """The newest ``n`` committed tokens were erased: the off-grammar ones first, then the
        matcher's own."""
        off = min(n, self.detached)
        self.detached -= off
        if n - off > 0 and not self.matcher.rollback(n - off):
            raise self._failure(f"could not roll back {n - off} tokens")

    def _failure(self, what: str) -> GrammarError:
        """A step of the grammar failed (a step limit of the ``structured`` config, or llguidance's
        own state): the request's error names its field, not a mod."""
        parameter = self.spec.parameter
        return GrammarError(f"`{parameter}` must be a grammar whose every step stays within the structured.* limits, "
                            f"got one that {what}: {self.error()}", parameter=parameter, value=self.error())

    def error(self) -> str:
        return " ".join(str(self.matcher.get_error()).replace("<non-verbose/>", "").split())[:300]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.compiled.tokenizer.decode_str([t for t in tokens if t != self.eos])

    def tool_call(self, tokens: Sequence[int]) -> dict[str, Any]:
        """The tool call a finished ``tool_call`` grammar's output is, in the shape of a mod's
        ToolCalls payload for one call: ``{"id", "type": "function", "function": {"name",
        "arguments": <JSON text>}}``."""
        value = json.loads(self.decode(tokens))
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])}}
