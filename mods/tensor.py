"""The tensor surface mods program against (legacy name ``max.driver.Tensor``).

The engine puts its own class (``engine.model.tensor.TensorShim``, over torch) into
``ForwardPass.logits`` and binds it as ``max.driver.Tensor``. This numpy-backed class is the
stand-in when no engine is around: scripted-model tests and tools that only read mods.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["TensorLike", "NumpyTensor"]


@runtime_checkable
class TensorLike(Protocol):
    """What the SDK and mods call on a logits tensor."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def device(self) -> Any: ...

    def to_numpy(self) -> np.ndarray: ...

    def to(self, device: Any) -> "TensorLike": ...


class NumpyTensor:
    """``max.driver.Tensor`` over a numpy array (host only)."""

    device = "cpu"

    def __init__(self, value: Any) -> None:
        self._array = np.asarray(value)

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "NumpyTensor":
        return cls(np.array(array, copy=True))

    def to_numpy(self) -> np.ndarray:
        return self._array.copy()

    def to(self, device: Any) -> "NumpyTensor":
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    def copy_(self, array: np.ndarray) -> "NumpyTensor":
        self._array[...] = array
        return self

    def __getitem__(self, key: Any) -> Any:
        return self._array[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._array[key] = value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._array if dtype is None else self._array.astype(dtype)

    def __repr__(self) -> str:
        return f"NumpyTensor(shape={self.shape}, dtype={self._array.dtype})"
