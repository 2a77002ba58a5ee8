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
    """The machine and versions a report ran on. The CPU's model is named: a shared VM's host may
    be a different processor from one day to the next, and the ratios of a host-bound bench move
    with it."""
    import os

    import torch
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": backend.info.device,
        "dtype": backend.info.dtype,
    }
    if backend.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(backend.device)
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    """The processor's model name (Linux's ``/proc/cpuinfo``; elsewhere what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
