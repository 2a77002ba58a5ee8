"""Token ids in, text out, a token at a time: the one incremental detokenizer every route (chat and
completions streams, prompt echo) and the stop-string check use.

vLLM's ``detokenize_incrementally`` shape: two offsets into the ids — ``prefix`` (where the
decoded context starts) and ``read`` (how far the text is out). A new token decodes only
``ids[prefix:]``, a few tokens, and what that adds past the decoded context is the new text, once
it is complete: a byte-level token may end in the middle of a character (decoding shows U+FFFD),
and then the text waits for the token that completes it. So each token costs a decode of a
bounded window, never of the whole output (which made a long stream's cost grow with the square
of its length), and the pieces concatenate to the full decode of the ids.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["IncrementalDetokenizer", "token_pieces"]

PARTIAL = "\ufffd"  # what decoding shows for the bytes of a character not complete yet
# a character's text waits for at most this many tokens (4 bytes of UTF-8, and special tokens
# that decode to nothing); past it the window moves on and the replacement character stands
MAX_PENDING = 8


class IncrementalDetokenizer:
    """``push(id)`` → the text the token adds (``""`` while its character is incomplete: the
    completing token carries it); ``erase(n)`` drops the newest ``n`` tokens and their text;
    ``flush()`` → what is still pending (as a full decode shows it). ``pieces[i]`` is the text
    token ``i`` added; ``"".join(pieces) + flush()`` is ``tokenizer.decode(ids)``."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self._prefix = 0  # the decoded context starts here
        self._read = 0  # every token before this one is out in ``pieces``
        self._context: str | None = None  # decode(ids[prefix:read]), until the offsets move

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self._context is None:
            self._context = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        waiting = len(self.ids) - self._read
        if len(text) > len(self._context) and (not text.endswith(PARTIAL) or waiting >= MAX_PENDING):
            piece = text[len(self._context):]
            self._prefix, self._read, self._context = self._read, len(self.ids), None
        else:
            piece = ""
        self.pieces.append(piece)
        return piece

    def flush(self) -> str:
        """The text of tokens still waiting for their character (replacement characters, as a
        full decode shows them); they stay pending."""
        if self._read == len(self.ids):
            return ""
        context = self._decode(self.ids[self._prefix:self._read])
        return self._decode(self.ids[self._prefix:])[len(context):]

    def erase(self, n: int) -> int:
        """Drop the newest ``n`` tokens (at most all); how many went. A character that a dropped
        token completed goes back to waiting on the tokens that started it."""
        n = min(max(n, 0), len(self.ids))
        if not n:
            return 0
        del self.ids[len(self.ids) - n:], self.pieces[len(self.pieces) - n:]
        read = len(self.ids)
        while read > 0 and self.pieces[read - 1] == "":  # trailing tokens whose text had not come out
            read -= 1
        if read < self._read or self._read > len(self.ids):
            self._read = read
            self._prefix = max(0, read - MAX_PENDING)
            self._context = None
            # the tokens from the new read offset on had their text in a piece that was erased:
            # they are pending again (their own pieces were "" and stay so until the text returns)
        return n

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def token_pieces(tokenizer: Any, ids: Sequence[int], *, skip_special_tokens: bool = False) -> list[str]:
    """The text each token of ``ids`` adds (``""`` for a token that only starts a character; the
    last token's pending bytes, if any, as a full decode shows them): ``"".join(pieces)`` is the
    decoded text, in time linear in the number of tokens."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    for token_id in ids:
        detokenizer.push(token_id)
    pieces = detokenizer.pieces
    rest = detokenizer.flush()
    if rest and pieces:
        pieces[-1] += rest
    return pieces
