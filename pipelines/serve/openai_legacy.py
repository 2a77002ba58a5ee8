"""OpenAI's legacy completions ``logprobs`` object, built token by token.

``tokens[i]`` is the text token ``i`` added, ``text_offset[i]`` where that text starts in the
choice's ``text``, ``token_logprobs[i]`` its log-prob and ``top_logprobs[i]`` its ``k`` best
alternatives as ``{token text: logprob}``. The first echoed prompt token has nothing before it:
its log-prob and alternatives are null, as OpenAI reports them. Prompt tokens are scored under
the model's own distribution (``Engine.score``); generated tokens under the distribution they
were drawn from (temperature, top-k and top-p applied), as chat ``logprobs`` are; a token a mod
forced has a null log-prob.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["LegacyLogprobs"]


class LegacyLogprobs:
    def __init__(self, decode: Callable[[list[int]], str], k: int, *, offset: int = 0) -> None:
        """``offset``: where the first token added starts in the choice's text."""
        self.decode, self.k = decode, k
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.offset = offset  # where the next token's text starts

    def add(self, piece: str, logprob: float | None, top: Sequence[tuple[int, float]] | None) -> None:
        """One token; ``top`` None: no alternatives exist (the first prompt token)."""
        self.tokens.append(piece)
        self.token_logprobs.append(None if logprob is None else float(logprob))
        if top is None:
            self.top_logprobs.append(None)
        else:
            best: dict[str, float] = {}
            for token_id, value in list(top)[: self.k]:
                best.setdefault(self.decode([int(token_id)]), float(value))  # two ids may share a text
            self.top_logprobs.append(best)
        self.text_offset.append(self.offset)
        self.offset += len(piece)

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
