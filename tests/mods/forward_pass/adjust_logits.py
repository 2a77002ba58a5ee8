"""ForwardPass + AdjustedLogits: the token "The" is banned at every step, via max.driver.Tensor."""
import numpy as np
from max.driver import Tensor
from quote_mod_sdk import ForwardPass, mod
from shared.types import AdjustedLogits


@mod
def forward_pass_adjust_logits(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        banned = tokenizer.encode("The", add_special_tokens=False)[0]
        logits = event.logits.to_numpy().copy()
        logits[0, banned] = -np.inf
        action = actions.adjust_logits(Tensor.from_numpy(logits).to(event.logits.device))
        assert isinstance(action, AdjustedLogits)
        return action
