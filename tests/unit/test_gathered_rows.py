"""The rows a CPU forward gathers, kept from one forward to the next (``GatheredRows``): whatever the
forwards do — decode steps, rows joining, leaving and moving, a row going back and writing its
positions again, a block copied into another, a forward that failed half way — every layer's keys
and values a forward reads are exactly those a fresh gather of the pool gives."""

from __future__ import annotations

import random

import pytest
import torch

from engine.model import gathered_rows
from engine.model.gathered_rows import GatheredRows
from engine.model.kv_cache import BatchCacheView, PagedKVCache

LAYERS, KV, HD, BS = 2, 2, 4, 4


@pytest.fixture(autouse=True)
def _keep_small_rows(monkeypatch):
    """This file's pools are tiny: kept however small (the runner's floor is for speed only)."""
    monkeypatch.setattr(gathered_rows, "GATHERED_MIN_BYTES", 0)


def _pool() -> PagedKVCache:
    return PagedKVCache(num_layers=LAYERS, kv_heads=KV, head_dim=HD, block_size=BS, blocks=64, max_blocks=64,
                        dtype=torch.float32, device=torch.device("cpu"))


def _forward(caches, gathered, tables, starts, lengths, seed):
    """One forward of every layer on each pool (the same writes); what each layer read."""
    generator = torch.Generator().manual_seed(seed)
    q = max(lengths)
    news = [(torch.randn(len(tables), KV, q, HD, generator=generator),
             torch.randn(len(tables), KV, q, HD, generator=generator)) for _ in range(LAYERS)]
    reads = []
    for cache, kept in zip(caches, (gathered, None)):
        view, _ = BatchCacheView.build(cache, tables, starts, lengths, kept)
        reads.append([view.update(k.clone(), v.clone(), layer) for layer, (k, v) in enumerate(news)])
    return reads


def _same(reads) -> None:
    for (k1, v1), (k2, v2) in zip(*reads):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_kept_rows_read_as_a_fresh_gather_through_joins_leaves_moves_and_going_back():
    caches = [_pool(), _pool()]
    gathered = GatheredRows(caches[0])
    rng = random.Random(7)
    free = list(range(1, 64))
    rng.shuffle(free)
    rows: list[dict] = []  # each: its table and length
    step = 0

    def admit(prompt: int) -> None:
        blocks = [free.pop() for _ in range(-(-(prompt + 40) // BS))]
        rows.append({"table": blocks, "length": 0, "prompt": prompt})

    for prompt in (5, 9, 3):
        admit(prompt)
    for step in range(40):
        if step == 6:
            admit(7)  # a row joins (prefilled with the others' decode)
        if step == 12:
            gone = rows.pop(1)  # a row in the middle leaves: the rows after it move up
            free.extend(gone["table"])
            admit(4)  # and a new one may take its blocks
        if step == 18:
            rows[0]["length"] -= 3  # a Backtrack: its positions are written again with new values
        if step == 24:
            caches[0].copy_block(rows[1]["table"][0], rows[2]["table"][0], BS)  # copy-on-write
            caches[1].copy_block(rows[1]["table"][0], rows[2]["table"][0], BS)
        if step == 30:
            gathered.forget()  # a forward elsewhere (a static decode) wrote the pool
        starts = [r["length"] for r in rows]
        lengths = [r["prompt"] if r["length"] == 0 else 1 for r in rows]
        _same(_forward(caches, gathered, [r["table"] for r in rows], starts, lengths, seed=step))
        for r, n in zip(rows, lengths):
            r["length"] += n
    assert gathered.keys and gathered._slots is not None, "the rows were kept throughout"


def test_a_forward_too_small_to_pay_is_gathered_afresh(monkeypatch):
    caches = [_pool(), _pool()]
    gathered = GatheredRows(caches[0])
    monkeypatch.setattr(gathered_rows, "GATHERED_MIN_BYTES", 1 << 20)
    for step in range(3):
        _same(_forward(caches, gathered, [[1, 2, 3]], [0 if step == 0 else 5 + step], [6 if step == 0 else 1],
                       seed=step))
    assert not gathered.keys, "rows kept below the floor"


def test_a_forward_too_large_to_keep_is_gathered_afresh(monkeypatch):
    caches = [_pool(), _pool()]
    gathered = GatheredRows(caches[0])
    monkeypatch.setattr(gathered_rows, "GATHERED_MAX_BYTES", 1000)
    _same(_forward(caches, gathered, [[1, 2, 3]], [0], [6], seed=1))
    assert not gathered.keys, "nothing was kept past the budget"
    monkeypatch.setattr(gathered_rows, "GATHERED_MAX_BYTES", 1 << 20)
    for step in range(3):  # then kept again, and still a fresh gather's
        _same(_forward(caches, gathered, [[1, 2, 3]], [6 + step], [1], seed=2 + step))
    assert gathered.keys


@pytest.mark.parametrize("forgotten", [True, False], ids=["forgotten", "not forgotten (stale)"])
def test_a_forward_that_fails_half_way_is_read_right_after_a_forget(forgotten):
    """A forward that raised after its first layer left the later layers' kept rows unrefreshed
    for its own row order: the next forward, in that order, reads them right once they are
    forgotten (what the runner does when a forward raises), and reads stale rows if not."""
    caches = [_pool(), _pool()]
    gathered = GatheredRows(caches[0])
    _same(_forward(caches, gathered, [[1, 2], [3, 4]], [0, 0], [5, 3], seed=1))
    swapped = [[3, 4], [1, 2]]  # the rows change places; the forward fails after layer 0
    view, _ = BatchCacheView.build(caches[0], swapped, [3, 5], [1, 1], gathered)
    new = torch.randn(2, KV, 1, HD)
    view.update(new, new, 0)
    for cache in caches[1:]:
        cache.keys[0].copy_(caches[0].keys[0])
        cache.values[0].copy_(caches[0].values[0])
    if forgotten:
        gathered.forget()
    reads = _forward(caches, gathered, swapped, [3, 5], [1, 1], seed=3)
    if forgotten:
        _same(reads)
    else:
        with pytest.raises(AssertionError):
            _same(reads)
