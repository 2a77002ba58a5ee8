"""ForwardPass + Backtrack: after 3 sampled tokens, erase the last one and write " Rome" instead."""
from quote_mod_sdk import Added, ForwardPass, mod

_counts = {}
_done = set()


@mod
def forward_pass_backtrack(event, actions, tokenizer):
    rid = event.request_id
    if isinstance(event, Added) and not event.forced:
        _counts[rid] = _counts.get(rid, 0) + len(event.added_tokens)
    if isinstance(event, ForwardPass) and _counts.get(rid, 0) >= 3 and rid not in _done:
        _done.add(rid)
        return actions.backtrack(steps=1, tokens=tokenizer.encode(" Rome", add_special_tokens=False))
