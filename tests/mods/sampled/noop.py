"""Sampled + Noop: logs each sample; the output equals the mod-free one."""
from quote_mod_sdk import Sampled, mod


@mod
def sampled_noop(event, actions, tokenizer):
    if isinstance(event, Sampled):
        print(f"sampled {event.sampled_token}")
        return actions.noop()
