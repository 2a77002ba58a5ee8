"""Prefilled + ForceOutput: the output is exactly the canned emergency text, no token generated."""
from quote_mod_sdk import Prefilled, mod


@mod
def prefilled_force_output(event, actions, tokenizer):
    if isinstance(event, Prefilled):
        return actions.force_output(tokenizer.encode("EMERGENCY PROTOCOL ACTIVATED.", add_special_tokens=False))
