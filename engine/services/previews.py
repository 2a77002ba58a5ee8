"""Request previews: the words a user typed, out of a chat-templated prompt.

The requests table keeps a request's prompt as the model read it: the chat template applied, its
system prompt included (SmolLM2's template adds one when the request has none). A list of requests
that previewed the prompt's first characters would show that system prompt on every row. A
preview is therefore the prompt's last user turn, found by the turn markers of the chat templates
of the supported model families; a prompt with none of them (raw text, ``input_ids``) previews as
it is.
"""

from __future__ import annotations

__all__ = ["USER_TURNS", "last_user_message", "preview"]

#: (start of a user turn, end of that turn) in the chat templates of the supported families.
USER_TURNS: tuple[tuple[str, str], ...] = (
    ("<|im_start|>user\n", "<|im_end|>"),  # ChatML: SmolLM2, Qwen2/3
    ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),  # Llama 3
    ("<start_of_turn>user\n", "<end_of_turn>"),  # Gemma 2/3
    ("[INST]", "[/INST]"),  # Mistral, Llama 2
)


def last_user_message(prompt_text: str | None) -> str | None:
    """The text of the last user turn in ``prompt_text``, or None when it has no user turn."""
    if not prompt_text:
        return None
    found = max(((prompt_text.rfind(start), start, end) for start, end in USER_TURNS), key=lambda f: f[0])
    at, start, end = found
    if at < 0:
        return None
    body = prompt_text[at + len(start):]
    stop = body.find(end)
    return (body if stop < 0 else body[:stop]).strip()


def preview(prompt_text: str | None, chars: int = 200) -> str | None:
    """The first ``chars`` characters of the last user message, or of the prompt without one."""
    text = last_user_message(prompt_text)
    if text is None:
        text = prompt_text
    return None if text is None else text[:chars]
