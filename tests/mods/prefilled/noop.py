"""Prefilled + Noop: reads the prompt and changes nothing; the output equals the mod-free one."""
from quote_mod_sdk import Prefilled, mod


@mod
def prefilled_noop(event, actions, tokenizer):
    if isinstance(event, Prefilled):
        tokenizer.decode(event.context_info.tokens[: event.context_info._prompt_len])
        return actions.noop()
