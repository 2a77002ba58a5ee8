"""Recompute an eager forward's logits after the fact, from the input its output head was given.

A request whose one mod reads its row of the step's logits is lent that row in place on a CPU (no
copy: :meth:`~engine.model.tensor.HostLogits.share`). Its greedy draw must ignore what the mod
wrote there unless the mod hands the row back, so the runner finds the row's argmax before any mod
runs — one pass over the vocabulary a row, about 7 µs at 49,152 ids. A logits mod hands its row
back every step (edit and return), and then that argmax is never read: its draw is the argmax of
what it handed back, found in the check before the draw. So once a row's mod has handed it back,
the runner may leave its argmax unfound (:attr:`~engine.model.backend.ForwardRow.defer_argmax`)
and keep the head's input instead (a ``(B, 1, d)`` tensor, no copy). Should the mod not hand the
row back after all, :class:`~engine.model.backend.DeferredArgmax` recomputes the batch's logits
from it — the same head on the same input, under the same inference mode, on the same thread, so
the same GEMM — and searches them. The first time it is used, the recomputed logits are compared
with the forward's own, bit for bit: a model whose logits are more than its head's output (Gemma's
final soft-capping, a scale) or a GEMM that does not repeat itself fails the comparison, and from
then on nothing is deferred.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from engine.model.backend import DeferredArgmax

__all__ = ["HeadReplay"]

log = logging.getLogger("raylens.backend")


class HeadReplay:
    """Keeps the input the model's output head got in the newest forward (a pre-hook on it)."""

    def __init__(self, model: Any) -> None:
        self._head = model.get_output_embeddings()
        self._input: torch.Tensor | None = None
        self.exact: bool | None = None  # the recomputed logits equal the forward's (None: not compared yet)
        self._hook = self._head.register_forward_pre_hook(self._keep) if self._head is not None else None

    def _keep(self, module: Any, args: tuple[Any, ...]) -> None:
        self._input = args[0] if args else None

    def start(self) -> None:
        """A forward begins: what the last one's head got is no longer this one's."""
        self._input = None

    def deferred(self, logits: torch.Tensor, rows: frozenset[int]) -> DeferredArgmax | None:
        """What finds ``rows``' argmax of ``logits (B, V)`` (the forward just made, untouched yet)
        later, or None when it cannot be recomputed exactly (those rows are then searched now)."""
        head_input = self._input
        if head_input is None or self.exact is False or not isinstance(head_input, torch.Tensor):
            return None
        recompute = functools.partial(_recompute, self._head, head_input)
        if self.exact is None:
            self.exact = _same(recompute(), logits)
            if not self.exact:
                log.info("this model's logits are not its output head's, recomputed: every greedy row with a "
                         "mod is searched before its mod runs")
                return None
        return DeferredArgmax(rows, recompute)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _recompute(head: Any, head_input: torch.Tensor) -> torch.Tensor:
    """``(B, V)`` float32: the head's output for each row's last position, as the forward's."""
    with torch.inference_mode():
        return head(head_input)[:, -1].float()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
