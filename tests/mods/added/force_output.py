"""Added + ForceOutput: once " is" is added the output becomes " [STOPPED]"."""
from quote_mod_sdk import Added, mod


@mod
def added_force_output(event, actions, tokenizer):
    if isinstance(event, Added) and tokenizer.decode(event.added_tokens) == " is":
        return actions.force_output(tokens=tokenizer.encode(" [STOPPED]", add_special_tokens=False))
