"""TensorShim: the ``max.driver.Tensor`` surface over a ``torch.Tensor``; the only torch↔numpy
bridge for mods.

Mods written for the original engine call ``logits.to_numpy()``, ``Tensor.from_numpy(arr)``,
``type(logits).from_numpy(...)``, ``.to(logits.device)``, ``.shape`` and indexing.
The engine binds this class as ``max.driver.Tensor`` so all of those round-trip.

``to_numpy()`` returns a float32 host *copy* (float16 logits would overflow the ``-1e9`` masks
mods write; a copy keeps a mod's in-place edits from leaking into the engine's tensors). On a
GPU the copy happens only when a mod asks for it.

A step's logits reach mods through :class:`HostLogits`: when the first mod of a step reads its
logits, the rows of every request with mods are copied to the host at once (one copy, not one per
request; or ahead, on a thread of its own while the step loop builds the step's events, when a mod
read its logits the step before: :meth:`HostLogits.copy_ahead`), and each row's first
``to_numpy()`` is a writable view of that copy — its own, as no other reader ever sees it (a
second read of the same row gets a fresh copy). ``from_numpy`` of such a view (the usual
edit-and-return of a logits mod) wraps it without copying again.

A row that nothing reads after its one mod but the draw (:meth:`HostLogits.share`: one mod, no
listener, logits not kept, a plain greedy draw) is not copied at all on a CPU: its first
``to_numpy()`` is the batch's own row. What its mod writes there, the engine never reads (the
step's greedy choice is the row's argmax, which the runner found with the forward, before any mod
ran: :attr:`~engine.model.backend.ForwardOutput.argmax` — or, for a row whose mod handed a row back
the step before, finds only if the mod does not hand this one back, in the batch's logits
recomputed as the forward made them: :mod:`engine.model.head_replay`), unless the mod hands the
row back as ``AdjustedLogits``; only the mod's own later reads of the row in that step see its
writes. At 64 concurrent requests that is 12 MB a step neither copied nor written.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from .vocab_search import array_row_max

__all__ = ["TensorShim", "HostLogits", "ReleasedLogits", "released", "as_torch", "logits_dims"]

# the host copies HostLogits lent out, by the copy's id: from_numpy wraps a view of one without a
# copy, and an AdjustedLogits made of one is checked with the step's other rows in one pass
_LENT: "weakref.WeakValueDictionary[int, HostLogits]" = weakref.WeakValueDictionary()

#: A copy made ahead smaller than this is made on the step loop's thread: the copier's wake-up
#: (0.1-0.25 ms on a 2-core VM) would cost more than the copy (8 rows × 49,152: ~0.1 ms).
AHEAD_MIN_BYTES = 2 << 20
#: The longest the step loop waits for the copier to take a copy (it may be finishing the last
#: step's, a few ms at most) before it gives up on that copier.
COPIER_START_S = 1.0


class HostLogits:
    """One step's logits ``(B, V)`` as the mods of the requests in ``rows`` read them: one float32
    host copy of those rows, made at the first read (or ahead, :meth:`copy_ahead`); each row's first
    :meth:`lend` is a ``(1, V)`` view of it, later ones None (the reader copies). A row given with
    :meth:`share` instead is lent in place: its first read is a view of the batch's own row.

    A lent view's *key* (what ``from_numpy`` records and :meth:`row_max` takes) is its slot in the
    copy, or ``-1 - row`` for a row lent in place."""

    def __init__(self, batch: torch.Tensor, rows: list[int] | None = None) -> None:
        self.batch = batch
        self.slot = {row: j for j, row in enumerate(rows or ())}
        self._host: np.ndarray | None = None
        self._lent: set[int] = set()
        self._views: dict[int, tuple[np.ndarray, int]] = {}  # id(view) -> (the view lent, its key)
        self._lock = threading.Lock()  # mods of different requests may run on different threads
        self._ahead: tuple[np.ndarray, Future[None]] | None = None  # a copy started by copy_ahead
        self._shared: set[int] = set()  # the rows lent in place
        self._rows: np.ndarray | None = None  # the batch itself, as numpy (rows lent in place are views of it)
        self._found: dict[int, tuple[float, int]] = {}  # a lent row's key -> (maximum, its first index)
        self._in_place: bool | None = None  # rows may be lent in place (a float32 batch on a CPU)

    def add(self, row: int) -> None:
        """Row ``row``'s mods may read it (before anything is lent)."""
        self.slot.setdefault(row, len(self.slot))

    def share(self, row: int) -> None:
        """Row ``row``'s mods may read it, and the caller vouches that nothing reads the row after
        them but the step's draw, whose argmax the runner found before any mod ran (one mod is all
        that reads it, no listener, a result that does not keep logits, a plain greedy draw): its
        first read is then a writable view of the batch's own row, no copy — what a mod writes
        there, nothing the engine samples or records ever reads. Only for a float32 batch on a
        CPU; any other row is :meth:`add` ed."""
        in_place = self._in_place
        if in_place is None:  # read once a step: a tensor's device and dtype cost microseconds each read
            batch = self.batch
            in_place = self._in_place = batch.device.type == "cpu" and batch.dtype == torch.float32
        if not in_place or row in self.slot:
            return self.add(row)
        self._shared.add(row)

    def was_lent(self, row: int) -> bool:
        """Whether row ``row`` was read (its first ``to_numpy()``)."""
        return row in self._lent

    def copy_ahead(self) -> None:
        """Start the host copy of a CPU float32 batch now, on a thread of its own, before any mod
        asks: called from the step loop's thread once every row is added, when a mod read its
        logits the step before. The copy (numpy's, which releases the GIL: 64 rows × 49,152 take
        about a millisecond) then runs while the step loop builds the step's events, instead of
        after them; the first :meth:`lend` waits for what is left of it (at 64 concurrent requests
        that wait went from 1.2-1.4 ms a step to ~0.03). A copy smaller than
        :data:`AHEAD_MIN_BYTES` is made at once instead, by torch on this thread (which owns the
        OpenMP workers); none is made when the copier cannot take it (the first read copies).
        Nothing is lent; the copy is the one :meth:`lend` would make. Another batch (a GPU's) is
        still copied at the first read."""
        if not self.slot or self._host is not None or self._ahead is not None:  # every request calls it; one copies
            return
        batch = self.batch
        if batch.device.type != "cpu" or batch.dtype != torch.float32:  # read at the first lend, as before
            return
        with self._lock:
            if self._host is None and self._ahead is None and self.slot:
                order = list(self.slot)
                if len(order) * batch.shape[1] * 4 < AHEAD_MIN_BYTES:  # done before the copier would wake
                    rows = batch.detach()  # this thread owns the OpenMP workers: torch's parallel copy
                    every = order == list(range(batch.shape[0]))
                    self._register((rows.clone() if every else rows.index_select(0, torch.tensor(order))).numpy())
                    return
                host = np.empty((len(order), batch.shape[1]), dtype=np.float32)
                copying = _copier().start(batch.detach().numpy(), order, host)
                if copying is None:  # the copier is gone or stuck: a new one next time, the first read copies
                    _copier.cache_clear()
                    return
                self._ahead = (host, copying)

    def lend(self, row: int) -> np.ndarray | None:
        j = self.slot.get(row)
        if j is None:
            return self._lend_in_place(row) if row in self._shared else None
        with self._lock:
            if row in self._lent:
                return None
            self._lent.add(row)
            host = self._host if self._host is not None else self._copy()
            view = host[j:j + 1]
            self._views[id(view)] = (view, j)
            return view

    def _lend_in_place(self, row: int) -> np.ndarray | None:
        with self._lock:
            if row in self._lent:
                return None
            self._lent.add(row)
            rows = self._rows
            if rows is None:
                rows = self._rows = self.batch.detach().numpy()  # the same memory: no copy
                _LENT[id(rows)] = self
            view = rows[row:row + 1]
            self._views[id(view)] = (view, -1 - row)
            return view

    def owns(self, base: Any) -> bool:
        """Whether ``base`` is an array this lent views of (the host copy, or the batch itself)."""
        return base is not None and (base is self._host or base is self._rows)

    def _copy(self) -> np.ndarray:
        """The step's one host copy ``(M, V)``: the one :meth:`copy_ahead` started (waited for),
        or one made now (the caller holds the lock); registered, so that ``from_numpy`` knows the
        views it lends."""
        if self._ahead is not None:
            host, copying = self._ahead
            copying.result()  # its error, if any, is the reader's
        else:
            host = _host_copy(self.batch, list(self.slot))
        return self._register(host)

    def _register(self, host: np.ndarray) -> np.ndarray:
        """``host`` is the step's copy; ``from_numpy`` knows the views of it."""
        self._host = host
        _LENT[id(host)] = self
        return host

    def slot_of(self, array: np.ndarray) -> int | None:
        """The key of the lent row whose whole row ``array`` is, else None. The view this lent is
        known at once (the usual edit-and-return); another view of a row is placed by its
        address."""
        lent = self._views.get(id(array))
        if lent is not None and lent[0] is array:
            return lent[1]
        base = array.base
        if base is None or not array.flags.c_contiguous:
            return None
        for whole, in_place in ((self._host, False), (self._rows, True)):
            if whole is None or base is not whole or array.size != whole.shape[1]:
                continue
            offset = array.ctypes.data - whole.ctypes.data
            index, rest = divmod(offset, whole.strides[0])
            if rest or not 0 <= index < whole.shape[0]:
                return None
            if not in_place:
                return index
            return -1 - index if index in self._shared and index in self._lent else None
        return None

    def row_max(self, key: int) -> tuple[float, int]:
        """``(maximum, its first index)`` of lent row ``key`` as its mod left it. Every lent row not
        yet searched is searched the first time one is asked, in one pass (numpy's ``argmax`` a
        row), read into Python numbers at once: a phase's actions are applied after all of its mod
        calls returned, so no row changes after that."""
        with self._lock:
            found = self._found.get(key)
            if found is None:
                rest = [k for k in self._lent_keys() if k not in self._found]
                self._found.update(self._maxima_of(rest))
                found = self._found.get(key)
                if found is None:  # not lent (a caller's mistake): its own search
                    found = self._found[key] = self._maxima_of([key])[key]
            return found

    def _lent_keys(self) -> list[int]:
        """The keys of every row lent so far."""
        slot = self.slot
        return [slot[row] if row in slot else -1 - row for row in self._lent]

    def _maxima_of(self, keys: list[int]) -> dict[int, tuple[float, int]]:
        """``{key: (maximum, its first index)}`` of the lent rows ``keys``."""
        return self._search(self._spans_of(keys))

    def _spans_of(self, keys: list[int]) -> list[_Span]:
        """What :meth:`_search` reads for the lent rows ``keys``: the rows copied for mods, and
        those lent in place (a float32 CPU batch, seen as numpy), each a float32 array."""
        spans = []
        copied = sorted(key for key in keys if key >= 0)
        if copied:
            spans.append(_Span.of(self._host, copied, copied))  # type: ignore[arg-type]
        in_place = sorted(-1 - key for key in keys if key < 0)
        if in_place:
            rows = self._rows if self._rows is not None else self.batch.detach().numpy()
            spans.append(_Span.of(rows, in_place, [-1 - row for row in in_place]))
        return spans

    def _search(self, spans: list[_Span]) -> dict[int, tuple[float, int]]:
        """``{key: (maximum, its first index)}`` of every row of ``spans``."""
        found: dict[int, tuple[float, int]] = {}
        for span in spans:
            found.update(span.maxima())
        return found


class _Span:
    """Rows of a float32 array to search for their maxima: the whole run of rows they lie in when
    they are most of it (a row or two more read is cheaper than a gather copying the rest first),
    else those rows, gathered by the search."""

    __slots__ = ("array", "keys", "picks", "rows")

    def __init__(self, array: np.ndarray, keys: list[int], picks: np.ndarray | None, rows: np.ndarray | None) -> None:
        self.array, self.keys, self.picks, self.rows = array, keys, picks, rows

    @classmethod
    def of(cls, whole: np.ndarray, which: list[int], keys: list[int]) -> "_Span":
        """The rows ``which`` (sorted) of ``whole``, each known by its key in ``keys``."""
        first, last = which[0], which[-1]
        if 2 * len(which) >= last + 1 - first:
            picks = None if len(which) == last + 1 - first else np.array([row - first for row in which])
            return cls(whole[first:last + 1], keys, picks, None)
        return cls(whole, keys, None, np.array(which))

    def maxima(self) -> list[tuple[int, tuple[float, int]]]:
        """``(key, (maximum, its first index))`` of each row (a NaN row's index is unspecified: its
        maximum is NaN, which every caller refuses)."""
        values, index = array_row_max(self.array if self.rows is None else self.array.take(self.rows, axis=0))
        if self.picks is not None:
            values, index = values[self.picks], index[self.picks]
        return list(zip(self.keys, zip(values.tolist(), index.tolist())))


def _host_copy(batch: torch.Tensor, order: list[int]) -> np.ndarray:
    """Rows ``order`` of ``batch`` as a float32 host copy. A float32 CPU batch is copied by numpy,
    never by a parallel torch op: this may run on the copier's thread, and a parallel op
    there would give that thread an OpenMP team of its own; with two teams on the machine's cores
    libgomp stops spinning between regions, so every parallel op of the step loop's forward pays a
    futex wake-up (measured: reading the logits cost a mod 19 % of the throughput at 64 concurrent
    requests, not the copy's 2 %)."""
    if batch.device.type == "cpu" and batch.dtype == torch.float32:
        host = np.empty((len(order), batch.shape[1]), dtype=np.float32)
        _copy_rows(batch.detach().numpy(), order, host)
        return host
    if order != list(range(batch.shape[0])):
        batch = batch.index_select(0, torch.tensor(order, device=batch.device))
    return batch.to(dtype=torch.float32, device="cpu", copy=True).numpy()


def _copy_rows(source: np.ndarray, order: list[int], host: np.ndarray) -> None:
    """``host[j] = source[order[j]]``, with numpy's copies (they release the GIL)."""
    if order == list(range(source.shape[0])):  # every row, in order: one plain copy
        np.copyto(host, source)
    else:
        for j, row in enumerate(order):
            np.copyto(host[j], source[row])


class _Copier:
    """The thread :meth:`HostLogits.copy_ahead` copies on. The caller holds the GIL while it
    builds the step's events, and a thread that only waits for the GIL gets it when the holder
    blocks or after the switch interval (5 ms): a copy merely queued would start only when the
    step loop's first mod read waits for it, and would wait for all of it. So
    :meth:`start` waits until the copy is under way (a thread wake-up, tens of microseconds) —
    numpy then runs it without the GIL, alongside the caller."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one start at a time (engines in one process share the copier)
        self._go = threading.Lock()
        self._go.acquire()
        self._started = threading.Lock()
        self._started.acquire()
        self._job: tuple[np.ndarray, list[int], np.ndarray, Future[None]] | None = None
        self._thread = threading.Thread(target=self._loop, name="raylens-logits-copy", daemon=True)
        self._thread.start()

    def start(self, source: np.ndarray, order: list[int], host: np.ndarray) -> "Future[None] | None":
        """Copy rows ``order`` of ``source`` into ``host``; returns once the copy has begun. None
        when the copier's thread is gone, or has not taken the copy within
        :data:`COPIER_START_S` (it is stuck): the step loop must never wait on it for long, and
        the caller makes a new copier (a stuck thread that takes the copy later writes into
        memory no one reads)."""
        future: Future[None] = Future()
        with self._lock:
            if not self._thread.is_alive():
                return None
            self._job = (source, order, host, future)
            self._go.release()
            if not self._started.acquire(timeout=COPIER_START_S):
                return None
        return future

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            self._started.release()
            assert job is not None  # internal invariant: start() sets it before releasing _go
            source, order, host, future = job
            try:
                _copy_rows(source, order, host)
            except BaseException as err:  # the reader gets it; the copier goes on
                future.set_exception(err)
            else:
                future.set_result(None)


@functools.lru_cache(maxsize=1)
def _copier() -> _Copier:
    return _Copier()


os.register_at_fork(after_in_child=_copier.cache_clear)  # a forked child has no copier thread: it makes its own


class ReleasedLogits:
    """What a result's ForwardPass holds for ``logits`` when its request did not keep them: their
    ``shape``, and a clear error for any read. Keeping them would hold every step's whole batch of
    logits (rows × vocabulary floats a step) until the results are dropped."""

    __slots__ = ("shape", "step")

    def __init__(self, shape: tuple[int, ...], step: int) -> None:
        self.shape, self.step = shape if type(shape) is tuple else tuple(shape), step

    def _refuse(self, *_: Any, **__: Any) -> Any:
        from engine.errors import LogitsNotKeptError

        raise LogitsNotKeptError(
            f"the logits of step {self.step} were not kept once the step was over (keep_logits is off); read them "
            "during the step (a mod, or an on_event listener), or run the request with keep_logits=True "
            "(generation.keep_logits in the config)", parameter="keep_logits", value=False)

    to_numpy = numpy = to = item = tolist = __getitem__ = __array__ = __float__ = _refuse

    @property
    def tensor(self) -> Any:
        return self._refuse()

    @property
    def device(self) -> Any:
        return self._refuse()

    @property
    def dtype(self) -> Any:
        return self._refuse()

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ReleasedLogits(shape={self.shape}, step={self.step})"


@functools.lru_cache(maxsize=4096)
def released(shape: tuple[int, ...], step: int) -> ReleasedLogits:
    """The one :class:`ReleasedLogits` of ``shape`` and ``step``, shared by every released copy
    that asks (nothing changes one once made). A logits mod's request keeps two released copies
    a step, its ForwardPass's and its AdjustedLogits'; every object a request keeps until it ends
    is one more for the garbage collector's young passes to walk (cold, ~0.2 µs each), and at 64
    concurrent requests those passes are a few per cent of the mod path's time."""
    return ReleasedLogits(shape, step)


_FLOAT32 = np.dtype(np.float32)


class TensorShim:
    """``readonly``: the tensors events hand mods are the engine's own (a row of the batch's
    logits, a slice of captured internals); writing into them would change what the engine samples
    while the payload records a Noop, so writes raise. A mod changes logits by returning
    ``AdjustedLogits`` with an edited copy (``to_numpy()`` already returns a copy)."""

    __slots__ = ("_view", "_readonly", "_source", "_host", "lent", "_shape")

    def __init__(self, tensor: torch.Tensor, *, readonly: bool = False) -> None:
        self._view = tensor
        self._readonly = readonly
        self._source: tuple[torch.Tensor, int] | None = None
        self._host: HostLogits | None = None
        self.lent: tuple[HostLogits, int] | None = None  # (the step's lender, the row's key) when wrapping a whole lent row
        self._shape: tuple[int, ...] | None = None  # known without asking torch (a wrapped numpy array's)

    @classmethod
    def row(cls, batch: torch.Tensor, index: int, host: HostLogits | None = None) -> "TensorShim":
        """Read-only ``(1, V)`` row ``index`` of ``batch (B, V)``: the view is made when the tensor
        is first used (a step hands every request its logits; most are never read); ``host``: the
        step's host copy for mods, if this row is in it."""
        shim = cls.__new__(cls)
        shim._view, shim._readonly, shim._source, shim._host, shim.lent, shim._shape = None, True, (batch, index), host, \
            None, None
        return shim

    @property
    def _tensor(self) -> torch.Tensor:
        view = self._view
        if view is None:
            batch, index = self._source  # type: ignore[misc]
            view = self._view = batch[index:index + 1]
        return view

    def _check_writable(self) -> None:
        if self._readonly:
            raise TypeError("this tensor is read-only (it is the engine's own); edit a copy from to_numpy() and "
                            "return it with actions.adjust_logits(...) / AdjustedLogits(...)")

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "TensorShim":
        """Wrap a host copy of ``array``; move it with ``.to(device)`` if needed. A view of a
        step's logits lent to a mod (its first ``to_numpy()``) is wrapped as it is: it is already
        the mod's own copy."""
        base = getattr(array, "base", None)
        lender = _LENT.get(id(base)) if base is not None else None
        if lender is not None and lender.owns(base) and array.dtype is _FLOAT32:  # (a lent view's own dtype)
            shim = cls(torch.from_numpy(array))
            slot = lender.slot_of(array)
            shim.lent = None if slot is None else (lender, slot)
            # numpy's shape is a tuple of ints already: the action's record and its released copy
            # read it every step, and torch's costs a microsecond or two each time
            shim._shape = array.shape
            return shim
        return cls(torch.from_numpy(np.array(array, copy=True)))

    #: The wrapped torch tensor (no copy): the same property, not one that calls the other (the
    #: engine reads a logits mod's every step)
    tensor = _tensor

    def to_numpy(self) -> np.ndarray:
        if self._host is not None:
            lent = self._host.lend(self._source[1])  # type: ignore[index]
            if lent is not None:
                return lent
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
        if self._shape is not None and target.type == "cpu" and target.index is None:  # a wrapped host array:
            return self  # on the CPU already (the usual logits mod's ``.to(event.logits.device)`` every step)
        return self if self._tensor.device == target else TensorShim(self._tensor.to(target))

    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is not None:
            return self._shape
        if self._view is None:  # a row not viewed yet: its shape without making the view
            batch = self._source[0]  # type: ignore[index]
            return (1, *batch.shape[1:])
        return tuple(self._view.shape)

    @property
    def device(self) -> torch.device:
        # a row not viewed yet answers from its batch: the usual logits mod asks for
        # ``.to(event.logits.device)`` every step, and making the view costs more than the rest
        return self._source[0].device if self._view is None else self._view.device  # type: ignore[index]

    @property
    def dtype(self) -> torch.dtype:
        return self._source[0].dtype if self._view is None else self._view.dtype  # type: ignore[index]

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


def logits_dims(logits: Any) -> tuple[int, ...] | None:
    """The shape of a mod's logits object as Python ints (what a payload records and a released
    copy keeps), None for an object with no shape. Read once per applied ``AdjustedLogits``: a
    torch shape costs a microsecond or two a read, and a logits mod applies one every step."""
    shape = getattr(logits, "shape", None)
    return tuple(map(int, shape)) if shape is not None else None


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
    if t.device == device and (dtype is None or t.dtype == dtype):  # as .to() would: the same tensor, for less
        return t
    return t.to(device=device, dtype=dtype) if dtype is not None else t.to(device=device)
