"""Added + Noop: decodes what was added; the output equals the mod-free one."""
from quote_mod_sdk import Added, mod


@mod
def added_noop(event, actions, tokenizer):
    if isinstance(event, Added):
        tokenizer.decode(event.added_tokens)
        return actions.noop()
