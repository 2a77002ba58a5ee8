"""Added + EmitError: the word " France" is refused."""
from quote_mod_sdk import Added, mod


@mod
def added_emit_error(event, actions, tokenizer):
    if isinstance(event, Added) and tokenizer.decode(event.added_tokens) == " France":
        return actions.emit_error("France is off limits")
