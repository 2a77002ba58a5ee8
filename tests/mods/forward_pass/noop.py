"""ForwardPass + Noop: inspects the top logprobs; the output equals the mod-free one."""
from quote_mod_sdk import ForwardPass, mod


@mod
def forward_pass_noop(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        logprobs, indices = event.top_k_logprob(3)
        assert logprobs.shape == (1, 3) and indices.shape == (1, 3)
        return actions.noop()
