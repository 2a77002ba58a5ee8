"""Attention that reads the paged KV pool in place (``backend.paged_attention``): a varlen,
block-table kernel called from inside transformers' attention interface.

The default forward (:class:`~engine.model.kv_cache.BatchCacheView`) gathers every layer's keys
and values of every row into a contiguous ``(B, kv_heads, kv_len, hd)`` tensor each step and
hands SDPA a boolean mask, so SDPA cannot use its flash kernel and every step copies the whole
context once per layer. A paged kernel instead takes the pool itself, ``(num_blocks, block_size,
kv_heads, hd)``, each row's block table and context length, and the rows' real queries packed
``(total_q, heads, hd)`` with their cumulative lengths: decode steps and prefill chunks (a prompt
after a prefix hit included) are one varlen call per layer, causal aligned to each row's end.
The new tokens' keys/values are written into their slots first, as before; the kernel never
sees the stale entries past a row's end (after a Backtrack) because it reads only
``seqused_k[b]`` positions.

Kernels, best first (``auto`` takes the first that serves the model; a kernel that cannot logs
why and the gather stays):

* ``torch`` — ``torch.nn.attention.varlen.varlen_attn`` with ``block_table``/``seqused_k``: the
  FlashAttention-2 kernels torch's own CUDA build carries, nothing to install;
* ``flash_attn`` — the flash-attn package's ``flash_attn_varlen_func`` with ``block_table``;
* ``reference`` — the same call computed with plain torch ops, row by row: slow, for checking the
  plumbing on any device (the CPU tests run it).

FlashAttention-2's paged read needs CUDA, float16/bfloat16, ``kv_block_size`` a multiple of 256 and
no logit soft-capping (Gemma 2); :func:`select_kernel` says which condition failed.

Attention-pattern capture keeps its meaning: a captured layer's pattern is still the post-softmax
of the post-RoPE queries against the row's cached keys (:func:`engine.model.capture.attention_pattern`),
computed from those rows' keys gathered for that layer only.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from engine.model.kv_cache import PagedKVCache, read_slots

__all__ = ["PAGED_KWARG", "PagedKernel", "PagedBatch", "PagedCacheView", "select_kernel", "KERNELS",
           "FLASH_PAGE_MULTIPLE"]

log = logging.getLogger("raylens.paged_attention")

PAGED_KWARG = "raylens_paged"  # the forward kwarg transformers carries down to our attention function
FLASH_PAGE_MULTIPLE = 256  # FlashAttention-2 refuses a paged pool whose blocks are not a multiple of this
KERNELS = ("torch", "flash_attn", "reference")


@dataclass(frozen=True)
class PagedKernel:
    """``fn(q (T, h, hd), k_pool, v_pool (N, bs, g, hd), cu_seq_q (B+1,) int32, cu_seq_k (B+1,)
    int32, seqused_k (B,) int32, block_table (B, nb) int32, max_q, max_k, scale, window_left)
    → (T, h, hd)``, causal aligned to each row's last key."""

    name: str
    fn: Callable[..., torch.Tensor]


def _torch_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "block_table" not in inspect.signature(varlen_attn).parameters:
        return None  # torch before the paged varlen API

    def call(q, k, v, cu_q, cu_k, used_k, table, max_q, max_k, scale, left):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, 0),
                           enable_gqa=q.shape[1] != k.shape[2], seqused_k=used_k, block_table=table)
    return call


def _flash_attn_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        return None  # flash-attn before paged varlen (2.5)

    def call(q, k, v, cu_q, cu_k, used_k, table, max_q, max_k, scale, left):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True,
                                      window_size=(left, 0), block_table=table)
    return call


def reference_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_q: torch.Tensor,
                              cu_k: torch.Tensor, used_k: torch.Tensor, table: torch.Tensor, max_q: int,
                              max_k: int, scale: float, left: int) -> torch.Tensor:
    """The paged varlen call in plain torch ops, row by row (shapes in :class:`PagedKernel`):
    row ``b``'s ``n`` queries sit at its last ``n`` positions of ``used_k[b]``; a query at position
    ``p`` sees keys ``p - left … p`` (``left < 0``: all of them). Softmax in float32."""
    _, block_size, groups, head_dim = k_pool.shape
    heads = q.shape[1]
    flat_k, flat_v = k_pool.reshape(-1, groups, head_dim), v_pool.reshape(-1, groups, head_dim)
    out = torch.empty_like(q)
    starts, ends, lengths = cu_q[:-1].tolist(), cu_q[1:].tolist(), used_k.tolist()
    for b, (first, last, length) in enumerate(zip(starts, ends, lengths)):
        if last == first:
            continue
        slots = read_slots(table[b:b + 1].long(), length, block_size)[0]  # (L,)
        keys = flat_k.index_select(0, slots).transpose(0, 1)  # (g, L, hd)
        values = flat_v.index_select(0, slots).transpose(0, 1)
        if groups != heads:
            keys, values = (t.repeat_interleave(heads // groups, dim=0) for t in (keys, values))
        query = q[first:last].transpose(0, 1).float()  # (h, n, hd)
        scores = torch.matmul(query, keys.float().transpose(1, 2)) * scale  # (h, n, L)
        query_pos = torch.arange(length - (last - first), length, device=q.device)[:, None]
        key_pos = torch.arange(length, device=q.device)[None, :]
        allowed = key_pos <= query_pos
        if left >= 0:
            allowed = allowed & (key_pos >= query_pos - left)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[first:last] = torch.matmul(weights, values.float()).transpose(0, 1).to(q.dtype)  # (n, h, hd)
    return out


def _resolve(name: str) -> Callable[..., torch.Tensor] | None:
    if name == "torch":
        return _torch_varlen()
    if name == "flash_attn":
        return _flash_attn_varlen()
    return reference_paged_attention


def select_kernel(choice: str, *, device: torch.device, dtype: torch.dtype, block_size: int,
                  softcapped: bool) -> tuple[PagedKernel | None, str]:
    """The kernel ``backend.paged_attention`` asks for, or None and why not. ``auto``: the first
    of ``torch``, ``flash_attn`` that serves this model here (CUDA only); ``off``: none."""
    if choice == "off":
        return None, "paged_attention is off"
    if softcapped:
        return None, "this model soft-caps attention logits, which no paged kernel here does"
    if choice == "reference":
        return PagedKernel("reference", reference_paged_attention), "reference kernel (plain torch ops)"
    if device.type != "cuda":
        return None, f"the paged FlashAttention kernels run on CUDA only (the model is on {device.type})"
    if dtype not in (torch.float16, torch.bfloat16):
        return None, f"FlashAttention takes float16 or bfloat16, got {str(dtype).removeprefix('torch.')}"
    if block_size % FLASH_PAGE_MULTIPLE:
        return None, (f"FlashAttention-2 reads paged blocks of a multiple of {FLASH_PAGE_MULTIPLE} positions, got "
                      f"kv_block_size {block_size}; set backend.kv_block_size: {FLASH_PAGE_MULTIPLE}")
    reasons = []
    for name in (KERNELS[:2] if choice == "auto" else (choice,)):
        fn = _resolve(name)
        if fn is not None:
            return PagedKernel(name, fn), f"{name} paged varlen kernel"
        reasons.append(f"{name}: not installed or without block tables")
    return None, "; ".join(reasons)


@dataclass
class PagedBatch:
    """One forward's paged-kernel inputs, all on the pool's device: ``block_table (B, nb)`` int32,
    ``used_k (B,)`` int32 each row's context after this forward, ``cu_q``/``cu_k (B+1,)`` int32
    cumulative real query / context lengths, ``query_index (T,)`` the real queries' places in the
    left-padded ``(B*q)`` columns (None: every column is real, as in decode), ``max_q``/``max_k``
    bounds of those lengths, ``read_index (B, max_k)`` the slots a captured layer gathers."""

    kernel: PagedKernel
    block_table: torch.Tensor
    used_k: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    query_index: torch.Tensor | None
    max_q: int
    max_k: int
    read_index: torch.Tensor

    @classmethod
    def for_rows(cls, kernel: PagedKernel, tables: torch.Tensor, starts: Sequence[int], lengths: Sequence[int],
                 read_index: torch.Tensor) -> "PagedBatch":
        """Rows left-padded to ``q = max(lengths)``: row ``b`` feeds ``lengths[b]`` tokens from
        ``starts[b]``; ``tables (B, nb)`` long on the device."""
        device = tables.device
        q = max(lengths)
        used = [s + n for s, n in zip(starts, lengths)]
        cu_q, cu_k = [0], [0]
        for n, u in zip(lengths, used):
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + u)
        index = None
        if any(n != q for n in lengths):
            index = torch.tensor([b * q + c for b, n in enumerate(lengths) for c in range(q - n, q)], device=device)
        return cls(kernel, tables.to(torch.int32), torch.tensor(used, dtype=torch.int32, device=device),
                   torch.tensor(cu_q, dtype=torch.int32, device=device),
                   torch.tensor(cu_k, dtype=torch.int32, device=device), index, q, max(used), read_index)

    @classmethod
    def for_decode(cls, kernel: PagedKernel, tables: torch.Tensor, positions: torch.Tensor, cu_q: torch.Tensor,
                   max_k: int, read_index: torch.Tensor) -> "PagedBatch":
        """Static decode buffers (tensor ops only, so a CUDA graph recomputes it on replay):
        ``tables (B, nb)``, ``positions (B, 1)`` of the one token each row feeds, ``cu_q`` the
        static ``0 … B`` int32."""
        used = (positions[:, 0] + 1).to(torch.int32)
        cu_k = torch.cat([used.new_zeros(1), used.cumsum(0, dtype=torch.int32)])
        return cls(kernel, tables.to(torch.int32), used, cu_q, cu_k, None, 1, max_k, read_index)

    def gathered(self, pool: torch.Tensor) -> torch.Tensor:
        """``pool (N, bs, g, hd)`` → every row's positions ``0 … max_k-1`` ``(B, g, max_k, hd)``:
        the keys a captured layer's pattern is computed from (that layer only)."""
        _, _, g, hd = pool.shape
        b, length = self.read_index.shape
        return pool.view(-1, g, hd).index_select(0, self.read_index.reshape(-1)).view(b, length, g, hd) \
            .transpose(1, 2)

    def attend(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """``query (B, h, q, hd)`` against the pool → ``(B, q, h, hd)``, what transformers'
        attention interface returns (padding columns: zeros)."""
        b, heads, q, hd = query.shape
        flat = query.transpose(1, 2).reshape(b * q, heads, hd)
        packed = flat if self.query_index is None else flat.index_select(0, self.query_index)
        # transformers' sliding window: a query sees ``window`` positions, itself included
        left = sliding_window - 1 if sliding_window else -1
        out = self.kernel.fn(packed.contiguous(), k_pool, v_pool, self.cu_q, self.cu_k, self.used_k,
                             self.block_table, self.max_q, self.max_k, scale, left)
        if self.query_index is not None:
            out = flat.new_zeros(b * q, heads, hd).index_copy_(0, self.query_index, out)
        return out.view(b, q, heads, hd)


@dataclass
class PagedCacheView:
    """What a paged forward hands transformers as its KV cache: :meth:`update` writes the fed
    tokens' keys/values ``(B, g, q, hd)`` into their slots (``write_index (B*q,)``) and returns
    the layer's whole pool ``(N, bs, g, hd)``, which the attention function reads through
    ``paged`` (passed to the model as :data:`PAGED_KWARG`). Stands in for transformers' cache
    object: it answers what transformers asks of one."""

    cache: PagedKVCache
    write_index: torch.Tensor
    paged: PagedBatch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Any = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        b, g, q, hd = key_states.shape
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        for buf, new in ((keys, key_states), (values, value_states)):
            buf.view(-1, g, hd).index_copy_(0, self.write_index, new.transpose(1, 2).reshape(b * q, g, hd).to(buf.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.paged.max_k

    @property
    def is_compileable(self) -> bool:
        return False
