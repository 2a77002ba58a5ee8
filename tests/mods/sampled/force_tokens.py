"""Sampled + ForceTokens: the first sample is replaced by " [OBSERVED]"."""
from quote_mod_sdk import Sampled, mod

_done = set()


@mod
def sampled_force_tokens(event, actions, tokenizer):
    if isinstance(event, Sampled) and event.request_id not in _done:
        _done.add(event.request_id)
        return actions.force_tokens(tokens=tokenizer.encode(" [OBSERVED]", add_special_tokens=False))
