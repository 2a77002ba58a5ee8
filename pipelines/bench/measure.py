"""What every bench shares: the prompt, the logits-adjusting mod, and the machine a report ran on."""

from __future__ import annotations

import platform
from typing import Any

__all__ = ["PROMPT", "_mask_mod", "_machine"]

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _mask_mod():
    """A logits-adjusting mod in the SelfPrompt style: numpy mask, back through ``from_numpy``."""
    from mods import ForwardPass, mod

    @mod
    def ban_token_zero(event, actions, tokenizer):
        if isinstance(event, ForwardPass):
            logits = event.logits.to_numpy()
            logits[0, 0] = -1e9
            return actions.adjust_logits(type(event.logits).from_numpy(logits).to(event.logits.device))
        return None

    return ban_token_zero


def _machine(backend: Any) -> dict[str, Any]:
    import os

    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": backend.info.device,
        "dtype": backend.info.dtype,
    }
    if backend.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(backend.device)
    return info
