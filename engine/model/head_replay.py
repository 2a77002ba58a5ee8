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
the same GEMM — and searches them (one more head multiplication: the request's machine then waits
for twice as many hand-backs in a row before it lets the runner defer again). The first time it is
used, the recomputed logits are compared with the forward's own, bit for bit: a model whose logits
are more than its head's output (Gemma's final soft-capping, a scale) or a GEMM that does not
repeat itself fails the comparison, and from then on nothing is deferred.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import torch
import torch.nn.modules.module as module_hooks

from engine.model.backend import DeferredArgmax

__all__ = ["HeadReplay"]

log = logging.getLogger("raylens.backend")


class HeadReplay:
    """Keeps the input the model's output head got in the forward now running (a pre-hook on
    the head, which keeps only what the thread that armed it runs: a caller's own reference
    forward on another thread is not mistaken for the engine's)."""

    def __init__(self, model: Any) -> None:
        self._head = model.get_output_embeddings()
        self._input: torch.Tensor | None = None
        self._thread: int | None = None  # the thread whose forward's head input is kept
        self.exact: bool | None = None  # the recomputed logits equal the forward's (None: not compared yet)
        self._hook = self._head.register_forward_pre_hook(self._keep) if self._head is not None else None

    def _keep(self, module: Any, args: tuple[Any, ...]) -> None:
        if threading.get_ident() == self._thread:
            self._input = args[0] if args else None

    def arm(self) -> None:
        """This thread's next forward begins: its head's input is kept."""
        self._input, self._thread = None, threading.get_ident()

    def disarm(self) -> None:
        """The forward is over: nothing is kept past it (a scored prompt's head input is the size
        of its whole hidden state)."""
        self._input = self._thread = None

    def deferred(self, logits: torch.Tensor, rows: frozenset[int]) -> DeferredArgmax | None:
        """What finds ``rows``' argmax of ``logits (B, V)`` (the forward just made, untouched yet)
        later, or None when it cannot be recomputed exactly (those rows are then searched now)."""
        head_input = self._input
        if head_input is None or self.exact is False or not isinstance(head_input, torch.Tensor) \
                or not self._head_alone():
            return None
        recompute = functools.partial(_recompute, self._head, head_input)
        if self.exact is None:
            self.exact = _same(recompute(), logits)
            if not self.exact:
                log.info("this model's logits are not its output head's, recomputed: every greedy row with a "
                         "mod is searched before its mod runs")
                return None
        return DeferredArgmax(rows, recompute)

    def _head_alone(self) -> bool:
        """No hook but this one on the head, nor any global module hook: nothing (a tap writing
        ``unembed.hook_in`` or ``hook_out``) changed what the head got or gave in this forward
        in a way a recomputation would miss."""
        head = self._head
        return (len(head._forward_pre_hooks) == 1 and not head._forward_hooks
                and not module_hooks._global_forward_hooks and not module_hooks._global_forward_pre_hooks)

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
