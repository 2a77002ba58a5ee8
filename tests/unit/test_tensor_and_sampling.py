"""TensorShim (the max.driver.Tensor surface) and the pure sampling function."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from engine.model.sampling import SamplingParams, make_generator, sample
from engine.model.tensor import TensorShim, as_torch, logits_dims
from mods.tensor import NumpyTensor


def test_tensor_shim_round_trips_through_numpy():
    values = torch.randn(1, 50)
    shim = TensorShim(values)
    back = TensorShim.from_numpy(shim.to_numpy())
    assert torch.equal(back.tensor, values)
    assert shim.shape == (1, 50) and shim.device == torch.device("cpu")
    assert shim.to(shim.device) is shim


def test_to_numpy_is_float32_and_a_copy():
    half = TensorShim(torch.ones(1, 4, dtype=torch.float16))
    assert half.to_numpy().dtype == np.float32
    values = torch.zeros(1, 4)
    arr = TensorShim(values).to_numpy()
    arr[0, 0] = 9.0
    assert values[0, 0] == 0.0  # a mod's edit never leaks into the engine's logits


def test_indexing_and_assignment():
    shim = TensorShim(torch.arange(6, dtype=torch.float32).reshape(1, 6))
    assert float(shim[0, 2]) == 2.0
    shim[0, 1:3] = np.array([7.0, 8.0])
    assert shim.to_numpy().tolist() == [[0.0, 7.0, 8.0, 3.0, 4.0, 5.0]]
    assert np.asarray(shim).shape == (1, 6)


def test_as_torch_accepts_every_tensor_kind_mods_hand_back():
    arr = np.arange(4, dtype=np.float32)
    for value in (arr, torch.from_numpy(arr), TensorShim.from_numpy(arr), NumpyTensor(arr)):
        assert torch.equal(as_torch(value, device=torch.device("cpu"), dtype=torch.float32), torch.from_numpy(arr))


def test_logits_dims_reads_any_logits_objects_shape_as_python_ints():
    """What a payload records and a released copy keeps of an AdjustedLogits' logits: plain ints
    whatever shape object the logits answer with (torch.Size, numpy's tuple, a shim's), None for
    an object with no shape."""
    row = torch.zeros(1, 7)
    for logits in (row, row.numpy(), TensorShim(row), TensorShim.row(torch.zeros(3, 7), 1)):
        dims = logits_dims(logits)
        assert type(dims) is tuple and dims == (1, 7) and all(type(d) is int for d in dims)
    assert logits_dims([0.0] * 7) is None
    assert logits_dims(np.zeros(5, dtype=np.float32)[np.newaxis, :].astype(np.int64)) == (1, 5)


def test_greedy_picks_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9])
    assert sample(logits, SamplingParams(0.0), make_generator(0, torch.device("cpu"))) == 1


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.randn(1000)
    params = SamplingParams(1.0, top_p=1.0, top_k=0)

    def draw(seed):
        gen = make_generator(seed, torch.device("cpu"))
        return [sample(logits, params, gen) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


@pytest.mark.parametrize("params,allowed", [
    (SamplingParams(1.0, top_k=2), {0, 1}),
    (SamplingParams(1.0, top_p=0.5), {0}),
])
def test_top_k_and_top_p_restrict_the_candidates(params, allowed):
    logits = torch.tensor([5.0, 4.0, 1.0, 0.5, 0.1])
    gen = make_generator(0, torch.device("cpu"))
    drawn = {sample(logits, params, gen) for _ in range(200)}
    assert drawn <= allowed and drawn


def test_a_steps_logits_reach_mods_through_one_host_copy_each_rows_first_read_its_own():
    """HostLogits: the rows of every request with mods are copied to the host once, at the first
    read; a row's first to_numpy() is a writable view of that copy (its mod's edits never reach the
    engine's logits, nor another row), a second read is a fresh copy of the engine's row, and
    from_numpy of the view wraps it without copying again."""
    from engine.model.tensor import HostLogits

    batch = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)  # (B, V)
    original = batch.clone()
    host = HostLogits(batch)
    for row in (1, 3):
        host.add(row)
    a, b = TensorShim.row(batch, 1, host), TensorShim.row(batch, 3, host)
    view = a.to_numpy()
    assert view.shape == (1, 6) and np.array_equal(view, original[1:2].numpy())
    view[0, 0] = -1e9  # the mod's edit, in place
    assert torch.equal(batch, original), "a mod's edit reached the engine's logits"
    again = a.to_numpy()
    assert again[0, 0] == original[1, 0] and not np.shares_memory(again, view), "a second read must be a copy"
    assert np.array_equal(b.to_numpy(), original[3:4].numpy()), "another row saw the edit"
    wrapped = TensorShim.from_numpy(view)
    assert np.shares_memory(wrapped.tensor.numpy(), view) and wrapped.lent == (host, 0)
    best, where = host.row_max(0)
    assert float(best) == float(original[1, 1:].max()) and int(where) == 5  # the edited row's maximum
    assert TensorShim.row(batch, 0, host).to_numpy() is not None  # a row without mods: its own copy
    plain = TensorShim.from_numpy(np.ones((1, 6), dtype=np.float32))
    assert plain.lent is None


def test_known_argmaxes_as_ints_and_as_tensors_mix_in_one_batch():
    """A lent row's argmax comes back as an int, a mod's own array's as a 0-d tensor: one step may
    hold both, and each row gets its own (the argmax is trusted: it is what the check found)."""
    from engine.model.sampling import SamplingParams, SampleRow, make_generator, sample_rows

    greedy = SamplingParams(temperature=0.0)
    gen = make_generator(0, torch.device("cpu"))
    logits = torch.zeros(1, 8)
    rows = [SampleRow(logits, greedy, gen, argmax=3), SampleRow(logits, greedy, gen, argmax=torch.tensor(5)),
            SampleRow(torch.arange(8.0)[None], greedy, gen)]
    assert [r.token for r in sample_rows(rows)] == [3, 5, 7]


def test_a_row_of_its_own_in_a_greedy_batch_is_read_alone_the_others_take_their_sorted_top(monkeypatch):
    """A prompt fed in chunks joins the step with logits of its own (no batch, no top log-probs):
    its row is read whole, and only it; the batch's rows still take the best id of the top their
    forward computed (a batch row with a tie at the top is read too). Every row gets its argmax."""
    import engine.model.sampling as sampling
    import engine.model.vocab_search as vocab_search
    from engine.model.backend import top_logprobs
    from engine.model.sampling import SampleRow, sample_rows

    greedy = SamplingParams(temperature=0.0)
    gen = make_generator(0, torch.device("cpu"))
    batch = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    batch[4, 7] = batch[4, 9] = batch[4].max() + 1.0  # a tie at the top: the first of them is the argmax
    top = top_logprobs(batch)
    own = torch.randn(1, 300, generator=torch.Generator().manual_seed(2))
    rows = [SampleRow(None, greedy, gen, source=(batch, b), top=top) for b in range(6)]
    rows.insert(2, SampleRow(own, greedy, gen))
    passes: list[int] = []
    real_row_max = sampling.row_max
    for module in (sampling, vocab_search):  # the sampler's own searches, and those of first_max_ids
        monkeypatch.setattr(module, "row_max", lambda x: passes.append(x.shape[0]) or real_row_max(x))
    tokens = [r.token for r in sample_rows(rows)]
    expected = [int(batch[b].argmax()) for b in range(6)]
    expected.insert(2, int(own.argmax()))
    assert tokens == expected and tokens[5] == 7
    assert sorted(passes) == [1, 1], f"rows read whole per pass: {passes} (the lone row and the tied row only)"


def test_a_rows_shape_is_known_before_its_view_is_made_and_equals_the_views():
    batch = torch.arange(3 * 5 * 2, dtype=torch.float32).reshape(3, 5, 2)
    for index in range(3):
        lazy, viewed = TensorShim.row(batch, index), TensorShim.row(batch, index)
        viewed.tensor  # noqa: B018  (makes the view)
        assert lazy.shape == viewed.shape == tuple(batch[index:index + 1].shape) == (1, 5, 2)
        assert lazy._view is None, "reading the shape made the view"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 1]], ids=["every row", "some rows"])
def test_the_host_copy_is_float32_whatever_the_logits_dtype_and_never_aliases_them(dtype, rows):
    from engine.model.tensor import HostLogits

    batch = (torch.arange(4 * 6, dtype=torch.float32).view(4, 6) / 7).to(dtype)
    host = HostLogits(batch, rows=rows)
    for j, row in enumerate(rows):
        lent = host.lend(row)
        assert lent.dtype == np.float32 and lent.shape == (1, 6)
        assert np.array_equal(lent, batch[row:row + 1].float().numpy())
        if dtype == torch.float32:  # numpy could have handed back a view of the engine's own
            assert not np.shares_memory(lent, batch.numpy())


def test_from_numpy_knows_a_lent_row_by_the_view_lent_and_by_any_other_view_of_the_whole_row():
    from engine.model.tensor import HostLogits

    batch = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    host = HostLogits(batch, rows=[2, 0])
    view = host.lend(0)  # slot 1
    assert TensorShim.from_numpy(view).lent == (host, 1)
    assert TensorShim.from_numpy(view[:]).lent == (host, 1)  # another view object of the same row
    assert TensorShim.from_numpy(view.reshape(4)).lent == (host, 1)
    assert TensorShim.from_numpy(view[:, :2]).lent is None  # part of a row: not a whole row of the copy
    other = host.lend(2)  # slot 0
    assert TensorShim.from_numpy(other).lent == (host, 0)


def test_a_wrapped_lent_row_answers_shape_and_to_as_its_tensor_does():
    """A lent row wrapped by from_numpy keeps the array's shape (numpy's, read without torch) and
    stays itself on ``.to`` the CPU: each answer is what its tensor would give, in any shape the
    mod reshaped it to."""
    from engine.model.tensor import HostLogits

    batch = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    host = HostLogits(batch)
    host.share(1)
    view = host.lend(1)
    for array in (view, view.reshape(8), view[:]):
        wrapped = TensorShim.from_numpy(array)
        assert wrapped.lent == (host, -2)
        assert wrapped.shape == tuple(wrapped.tensor.shape) == array.shape
        for device in ("cpu", torch.device("cpu"), wrapped.device):
            moved = wrapped.to(device)
            assert moved is wrapped and moved.tensor.device.type == "cpu"
    copied = TensorShim.from_numpy(np.zeros((2, 3), dtype=np.float64))  # not lent: torch answers
    assert copied.lent is None and copied.shape == (2, 3) and copied.to("cpu").tensor.dtype == torch.float64


def test_a_row_shared_in_place_is_lent_as_the_batchs_own_row_and_known_by_its_key():
    """HostLogits.share: the row's first read is a writable view of the batch itself (no copy),
    from_numpy of it (or of another view of the whole row) wraps it as it is under the key
    ``-1 - row``, row_max reads the row as its mod left it; a second read is a copy of it; rows
    given with add() are copied as before, in their own slots."""
    from engine.model.tensor import HostLogits

    batch = torch.randn(4, 600, generator=torch.Generator().manual_seed(0))
    host = HostLogits(batch)
    host.share(1)
    host.share(3)
    host.add(2)
    view = host.lend(1)
    assert view.shape == (1, 600) and np.shares_memory(view, batch.numpy())
    view[0, 10] = 1e6  # the mod's edit, in place: the engine's own row
    assert float(batch[1, 10]) == 1e6
    wrapped = TensorShim.from_numpy(view)
    assert wrapped.lent == (host, -2) and np.shares_memory(wrapped.tensor.numpy(), view)
    assert TensorShim.from_numpy(view.reshape(600)).lent == (host, -2)  # another view of the whole row
    assert TensorShim.from_numpy(view[:, :5]).lent is None  # part of a row
    assert host.row_max(-2) == (1e6, 10)
    other = host.lend(3)
    assert TensorShim.from_numpy(other).lent == (host, -4)
    assert host.row_max(-4) == (float(batch[3].max()), int(batch[3].argmax()))  # read after the first ask
    again = host.lend(1)
    assert again is None  # the shim then copies the row as it is now
    copied = host.lend(2)
    assert not np.shares_memory(copied, batch.numpy()) and TensorShim.from_numpy(copied).lent == (host, 0)
    assert host.was_lent(1) and host.was_lent(3) and host.was_lent(2)


def _rows_searched(monkeypatch) -> list[int]:
    """How many rows each search of lent rows read (a span's rows, or the rows it gathered)."""
    from engine.model import tensor

    searched: list[int] = []
    real = tensor._Span.maxima

    def maxima(span):
        searched.append(span.array.shape[0] if span.rows is None else len(span.rows))
        return real(span)
    monkeypatch.setattr(tensor._Span, "maxima", maxima)
    return searched


def test_rows_lent_in_place_are_checked_over_the_span_they_lie_in_when_they_are_most_of_it(monkeypatch):
    """A step's rows lent in place are checked in one pass over the span of the batch they lie in
    when they are most of it (rows still feeding a prompt are not lent: gathering the others first
    would copy them), and gathered when few; either way each lent row's maximum is the one its mod
    left, and a row nobody was lent is never reported."""
    from engine.model.tensor import HostLogits

    searched = _rows_searched(monkeypatch)
    batch = torch.randn(6, 700, generator=torch.Generator().manual_seed(2))
    host = HostLogits(batch)
    for row in range(6):
        host.share(row)
    for row, where in ((0, 5), (1, 300), (2, 699), (4, 512)):  # four of six rows
        host.lend(row)[0, where] = 1e6 + row
    batch[3, 0] = 2e6  # a row nobody was lent
    assert [host.row_max(-1 - row) for row in (0, 1, 2, 4)] == [(1e6, 5), (1e6 + 1, 300), (1e6 + 2, 699),
                                                                 (1e6 + 4, 512)]
    host.lend(5)[0, 1] = 3e6  # read after the first ask: only it
    assert host.row_max(-6) == (3e6, 1)
    assert searched == [5, 1]  # rows 0-4 (row 3 read too), then row 5

    searched.clear()
    host = HostLogits(batch)
    for row in range(6):
        host.share(row)
    for row in (0, 4):  # two rows of the five they span: gathered
        host.lend(row)[0, 7 * row] = 5e6 + row
    assert [host.row_max(-1 - row) for row in (0, 4)] == [(5e6, 0), (5e6 + 4, 28)]
    assert searched == [2]


def test_every_row_lent_is_searched_in_one_pass_at_the_first_check(monkeypatch):
    """The first :meth:`HostLogits.row_max` of a step searches every row lent so far, in one pass,
    and later checks read what it found: each row's maximum and its first index, as its mod left
    it (a row lent but not handed back included: its mod may still hand back a view of it)."""
    from engine.model.tensor import HostLogits

    batch = torch.randn(6, 700, generator=torch.Generator().manual_seed(3))
    host = HostLogits(batch)
    for row in range(6):
        host.share(row)
        host.lend(row)[0, 10 * row] = 1e6 + row
    searched = _rows_searched(monkeypatch)
    keys = [-1 - row for row in range(6)]
    got = {key: host.row_max(key) for key in reversed(keys)}
    assert got == {key: (1e6 - 1 - key, -10 * (1 + key)) for key in keys}
    assert searched == [6], "one pass over every lent row, at the first check"


def test_logits_that_are_not_float32_on_a_cpu_are_copied_not_lent_in_place():
    from engine.model.tensor import HostLogits

    batch = torch.randn(3, 600, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    host = HostLogits(batch)
    host.share(0)
    lent = host.lend(0)
    assert lent.dtype == np.float32 and not np.shares_memory(lent, batch.float().numpy())
    assert host.slot == {0: 0}


def test_any_row_of_a_float32_cpu_batch_may_be_lent_in_place_a_tie_at_its_top_included():
    """share() needs no sorted top: the draw of a row lent in place is the argmax the runner found
    before any mod ran (ties to the first id, as argmax picks them), not a read of the row."""
    from engine.model.tensor import HostLogits

    batch = torch.randn(3, 600, generator=torch.Generator().manual_seed(4))
    batch[0, 9] = batch[0, 7] = batch[0].max() + 1.0  # a tie at the top
    host = HostLogits(batch)
    host.share(0)
    view = host.lend(0)
    assert np.shares_memory(view, batch.numpy()) and host.slot == {}


@pytest.mark.parametrize("on_copier", [True, False], ids=["on the copier", "on the loop's thread (small)"])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 1]], ids=["every row", "some rows"])
def test_a_copy_made_ahead_is_the_copy_a_first_read_would_make(rows, on_copier, monkeypatch):
    """copy_ahead (called from the step loop's thread before any mod asks; made on a thread of its
    own, or at once when it is smaller than AHEAD_MIN_BYTES) makes the copy lend() would make at
    the first read: float32, the engine's values, never aliasing them, each row's first read a
    writable view of it that from_numpy knows; nothing is lent by making it, and a second call
    makes no second copy."""
    import engine.model.tensor as tensor
    from engine.model.tensor import HostLogits

    copied_on: list[str] = []
    real_copy = tensor._copy_rows

    def spy(source, order, host):
        copied_on.append(threading.current_thread().name)
        real_copy(source, order, host)

    monkeypatch.setattr(tensor, "_copy_rows", spy)
    monkeypatch.setattr(tensor, "AHEAD_MIN_BYTES", 0 if on_copier else 1 << 20)
    batch = torch.arange(4 * 6, dtype=torch.float32).view(4, 6) / 7
    ahead, lazy = HostLogits(batch, rows=rows), HostLogits(batch, rows=rows)
    ahead.copy_ahead()
    assert not any(ahead.was_lent(row) for row in rows)
    if on_copier:
        assert ahead._ahead is not None
        made, copying = ahead._ahead
        copying.result(timeout=10)
        assert copied_on == ["raylens-logits-copy"], f"the copy ran on {copied_on}, not the copier's thread"
        ahead.copy_ahead()
        assert ahead._ahead[1] is copying, "a second copy_ahead started another copy"
    else:
        made = ahead._host
        assert made is not None and ahead._ahead is None and copied_on == []
        ahead.copy_ahead()
        assert ahead._host is made, "a second copy_ahead made another copy"
    for row in rows:
        mine, theirs = ahead.lend(row), lazy.lend(row)
        assert ahead.was_lent(row) and np.array_equal(mine, theirs) and mine.dtype == np.float32
        assert mine.flags.writeable and not np.shares_memory(mine, batch.numpy())
        assert np.shares_memory(mine, made), "the first read is a view of the copy made ahead"
        assert TensorShim.from_numpy(mine).lent == (ahead, ahead.slot[row])
    assert ahead.lend(rows[0]) is None, "a row's second read must be the reader's own copy"


def test_a_read_waits_for_the_copy_made_ahead_and_gets_its_error(monkeypatch):
    """The first read of a step whose copy is still being made waits for it; a copy that failed
    fails the read (the mod that asked records it) rather than lending a half-made row."""
    import engine.model.tensor as tensor
    from engine.model.tensor import HostLogits

    started, release = threading.Event(), threading.Event()

    def slow_copy(source, order, host):
        started.set()
        assert release.wait(10)
        np.copyto(host, source[order])

    monkeypatch.setattr(tensor, "_copy_rows", slow_copy)
    monkeypatch.setattr(tensor, "AHEAD_MIN_BYTES", 0)  # even this small copy goes to the copier
    batch = torch.arange(2 * 6, dtype=torch.float32).view(2, 6)
    host = HostLogits(batch, rows=[0, 1])
    host.copy_ahead()
    assert started.wait(10)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(host.lend(1)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive(), "the read did not wait for the copy"
    release.set()
    reader.join(10)
    assert np.array_equal(got[0], batch[1:2].numpy())

    def broken_copy(source, order, host):
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(tensor, "_copy_rows", broken_copy)
    failing = HostLogits(batch, rows=[0, 1])
    failing.copy_ahead()
    with pytest.raises(MemoryError, match="no room"):
        failing.lend(0)


def test_a_batch_that_is_not_cpu_float32_is_still_copied_at_the_first_read():
    from engine.model.tensor import HostLogits

    batch = (torch.arange(2 * 6, dtype=torch.float32).view(2, 6) / 7).to(torch.bfloat16)
    host = HostLogits(batch, rows=[0, 1])
    host.copy_ahead()
    assert host._host is None and host._ahead is None
    assert np.array_equal(host.lend(1), batch[1:2].float().numpy())


def test_a_logits_rows_device_and_dtype_are_read_without_making_its_view():
    """The usual logits mod asks for ``.to(event.logits.device)`` every step: a row answers from
    its batch, and its view is made only when its values are read."""
    batch = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    row = TensorShim.row(batch, 1)
    assert row.device == batch.device and row.dtype == torch.float32
    assert row._view is None, "reading the device made the row's view"
    assert row.to(batch.device) is row
    assert np.array_equal(row.to_numpy(), batch[1:2].numpy()) and row.dtype == torch.float32


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_copies_ahead_on_a_copier_of_its_own(monkeypatch):
    """A child forked after the copier started has no copier thread (only the forking thread
    survives a fork); its copies made ahead must not wait for one forever."""
    import engine.model.tensor as tensor
    from engine.model.tensor import HostLogits

    monkeypatch.setattr(tensor, "AHEAD_MIN_BYTES", 0)
    batch = torch.arange(2 * 6, dtype=torch.float32).view(2, 6)
    parent = HostLogits(batch, rows=[0, 1])
    parent.copy_ahead()
    assert parent.lend(0) is not None  # the parent's copier is running
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its copy made ahead is right
        code = 2
        try:
            child = HostLogits(batch, rows=[0, 1])
            child.copy_ahead()
            code = 0 if np.array_equal(child.lend(1), batch[1:2].numpy()) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the child's copy made ahead was wrong or failed"
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's copy made ahead never finished (it waited for the parent's copier)")


@pytest.mark.parametrize("copier", ["gone", "stuck"])
def test_a_copier_that_is_gone_or_stuck_never_holds_up_the_step_and_the_first_read_copies(copier, monkeypatch):
    """The step loop waits for the copier only to take the copy; a copier whose thread died, or
    that does not take it within COPIER_START_S, is given up (a new one next time) and the step's
    first read makes the copy, right."""
    import engine.model.tensor as tensor
    from engine.model.tensor import HostLogits

    release = threading.Event()
    if copier == "gone":
        thread = threading.Thread(target=lambda: None)
    else:  # alive, never serving
        thread = threading.Thread(target=release.wait, args=(30,), daemon=True)
    thread.start()
    if copier == "gone":
        thread.join()
    broken = tensor._Copier.__new__(tensor._Copier)  # its fields, without a thread that serves
    broken._lock, broken._go, broken._started, broken._job, broken._thread = (
        threading.Lock(), threading.Lock(), threading.Lock(), None, thread)
    broken._go.acquire()
    broken._started.acquire()

    class Cached:  # stands in for the lru_cache'd _copier
        cleared = 0

        def __call__(self):
            return broken

        def cache_clear(self):
            Cached.cleared += 1

    monkeypatch.setattr(tensor, "_copier", Cached())
    monkeypatch.setattr(tensor, "AHEAD_MIN_BYTES", 0)
    monkeypatch.setattr(tensor, "COPIER_START_S", 0.2)
    batch = torch.arange(2 * 6, dtype=torch.float32).view(2, 6)
    host = HostLogits(batch, rows=[0, 1])
    started = time.monotonic()
    try:
        host.copy_ahead()
        waited = time.monotonic() - started
        assert waited < 5, f"the step loop waited {waited:.1f} s on a copier that could not copy"
        assert host._ahead is None and Cached.cleared == 1, "the copier was not given up"
        assert np.array_equal(host.lend(1), batch[1:2].numpy()) and np.array_equal(host.lend(0), batch[0:1].numpy())
    finally:
        release.set()
