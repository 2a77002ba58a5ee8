"""Added + ForceTokens: " capital" is followed by " city" (committed silently)."""
from quote_mod_sdk import Added, mod


@mod
def added_force_tokens(event, actions, tokenizer):
    if isinstance(event, Added) and tokenizer.decode(event.added_tokens) == " capital":
        return actions.force_tokens(tokens=tokenizer.encode(" city", add_special_tokens=False))
