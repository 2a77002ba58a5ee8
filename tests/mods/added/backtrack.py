"""Added + Backtrack: " of France" is replaced by " of Spain" once " France" is added."""
from quote_mod_sdk import Added, mod


@mod
def added_backtrack(event, actions, tokenizer):
    if isinstance(event, Added) and not event.forced and tokenizer.decode(event.added_tokens) == " France":
        return actions.backtrack(steps=2, tokens=tokenizer.encode(" of Spain", add_special_tokens=False))
