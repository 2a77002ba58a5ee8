"""oneDNN-prepacked weights for a CPU model's linear layers (``backend.weight_prepack``).

On a CPU torch runs ``nn.Linear`` through MKL's ``sgemm``, which re-reads the weight in its plain
``(out, in)`` layout on every call. oneDNN can reorder a weight once into the blocked layout its
GEMM kernels stream best and then multiply against that copy: the same arithmetic (a float32
accumulation of the same products; results differ from MKL's only by the order of additions,
~1e-7 relative), but on this project's 2-core AVX-512 CPU the embedded model's linear layers run
~1.9x faster for 8 and 32 rows (measured per layer shape, one thread:
the estimate of a decode step's GEMMs is 47 → 27 ms at 8 rows, 106 → 71 ms at 32; a whole decode
step of 8 requests run from the step loop's thread, two threads, 109 → 77 ms). The gain depends
on the processor: on a later host of the same 2-core VM, MKL's GEMMs ran as fast as the packed
ones (the embedded model at 32 requests, a whole run, within a few per cent either way). A lone
row (one request decoding) keeps MKL's GEMM, which measured faster there from the step loop's
thread; MKL may thread it differently from one process to the next, so its rounding (up to ~1e-3
in the logits) is not reproducible across processes.
This is what vLLM's CPU backend does with its prepacked GEMMs, taken from torch itself
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``); inductor's own weight
prepacking (``freezing``) packs float32 weights for MKL instead, which measured no faster here.

How: each ``nn.Linear`` of the model keeps its parameters (references, hooks, ``state_dict`` and
tied weights are untouched) and gets an instance ``forward`` that multiplies against the packed
copy. The copy costs the linear weights' size once more in memory. Where autograd is recording
(a caller that wants gradients) the plain ``F.linear`` runs instead: the packed op has no
backward. Modules of another type (GPT-2's ``Conv1D``) are left as they are.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

__all__ = ["prepack_linears", "PackedLinearForward", "prepack_supported"]

log = logging.getLogger("raylens.prepack")

_DTYPES = (torch.float32, torch.bfloat16)


def prepack_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when oneDNN prepacking can serve a model on ``device`` in ``dtype``, else why not."""
    if device.type != "cpu":
        return f"weights are prepacked for CPU GEMMs only (the model is on {device.type})"
    if dtype not in _DTYPES:
        return f"oneDNN prepacking takes float32 or bfloat16 weights, got {str(dtype).removeprefix('torch.')}"
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return "this torch build has no oneDNN (torch.backends.mkldnn is unavailable)"
    return None


class PackedLinearForward:
    """``x (..., in) → (..., out)``: one linear layer against its oneDNN-packed weight."""

    __slots__ = ("linear", "packed", "bias", "dtype", "op", "eager")

    def __init__(self, linear: torch.nn.Linear, batch_hint: int) -> None:
        self.linear, self.op = linear, _packed_linear_op()  # resolved here: a compiled step never traces the lookup
        # an eager forward calls oneDNN's op itself, through its C++ entry point: the custom op's
        # dispatch through Python costs 4-12 us a call, and even OpOverload's own __call__ adds a
        # Python frame (a 32-request decode step of the embedded model makes 211 calls)
        self.eager = torch.ops.mkldnn._linear_pointwise.default._op
        self.dtype = linear.weight.dtype
        with torch.no_grad():
            # the hint picks the blocked layout; any row count runs against it (measured: within noise)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
            self.bias = linear.bias.detach() if linear.bias is not None else None  # read once, at load

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        if torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad):
            return torch.nn.functional.linear(x, linear.weight, linear.bias)  # autograd needs the plain op
        if x.numel() == x.shape[-1]:
            # one row (a lone request's decode step): called from the step loop's thread, oneDNN's
            # packed GEMM measured slower than MKL's (64 vs 61 ms a step; faster only from the main
            # thread); from two rows on it was faster on the host it was built on, and on a later
            # host 15 % faster at 8 rows and within a few per cent of MKL's at 32 and 64
            return torch.nn.functional.linear(x, linear.weight, linear.bias)
        if x.dtype != self.dtype:  # the plain op's error, not oneDNN's
            raise RuntimeError(f"expected input dtype {self.dtype}, got {x.dtype}")
        if not torch.compiler.is_compiling():
            return self.eager(x, self.packed, self.bias, "none", [], "")  # (..., out): the op folds the leading dims
        out = self.op(x.reshape(-1, x.shape[-1]), self.packed, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])


@functools.lru_cache(maxsize=None)
def _packed_linear_op() -> Any:
    """``raylens::packed_linear(x (rows, in), packed, bias) → (rows, out)``: oneDNN's op behind a
    custom op, so that a compiled decode step (``graph_decode: compile``) calls it as it is —
    inductor lowers ``mkldnn._linear_pointwise`` only for weights it froze itself."""

    @torch.library.custom_op("raylens::packed_linear", mutates_args=())
    def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @packed_linear.register_fake
    def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((x.shape[0], packed.shape[0]))

    return packed_linear


def prepack_linears(model: Any, *, batch_hint: int) -> int:
    """Give every ``nn.Linear`` of ``model`` a forward over a oneDNN-packed copy of its weight;
    returns how many were packed (0 when :func:`prepack_supported` says no)."""
    parameter = next(model.parameters())
    reason = prepack_supported(parameter.device, parameter.dtype)
    if reason is not None:
        log.info("weights not prepacked: %s", reason)
        return 0
    packed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and not isinstance(module.__dict__.get("forward"), PackedLinearForward):
            module.forward = PackedLinearForward(module, max(1, batch_hint))
            packed += 1
    return packed
