"""A package-style mod: a relative import and an absolute intra-bundle import, as the airline
agent has. At the first ForwardPass it forces the greeting from its sibling module."""

from examples.greeter.phrases import GREETING as ABSOLUTE
from quote_mod_sdk import ForwardPass, mod

from .phrases import GREETING

_done = set()


@mod
def greeter(event, actions, tokenizer):
    assert GREETING == ABSOLUTE
    if isinstance(event, ForwardPass) and event.request_id not in _done:
        _done.add(event.request_id)
        return actions.force_tokens(tokenizer.encode(GREETING, add_special_tokens=False))
