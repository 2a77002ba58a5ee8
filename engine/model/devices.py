"""Resolve ``device="auto"`` and ``dtype="auto"`` once, when a backend loads."""

from __future__ import annotations

import torch

from engine.errors import DeviceUnavailableError

__all__ = ["resolve_device", "resolve_dtype", "available_devices"]


def available_devices() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def resolve_device(device: str) -> torch.device:
    """``auto`` picks mps, then cuda, then cpu; a named device must exist here."""
    if device == "auto":
        if torch.backends.mps.is_available():
            return torch.device("mps")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    base, _, index = device.partition(":")
    ok = {
        "cpu": True,
        "mps": torch.backends.mps.is_available(),
        "cuda": torch.cuda.is_available() and (not index or int(index) < torch.cuda.device_count()),
    }[base]
    if not ok:
        raise DeviceUnavailableError(
            f"`device` must be available on this machine ({', '.join(available_devices())}), got {device!r}; "
            "set CONCORDANCE_DEVICE=auto or one of those",
            parameter="device",
            value=device,
        )
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on cpu/mps; bfloat16 on CUDA where supported, else float16."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
