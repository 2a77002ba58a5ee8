"""Completions prompts: text, token ids, or a list of either, as token ids and token pieces.

A text prompt is tokenised as plain text (no chat template), with the tokenizer's own special
tokens (this model adds none). A token piece is the text one token adds to the decoded sequence,
so the pieces of a sequence concatenate to its text and ``text_offset`` can point into it; a
character split over several byte-level tokens belongs to the token that completes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .errors import ApiError, ErrorCode
from .openai_models import MAX_PROMPTS
from .service import Service

__all__ = ["Prompt", "parse_prompts", "token_pieces"]

_SHAPE = "a non-empty string, a non-empty list of token ids, or a list of either"
_WINDOW = 6  # tokens of context decoded before a piece: enough for any merge of byte-level tokens
_PARTIAL = "\ufffd"  # what decoding shows for the bytes of a character not yet complete


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids and the text an ``echo`` shows (the given text, or the ids decoded)."""

    ids: list[int]
    text: str


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def parse_prompts(service: Service, prompt: Any) -> list[Prompt]:
    """The request's prompts, each checked (non-empty; ids in the vocabulary) with a 400 naming it."""
    if isinstance(prompt, str) or _is_ids(prompt):
        items, names = [prompt], ["prompt"]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        items, names = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
    else:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`prompt` must be {_SHAPE}, got {str(prompt)[:80]}.", "prompt")
    if len(items) > MAX_PROMPTS:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`prompt` must hold at most {MAX_PROMPTS} prompts, got "
                                                  f"{len(items)}; send several requests.", "prompt")
    out = []
    for item, name in zip(items, names):
        if isinstance(item, str):
            ids = list(service.tokenizer(item)["input_ids"]) if item else []
            if not ids:
                raise ApiError(ErrorCode.INVALID_REQUEST, f"`{name}` must be {_SHAPE}, got {item!r}.", name)
            out.append(Prompt(ids, item))
        else:
            service.check_token_ids(item, name)
            out.append(Prompt(list(item), "".join(token_pieces(service.tokenizer, item))))
    return out


def token_pieces(tokenizer: Any, ids: Sequence[int], *, skip_special_tokens: bool = False) -> list[str]:
    """The text each token of ``ids`` adds (``""`` for a token that only starts a character);
    ``"".join(pieces)`` is the decoded text. Decodes a few tokens of context per token, not the
    whole prefix, so a long prompt costs linear time."""
    ids = [int(t) for t in ids]
    pieces: list[str] = []
    done = 0  # tokens whose text is out
    for i in range(len(ids)):
        start = max(0, done - _WINDOW)
        before = tokenizer.decode(ids[start:done], skip_special_tokens=skip_special_tokens)
        after = tokenizer.decode(ids[start:i + 1], skip_special_tokens=skip_special_tokens)
        if after.endswith(_PARTIAL) and i + 1 < len(ids):
            pieces.append("")
            continue
        pieces.append(after[len(before):])
        done = i + 1
    return pieces
