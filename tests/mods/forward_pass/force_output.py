"""ForwardPass + ForceOutput: after 3 tokens the whole output becomes " [END]"."""
from quote_mod_sdk import Added, ForwardPass, mod

_counts = {}


@mod
def forward_pass_force_output(event, actions, tokenizer):
    rid = event.request_id
    if isinstance(event, Added):
        _counts[rid] = _counts.get(rid, 0) + len(event.added_tokens)
    if isinstance(event, ForwardPass) and _counts.get(rid, 0) >= 3:
        return actions.force_output(tokens=tokenizer.encode(" [END]", add_special_tokens=False))
