"""TensorShim: the ``max.driver.Tensor`` surface over a ``torch.Tensor``; the only torch↔numpy
bridge for mods.

Mods written for the original engine call ``logits.to_numpy()``, ``Tensor.from_numpy(arr)``,
``type(logits).from_numpy(...)``, ``.to(logits.device)``, ``.shape`` and indexing.
The engine binds this class as ``max.driver.Tensor`` so all of those round-trip.

``to_numpy()`` returns a float32 host *copy* (float16 logits would overflow the ``-1e9`` masks
mods write; a copy keeps a mod's in-place edits from leaking into the engine's tensors). On a
GPU the copy happens only when a mod asks for it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["TensorShim", "as_torch"]


class TensorShim:
    """``readonly``: the tensors events hand mods are the engine's own (a row of the batch's
    logits, a slice of captured internals); writing into them would change what the engine samples
    while the payload records a Noop, so writes raise. A mod changes logits by returning
    ``AdjustedLogits`` with an edited copy (``to_numpy()`` already returns a copy)."""

    __slots__ = ("_tensor", "_readonly")

    def __init__(self, tensor: torch.Tensor, *, readonly: bool = False) -> None:
        self._tensor = tensor
        self._readonly = readonly

    def _check_writable(self) -> None:
        if self._readonly:
            raise TypeError("this tensor is read-only (it is the engine's own); edit a copy from to_numpy() and "
                            "return it with actions.adjust_logits(...) / AdjustedLogits(...)")

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "TensorShim":
        """Wrap a host copy of ``array``; move it with ``.to(device)`` if needed."""
        return cls(torch.from_numpy(np.array(array, copy=True)))

    @property
    def tensor(self) -> torch.Tensor:
        """The wrapped torch tensor (no copy)."""
        return self._tensor

    def to_numpy(self) -> np.ndarray:
        host = self._tensor.detach()
        if host.is_floating_point():
            host = host.to(dtype=torch.float32)
        host = host.cpu()
        # Copy only when ``host`` still shares memory with the engine's tensor.
        return host.numpy().copy() if host.data_ptr() == self._tensor.data_ptr() else host.numpy()

    def numpy(self) -> np.ndarray:
        return self.to_numpy()

    def to(self, device: Any) -> "TensorShim":
        target = torch.device(device) if not isinstance(device, torch.device) else device
        return self if self._tensor.device == target else TensorShim(self._tensor.to(target))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._tensor.shape)

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    def copy_(self, array: np.ndarray) -> "TensorShim":
        self._check_writable()
        self._tensor.copy_(torch.as_tensor(np.asarray(array), dtype=self._tensor.dtype))
        return self

    def __getitem__(self, key: Any) -> "TensorShim":
        return TensorShim(self._tensor[key], readonly=self._readonly)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._check_writable()
        self._tensor[key] = as_torch(value, device=self._tensor.device, dtype=self._tensor.dtype)

    def __float__(self) -> float:
        return float(self._tensor)

    def __int__(self) -> int:
        return int(self._tensor)

    def item(self) -> Any:
        return self._tensor.item()

    def __len__(self) -> int:
        return len(self._tensor)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.to_numpy()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        return f"TensorShim(shape={self.shape}, dtype={self._tensor.dtype}, device={self._tensor.device})"


def as_torch(value: Any, *, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A torch tensor on ``device`` from a TensorShim, torch tensor, numpy array, scalar or any
    object with ``to_numpy()`` (e.g. a mod's own Tensor class)."""
    if isinstance(value, TensorShim):
        t = value.tensor
    elif isinstance(value, torch.Tensor):
        t = value
    elif isinstance(value, np.ndarray) or np.isscalar(value):
        t = torch.as_tensor(np.asarray(value))
    elif hasattr(value, "to_numpy"):
        t = torch.as_tensor(np.asarray(value.to_numpy()))
    else:
        t = torch.as_tensor(value)
    return t.to(device=device, dtype=dtype) if dtype is not None else t.to(device=device)
