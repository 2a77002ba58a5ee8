"""ForwardPass + ForceTokens: the output starts with " [INJECTED]" (forced at the first step)."""
from quote_mod_sdk import ForwardPass, mod

_done = set()


@mod
def forward_pass_force_tokens(event, actions, tokenizer):
    if isinstance(event, ForwardPass) and event.request_id not in _done:
        _done.add(event.request_id)
        return actions.force_tokens(tokens=tokenizer.encode(" [INJECTED]", add_special_tokens=False))
