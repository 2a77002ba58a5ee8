"""One taps table per loaded model: where a forward pass exposes each named internal.

Names are the TransformerLens vocabulary of :mod:`engine.model.hook_names` (with llama.cpp's name
for each tensor in its :class:`~engine.model.hook_names.HookSpec`). :func:`taps_of` builds the
table once, when the backend loads the model, from the model's family entry
(:mod:`engine.model.families`: Llama, Mistral, Qwen2/3, Gemma 2/3, GPT-2, GPT-NeoX) through
:mod:`engine.model.tap_points`, and records, for every name the family computes, the
:class:`Read` points it needs: a module, before (``pre``) or after (``post``) it runs, and which
argument or output holds the tensor. Every consumer of internals that needs module hooks goes
through the table — named capture, embeddings, SAE-training collection and steering (a *write*
tap) — so a name is parsed once into a :class:`HookName` and mapped to a module once, at load
time; nothing matches on name strings while a forward runs.

Step capture (a generation step's ``hook_resid_post`` and ``attn.hook_pattern``) registers no
module hook: it rides on transformers' ``output_hidden_states`` and on the attention function
(:mod:`engine.model.capture`), which stay valid inside a captured CUDA graph or a compiled decode
step and cannot see a concurrent forward. A step's names are parsed once too, into the
:class:`~engine.model.capture.CapturePlan` a request carries.

Hooks are global state on a shared model (TransformerLens' ``HookedRootModule`` warns the same),
so every use is scoped: :meth:`Taps.record` and :meth:`Taps.write` register their hooks in a
context manager and remove every handle in ``finally``, a forward that raises included. While they
are registered another thread may run a forward on the same model (the engine serves concurrent
requests); a hook acts only in the thread that opened it, so other forwards pass straight through.

Some names are derived from several reads: ``attn.hook_q/k/v/z`` reshape a projection's flat
output (or its slice of a fused one) into heads; ``attn.hook_rot_q/rot_k`` apply the model's own
``apply_rotary_pos_emb`` (partial rotary included) to the projections, after the q/k norms where
the family has them, with the ``position_embeddings`` the attention module was handed;
``attn.hook_pattern`` is the softmax of those (soft-capped where the module soft-caps) with the
module's own mask (sliding windows included; the model keeps its fast kernel, never eager); and
``attn.cache_k/cache_v`` are read from the forward's ``DynamicCache`` afterwards. A norm's
``hook_scale`` and ``hook_normalized`` (before its weight, TransformerLens' meaning) are computed
from the norm's input with its own epsilon — RMSNorm: ``x / sqrt(mean(x²) + eps)``; LayerNorm:
the input centred first — because transformers' norms apply their weight in the same expression.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from engine.errors import InvalidRequestError
from engine.model.capture import attention_pattern
from engine.model.families import Family, family_of, get_path
from engine.model.hook_names import HookName, HookSet, parse_hook_name
from engine.model.tap_points import Derive, Read, ReadKey, Tap, build_reads, build_taps, head_dim

__all__ = ["Read", "ReadKey", "Tap", "Taps", "Recording", "taps_of"]


class _StopForward(Exception):
    """Raised by :meth:`Taps.collect`'s stop hook once the last layer it needs has run."""


@dataclass
class Recording:
    """What the forwards inside one :meth:`Taps.record` block left in its hooks.

    ``raw[ReadKey]``: module inputs/outputs with their batch dimension, e.g. ``(B, T, d)``; only
    the opening thread's forwards are recorded. :meth:`tensors` turns them into named tensors.
    """

    taps: "Taps"
    names: tuple[HookName, ...]
    owner: int = field(default_factory=threading.get_ident)
    raw: dict[ReadKey, Any] = field(default_factory=dict)

    def keep(self, key: ReadKey, value: Any) -> None:
        if threading.get_ident() == self.owner:
            self.raw[key] = value

    def tensors(self, cache: Any = None) -> dict[HookName, torch.Tensor]:
        """Every requested name → its tensor, batch dimension kept (``(B, …)``). ``cache``: the
        forward's ``DynamicCache``, needed by ``attn.cache_k/cache_v`` only."""
        rotated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        return {name: self._tensor(self.taps.tap(name), cache, rotated) for name in self.names}

    def _tensor(self, tap: Tap, cache: Any, rotated: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        name, derive = tap.name, tap.derive
        if derive == "raw":
            return self.raw[tap.reads[0]]
        if derive in ("rms_scale", "rms_normalized", "layer_scale", "layer_normalized"):
            return self._norm(tap, derive)
        layer: int = name.layer  # type: ignore[assignment]  # every derived tap is per block
        attn = self.taps.attention(layer)
        if derive == "heads":
            flat = self.raw[tap.reads[0]]  # (B, T, heads * hd)
            return flat.view(*flat.shape[:-1], -1, self.taps.head_dim)  # (B, T, heads, hd)
        if derive in ("cache_k", "cache_v"):
            if cache is None:
                raise InvalidRequestError(f"`{name}` needs the forward's KV cache; run it with a DynamicCache",
                                          parameter="names", value=str(name))
            stored = cache.layers[layer].keys if derive == "cache_k" else cache.layers[layer].values
            return stored.transpose(1, 2)  # (B, g, T, hd) -> (B, T, g, hd): positions first, like hook_k
        if layer not in rotated:
            rotated[layer] = self._rotate(attn, tap)
        rot_q, rot_k = rotated[layer]  # (B, h, T, hd), (B, g, T, hd)
        if derive == "rot_q":
            return rot_q.transpose(1, 2)
        if derive == "rot_k":
            return rot_k.transpose(1, 2)
        mask = self.raw[ReadKey(layer, "attn_in")][1]
        heads, q_len, kv_len = rot_q.shape[1], rot_q.shape[2], rot_k.shape[2]
        groups, softcap = getattr(attn, "num_key_value_groups", 1), getattr(attn, "attn_logit_softcapping", None)
        patterns = [attention_pattern(rot_q[b:b + 1], rot_k[b:b + 1], None if mask is None else mask[b:b + 1],
                                      attn.scaling, groups, newest_row_only=False, softcap=softcap)
                    .reshape(heads, q_len, kv_len) for b in range(rot_q.shape[0])]
        return torch.stack(patterns)  # (B, h, T, T) float32

    def _norm(self, tap: Tap, derive: Derive) -> torch.Tensor:
        """A norm's divisor ``(…, 1)`` or its output before the weight ``(…, d)``, from the norm's
        input with the norm's own epsilon in float32 (transformers' norms have no point between
        the division and the weight to hook). A LayerNorm centres its input first."""
        key = tap.reads[0]
        norm = self.taps.reads[key].module  # the read is the norm's own input
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        x = self.raw[key]
        centred = x.float()
        if derive.startswith("layer"):
            centred = centred - centred.mean(-1, keepdim=True)
        variance = centred.pow(2).mean(-1, keepdim=True) + eps
        if derive.endswith("scale"):
            return variance.sqrt().to(x.dtype)
        return (centred * torch.rsqrt(variance)).to(x.dtype)

    def _rotate(self, attn: Any, tap: Tap) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k as the attention scores use them: ``(B, heads, T, hd)``, after the model's own RoPE
        (and the q/k norms, where the family has them) exactly as the attention module computes
        them; as projected for a model without RoPE (GPT-2)."""
        q_key, k_key, inputs = tap.reads
        q, k = self.raw[q_key], self.raw[k_key]  # flat (B, T, heads * hd), or normed (B, T, heads, hd)
        hd = self.taps.head_dim
        q = (q.view(*q.shape[:-1], -1, hd) if q.dim() == 3 else q).transpose(1, 2)
        k = (k.view(*k.shape[:-1], -1, hd) if k.dim() == 3 else k).transpose(1, 2)
        if not self.taps.family.rotary:
            return q, k
        cos, sin = self.raw[inputs][0]
        apply_rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if apply_rope is None:
            raise InvalidRequestError(f"post-RoPE q/k and attention patterns need the model module's "
                                      f"apply_rotary_pos_emb, which {type(attn).__module__} lacks",
                                      parameter="names")
        return apply_rope(q, k, cos, sin)


class Taps:
    """The taps table of one loaded model; build it with :func:`taps_of` (once per model)."""

    def __init__(self, model: Any) -> None:
        family = family_of(model)
        base = getattr(model, "base_model", model)
        self._model = weakref.ref(model)  # the model keeps its table (taps_of): no reference cycle back
        self.family: Family = family
        self.base = base
        self.blocks = get_path(base, family.layers)
        self.num_layers = len(self.blocks)
        self.head_dim = head_dim(base.config)
        self.reads: dict[ReadKey, Read] = {read.key: read for read in build_reads(family, base, self.blocks)}
        hooks, taps = build_taps(family, base.config, self.num_layers)
        self.hooks: HookSet = hooks  # the names this model computes
        self.taps: dict[HookName, Tap] = {tap.name: tap for tap in taps}  # forward order
        missing = {key for tap in taps for key in tap.reads} - set(self.reads)
        assert not missing, f"taps of {family.name} need reads the family entry lacks: {sorted(map(str, missing))}"

    def attention(self, layer: int) -> Any:
        """Block ``layer``'s attention module (its scaling, soft-cap and RoPE come from there)."""
        return get_path(self.blocks[layer], self.family.attention)

    @property
    def model(self) -> Any:
        """The model this table was built from (its config, parameters and LM head)."""
        model = self._model()
        if model is None:
            raise InvalidRequestError("the taps table's model was unloaded; use the table of the model now loaded",
                                      parameter="model")
        return model

    def tap(self, name: HookName | str) -> Tap:
        """The entry of ``name`` (a string is parsed here, once); unknown or out-of-range names are refused."""
        key = parse_hook_name(name) if isinstance(name, str) else name
        try:
            return self.taps[key]
        except KeyError:
            raise InvalidRequestError(f"`{key}` must name an internal of this {self.num_layers}-layer "
                                      f"{self.family.label} model", parameter="names", value=str(key)) from None

    def module(self, name: HookName | str) -> Any:
        """The module whose hook reads ``name`` when it needs exactly one read (None otherwise)."""
        reads = self.tap(name).reads
        return self.reads[reads[0]].module if len(reads) == 1 else None

    # --------------------------------------------------------------------------------- reading

    @contextlib.contextmanager
    def record(self, names: Sequence[HookName | str]) -> Iterator[Recording]:
        """Hooks that record ``names`` during this thread's forwards inside the block, removed on
        exit even when a forward raises. Read the tensors with ``recording.tensors(cache)``."""
        rec = Recording(self, tuple(self.tap(n).name for n in names))
        needed = list(dict.fromkeys(key for name in rec.names for key in self.taps[name].reads))
        handles: list[Any] = []
        try:
            for key in needed:
                handles.append(self._register_read(self.reads[key], rec))
            yield rec
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def _register_read(read: Read, rec: Recording) -> Any:
        key, extract = read.key, read.extract
        if read.when == "post":
            return read.module.register_forward_hook(lambda _m, _a, output: rec.keep(key, extract(output)))
        return read.module.register_forward_pre_hook(lambda _m, args, kwargs: rec.keep(key, extract(args, kwargs)),
                                                     with_kwargs=True)

    def collect(self, input_ids: torch.Tensor, names: Sequence[HookName | str],
                attention_mask: torch.Tensor | None = None) -> dict[HookName, torch.Tensor]:
        """``names`` for ``input_ids (B, T)`` from one cache-free forward of the decoder stack that
        stops once the highest block any name needs has run (SAE-training collection: the layers
        above are never computed); model-wide names run the whole stack. Values equal a full
        forward's: the blocks that run see the same inputs. Batch dimension kept."""
        taps = [self.tap(n) for n in names]
        if any(t.derive in ("cache_k", "cache_v") for t in taps):
            raise InvalidRequestError("`names` for collect must not need the KV cache (attn.cache_k/cache_v); "
                                      "use named capture", parameter="names")
        layers = [t.name.layer for t in taps]
        stop = None if any(layer is None for layer in layers) else max(layers)  # type: ignore[type-var]
        with self.record([t.name for t in taps]) as rec, torch.inference_mode():
            handle = None
            if stop is not None:
                owner = rec.owner

                def halt(_m: Any, _a: Any, _o: Any) -> None:
                    if threading.get_ident() == owner:
                        raise _StopForward

                handle = self.blocks[stop].register_forward_hook(halt)  # after the recording hooks
            try:
                self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
            finally:
                if handle is not None:
                    handle.remove()
        return rec.tensors()

    # --------------------------------------------------------------------------------- writing

    @contextlib.contextmanager
    def write(self, name: HookName | str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        """While the block runs, this thread's forwards see ``edit(tensor)`` in place of ``name``
        (e.g. steering: ``lambda resid: resid + delta`` on ``blocks.L.hook_resid_post``); the hook
        is removed on exit even when a forward raises. Only names read whole from one module's
        output can be written."""
        tap = self.tap(name)
        read = self.reads[tap.reads[0]] if len(tap.reads) == 1 and tap.derive == "raw" else None
        if read is None or not read.writable:
            writable = [str(t.name) for t in self.taps.values() if t.derive == "raw" and t.name.layer in (None, 0)
                        and self.reads[t.reads[0]].writable]
            raise InvalidRequestError(f"`{tap.name}` must be a writable tap (one module's output), e.g. "
                                      f"{', '.join(writable)}", parameter="name", value=str(tap.name))
        owner = threading.get_ident()

        def replace(_m: Any, _a: Any, output: Any) -> Any:
            if threading.get_ident() != owner:
                return None
            if isinstance(output, tuple):
                return (edit(output[0]),) + tuple(output[1:])
            return edit(output)

        handle = read.module.register_forward_hook(replace)
        try:
            yield
        finally:
            handle.remove()


_TABLE_ATTRIBUTE = "_raylens_taps"  # on the model itself: the table lives and dies with it
_tables_lock = threading.Lock()


def taps_of(model: Any) -> Taps:
    """The taps table of ``model``, built on first use and kept on the model for as long as it
    lives (the backend builds it at load time); a :class:`Taps` is returned as is."""
    if isinstance(model, Taps):
        return model
    with _tables_lock:
        table = model.__dict__.get(_TABLE_ATTRIBUTE)
        if table is None:
            table = Taps(model)
            object.__setattr__(model, _TABLE_ATTRIBUTE, table)  # a plain attribute, not a submodule
        return table
