"""Sampled + EmitError: the first sample is rejected with an error."""
from quote_mod_sdk import Sampled, mod


@mod
def sampled_emit_error(event, actions, tokenizer):
    if isinstance(event, Sampled):
        return actions.emit_error("sample rejected")
