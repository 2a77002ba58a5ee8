"""Sampled + ForceOutput: at the fifth sample the output becomes " [SAMPLED_END]"."""
from quote_mod_sdk import Sampled, mod

_seen = {}


@mod
def sampled_force_output(event, actions, tokenizer):
    if isinstance(event, Sampled):
        _seen[event.request_id] = _seen.get(event.request_id, 0) + 1
        if _seen[event.request_id] == 5:
            return actions.force_output(tokens=tokenizer.encode(" [SAMPLED_END]", add_special_tokens=False))
