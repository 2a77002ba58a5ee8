"""One choice's text as the client sees it: tokens in, text pieces out, erasures, stop strings.

Each committed token adds the text its decoding adds (so the pieces concatenate to the decoded
output); a stop token adds nothing. A Backtrack erases the newest tokens. A stop string cuts the
text before it and ends the choice; while the text's end might still become a stop string, those
characters are held back from the stream until the next token decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from engine.core.detokenizer import IncrementalDetokenizer

from .bridge import Stream
from .engine_stream import Erased, TokenEvent

__all__ = ["Sample", "ChoiceText"]


@dataclass(frozen=True)
class Sample:
    """One visible token: its id, the text it added, its log-prob (None for a forced token), its
    best alternatives ``((id, logprob), ...)`` when they were asked for, and the event that
    committed it (``first_of_event``: the token sampled at that event's position; a forced chunk's
    later tokens share its event)."""

    token_id: int
    piece: str
    logprob: float | None
    top: tuple[tuple[int, float], ...]
    event: TokenEvent | None = None
    first_of_event: bool = True


class ChoiceText:
    """What the client has seen of one choice: token ids, the text each added, and (when
    ``keep_samples``) each token's :class:`Sample`. Text comes from the engine's incremental
    detokenizer and stop strings are looked for only where new text could complete one, so each
    token costs the same however long the choice already is."""

    def __init__(self, tokenizer: Any, stops: list[str], *, keep_samples: bool) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.keep_samples = keep_samples
        self.stop_ids: frozenset[int] = frozenset()  # the engine's stop set, once the request is accepted
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.samples: list[Sample] = []
        self.stopped_by_string = False
        self._longest_stop = max((len(s) for s in stops), default=0)
        self._length = 0  # characters of text

    @property
    def ids(self) -> list[int]:
        return self.detokenizer.ids

    @property
    def pieces(self) -> list[str]:
        return self.detokenizer.pieces

    def text(self) -> str:
        return "".join(self.pieces)

    def _tail(self, chars: int) -> str:
        """The last ``chars`` characters of the text (from the newest pieces only)."""
        out, have = [], 0
        for piece in reversed(self.pieces):
            if have >= chars:
                break
            out.append(piece)
            have += len(piece)
        return "".join(reversed(out))[-chars:] if chars else ""

    def push(self, event: TokenEvent) -> list[str]:
        """Record an event's visible tokens; the text pieces to send (one per token)."""
        out = []
        for i, token_id in enumerate(event.token_ids):
            if token_id in self.stop_ids:
                continue
            piece = self.detokenizer.push(token_id)
            self._length += len(piece)
            if self.keep_samples:
                lp = event.logprobs[i] if i < len(event.logprobs) else None
                top = event.top_logprobs[i] if event.top_logprobs is not None and i < len(event.top_logprobs) else ()
                self.samples.append(Sample(int(token_id), piece, lp, tuple(top), event, i == 0))
            out.append(piece)
        return out

    def erase(self, n: int) -> int:
        pieces = self.pieces
        n = min(n, len(pieces))
        self._length -= sum(len(p) for p in pieces[len(pieces) - n:])
        self.detokenizer.erase(n)
        if self.samples:
            del self.samples[max(0, len(self.samples) - n):]
        return n

    def hit_stop_string(self, new: int | None = None) -> bool:
        """True once the text holds a stop string; the text is cut before it. ``new``: characters
        added since the last look (a stop string can only end in them; None: look everywhere)."""
        if not self.stops:
            return False
        window = self._length if new is None else min(self._length, new + self._longest_stop - 1)
        tail = self._tail(window)
        cuts = [tail.find(s) for s in self.stops if s in tail]
        if not cuts:
            return False
        keep = self._length - len(tail) + min(cuts)
        pieces = self.pieces
        while self._length > keep and pieces:
            if self._length - len(pieces[-1]) >= keep:
                self.erase(1)
            else:
                cut = keep - (self._length - len(pieces[-1]))
                self._length -= len(pieces[-1]) - cut
                pieces[-1] = pieces[-1][:cut]
        self.stopped_by_string = True
        return True

    def held_back(self) -> int:
        """Characters at the end that might start a stop string, kept until the next token decides."""
        text, hold = self._tail(self._longest_stop), 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def completion_tokens(self, result: Any) -> int:
        """Tokens the choice generated: the engine's count, or what is left after a stop string."""
        return len(result.output_ids) if not self.stopped_by_string else len(self.ids)

    async def follow(self, stream: Stream) -> AsyncIterator[tuple[str, Any]]:
        """("delta", text) / ("removed", n) as tokens arrive, honouring stop strings."""
        sent = 0  # characters of the text already sent
        async for event in stream:
            if isinstance(event, Erased):
                n = self.erase(event.n)
                sent = min(sent, self._length)
                if n:
                    yield "removed", n
                continue
            if not isinstance(event, TokenEvent):
                continue
            before = self._length
            self.push(event)
            if self.stops and self.hit_stop_string(self._length - before):
                stream.cancel()
                if self._length > sent:
                    yield "delta", self._tail(self._length - sent)
                return
            ready = self._length - self.held_back()
            if ready > sent:
                yield "delta", self._tail(self._length - sent)[:ready - sent]
                sent = ready
        if self._length > sent:
            yield "delta", self._tail(self._length - sent)
