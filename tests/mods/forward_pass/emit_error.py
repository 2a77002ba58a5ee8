"""ForwardPass + EmitError: the request fails at step 2 with an error message."""
from quote_mod_sdk import ForwardPass, mod


@mod
def forward_pass_emit_error(event, actions, tokenizer):
    if isinstance(event, ForwardPass) and event.step == 2:
        return actions.emit_error("forward pass limit reached")
