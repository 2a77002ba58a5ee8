"""Prefilled + EmitError: the request is refused before any token."""
from quote_mod_sdk import Prefilled, mod


@mod
def prefilled_emit_error(event, actions, tokenizer):
    if isinstance(event, Prefilled):
        return actions.emit_error("prompt refused by policy")
