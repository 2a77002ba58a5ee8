"""Prefilled + AdjustedPrefill: asks about Italy instead of France, with a budget of 6 tokens."""
from quote_mod_sdk import Prefilled, mod


@mod
def prefilled_adjust_prefill(event, actions, tokenizer):
    if isinstance(event, Prefilled):
        info = event.context_info
        prompt = tokenizer.decode(info.tokens[: info._prompt_len])
        return actions.adjust_prefill(
            tokens=tokenizer.encode(prompt.replace("France", "Italy"), add_special_tokens=False), max_steps=6
        )
