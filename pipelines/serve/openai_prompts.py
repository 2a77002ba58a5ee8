"""Completions prompts: text, token ids, or a list of either, as token ids and token pieces.

A text prompt is tokenised as plain text (no chat template), with the tokenizer's own special
tokens (this model adds none). A token piece is the text one token adds to the decoded sequence,
so the pieces of a sequence concatenate to its text and ``text_offset`` can point into it; a
character split over several byte-level tokens belongs to the token that completes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.detokenizer import token_pieces

from .errors import ApiError, ErrorCode
from .openai_models import MAX_PROMPTS
from .service import Service

__all__ = ["Prompt", "parse_prompts", "token_pieces", "split_inputs"]

_SHAPE = "a non-empty string, a non-empty list of token ids, or a list of either"


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, the text an ``echo`` shows (the given text, or the ids decoded),
    and how many of the ids the tokenizer added in front of a given text (a BOS: no text of its own)."""

    ids: list[int]
    text: str
    added: int = 0

    def pieces(self, tokenizer: Any) -> list[str]:
        """The text each token adds: they concatenate to :attr:`text`."""
        return [""] * self.added + token_pieces(tokenizer, self.ids[self.added:])


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def split_inputs(raw: Any, field: str, most: int, shape: str = _SHAPE) -> tuple[list[Any], list[str]]:
    """OpenAI's "a text or token ids, or a list of either" (``prompt``, embeddings' ``input``): the
    items and the name of each (``field`` or ``field[i]``), at most ``most`` of them, else a 400."""
    if isinstance(raw, str) or _is_ids(raw):
        items, names = [raw], [field]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) or _is_ids(x) for x in raw):
        items, names = raw, [f"{field}[{i}]" for i in range(len(raw))]
    else:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`{field}` must be {shape}, got {str(raw)[:80]}.", field)
    if len(items) > most:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`{field}` must hold at most {most} items, got "
                                                  f"{len(items)}; send several requests.", field)
    return items, names


def parse_prompts(service: Service, prompt: Any) -> list[Prompt]:
    """The request's prompts, each checked (non-empty; ids in the vocabulary) with a 400 naming it."""
    items, names = split_inputs(prompt, "prompt", MAX_PROMPTS)
    out = []
    for item, name in zip(items, names):
        if isinstance(item, str):
            ids = list(service.tokenizer(item)["input_ids"]) if item else []
            if not ids:
                raise ApiError(ErrorCode.INVALID_REQUEST, f"`{name}` must be {_SHAPE}, got {item!r}.", name)
            plain = list(service.tokenizer(item, add_special_tokens=False)["input_ids"])
            added = len(ids) - len(plain) if plain and ids[len(ids) - len(plain):] == plain else 0
            out.append(Prompt(ids, item, added))
        else:
            service.check_token_ids(item, name)
            out.append(Prompt(list(item), "".join(token_pieces(service.tokenizer, item))))
    return out


