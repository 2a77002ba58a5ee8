"""The tensor surface mods program against (legacy name ``max.driver.Tensor``).

The engine puts its own class (``engine.model.tensor.TensorShim``, over torch) into
``ForwardPass.logits`` and binds it as ``max.driver.Tensor``. This numpy-backed class is the
stand-in when no engine is around: scripted-model tests and tools that only read mods.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["TensorLike", "NumpyTensor", "MaskedLogits"]


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


class MaskedLogits:
    """A logits tensor with some ids set to ``value``, said rather than done: ``base`` (the event's
    own logits) and which ids change — every id outside ``allowed`` when it is given, and every id
    in ``disallowed``. The SDK's strategies (SelfPrompt), ``mods.features`` and banning mods return
    it inside ``AdjustedLogits``; the engine applies it where its logits are (on the GPU, with no
    copy to the host), and anyone who reads it (``to_numpy()``) gets exactly what a numpy edit of
    ``base.to_numpy()`` gives. Ids outside ``[0, V)`` are ignored."""

    def __init__(self, base: Any, *, allowed: Any = None, disallowed: Any = None, value: float = -1e9) -> None:
        self.base = base
        vocab = int(tuple(base.shape)[-1])
        self.allowed = None if allowed is None else _in_range(allowed, vocab)
        self.disallowed = _in_range(disallowed if disallowed is not None else (), vocab)
        self.value = float(value)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def device(self) -> Any:
        return getattr(self.base, "device", None)

    def to(self, device: Any) -> "MaskedLogits":
        return self

    def mask(self) -> np.ndarray:
        """``(V,)`` bool: True where the id is set to :attr:`value`."""
        vocab = self.shape[-1]
        if self.allowed is not None:
            out: np.ndarray = np.ones(vocab, dtype=bool)
            out[self.allowed] = False
        else:
            out = np.zeros(vocab, dtype=bool)
        out[self.disallowed] = True
        return out

    def to_numpy(self) -> np.ndarray:
        work = np.array(self.base.to_numpy(), dtype=np.float32, copy=True)
        work[..., self.mask()] = self.value
        return work

    def numpy(self) -> np.ndarray:
        return self.to_numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.to_numpy()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        kept = "all" if self.allowed is None else len(self.allowed)
        return f"MaskedLogits(shape={self.shape}, allowed={kept}, disallowed={len(self.disallowed)}, value={self.value})"


def _in_range(ids: Any, vocab: int) -> np.ndarray:
    array = getattr(ids, "array", None)  # an IdSet carries its ids as an array already
    array = array if isinstance(array, np.ndarray) else np.fromiter((int(i) for i in ids), dtype=np.int64)
    return array[(array >= 0) & (array < vocab)]
