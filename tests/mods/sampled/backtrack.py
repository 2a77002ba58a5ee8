"""Sampled + Backtrack: the third sample is removed and replaced by " [RESAMPLED]"."""
from quote_mod_sdk import ActionBuilder, Sampled, mod

_seen = {}


@mod
def sampled_backtrack(event, actions: ActionBuilder, tokenizer):
    if isinstance(event, Sampled):
        _seen[event.request_id] = _seen.get(event.request_id, 0) + 1
        if _seen[event.request_id] == 3:
            return actions.backtrack(steps=1, tokens=tokenizer.encode(" [RESAMPLED]", add_special_tokens=False))
