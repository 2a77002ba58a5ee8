"""The scheduler's KV manager without a model: block tables grow by blocks and shrink on a position
move, reservations bound admission, shared blocks are copied before a write, cached blocks nobody
holds are evicted least recently used first (when the pool needs their blocks, or their captured
rows pass the rows budget), and a prefix is reused only when its blocks hold the internals the new
request's plan asks for. The manager holds block ids only; :class:`_Pool` applies what it decides
for the tensors (the pool's growth, copy-on-write copies) to a real :class:`PagedKVCache`, as the
model runner does before each forward."""

from __future__ import annotations

import pytest
import torch

from engine.core.kv_manager import KVManager
from engine.model.backend import KVLayout
from engine.model.capture import CapturePlan, RowCapture
from engine.model.kv_cache import BatchCacheView, PagedKVCache

BS = 4
D, HEADS = 3, 2
LAYER = 1


class _Pool(KVManager):
    """The KV manager with the runner's side beside it: after each ``prepare`` the cache grows to
    what the manager needs and makes its copies, as the runner does before the forward."""

    def __init__(self, cache: PagedKVCache, rows_budget: int | None) -> None:
        super().__init__(KVLayout(cache.block_size, cache.num_blocks, cache.max_blocks, cache.block_nbytes()),
                         rows_budget=rows_budget)
        self.cache = cache

    def prepare(self, request_id: str, start: int, n: int) -> list[int]:
        table = super().prepare(request_id, start, n)
        self.cache.grow(self.num_blocks)
        for source, destination, length in self.take_copies():
            self.cache.copy_block(source, destination, length)
        return table


def _blocks(max_blocks: int = 9, blocks: int = 3, rows_budget: int | None = None) -> _Pool:
    cache = PagedKVCache(num_layers=2, kv_heads=1, head_dim=2, block_size=BS, blocks=blocks, max_blocks=max_blocks,
                         dtype=torch.float32, device=torch.device("cpu"))
    return _Pool(cache, rows_budget)


def _plan(attention: bool = True) -> CapturePlan:
    names = [f"blocks.{LAYER}.hook_resid_post"] + ([f"blocks.{LAYER}.attn.hook_pattern"] if attention else [])
    return CapturePlan.of(names, 2, all_query_rows=True)


def _captured(start: int, q: int, *, attention: bool = True, tag: float = 0.0) -> RowCapture:
    """What a forward of ``q`` tokens at ``start`` captures: hidden ``(q, d)`` whose values name
    their position, attention ``(heads, q, start + q)``, zero past each query's position."""
    hidden = torch.arange(start, start + q, dtype=torch.float32)[:, None].repeat(1, D) + tag
    att = torch.rand(HEADS, q, start + q) * torch.ones(q, start + q).tril(diagonal=start)  # causal
    return RowCapture({LAYER: hidden}, {LAYER: att} if attention else {})


def _caching(kv: KVManager, rid: str) -> None:
    """A request that looked a prefix up (and found none): its full blocks are offered to the index."""
    kv.add(rid)
    assert kv.lookup(rid, [0], _plan()) is None


def _feed(kv: KVManager, rid: str, start: int, tokens: list[int], **kw) -> RowCapture:
    kv.prepare(rid, start, len(tokens))
    captured = _captured(start, len(tokens), **kw)
    kv.record(rid, start, tokens, captured, steered=False)
    return captured


def test_tables_grow_by_blocks_and_a_position_move_frees_the_blocks_past_it():
    kv = _blocks()
    kv.add("a")
    assert kv.prepare("a", 0, 6) == kv.table("a") and len(kv.table("a")) == 2  # 6 positions: 2 blocks of 4
    kv.record("a", 0, list(range(6)), None, steered=False)
    kv.prepare("a", 6, 3)
    assert len(kv.table("a")) == 3
    kv.record("a", 6, [6, 7, 8], None, steered=False)
    kv.prepare("a", 3, 1)  # back to position 3: the blocks wholly past it go back
    assert len(kv.table("a")) == 1 and kv.allocator.held == 1
    kv.remove("a")
    assert kv.allocator.held == 0 and kv.as_dict()["blocks_used"] == 0


def test_the_pool_grows_by_doubling_and_keeps_what_blocks_hold():
    kv = _blocks(max_blocks=17, blocks=3)
    kv.add("a")
    kv.prepare("a", 0, 2 * BS)
    kv.record("a", 0, list(range(2 * BS)), None, steered=False)
    first = kv.table("a")[0]
    kv.cache.keys[0][first].fill_(7.0)
    kv.prepare("a", 2 * BS, 4 * BS)  # six blocks: more than the three allocated
    assert kv.cache.num_blocks >= 7 and float(kv.cache.keys[0][first].min()) == 7.0


def test_reservations_bound_what_is_admitted_and_growing_past_one_needs_room():
    kv = _blocks(max_blocks=9)  # 8 usable blocks = 32 tokens
    kv.add("a")
    kv.add("b")
    assert kv.reserve("a", 20)  # 5 blocks
    assert not kv.reserve("b", 16)  # 4 more would make 9
    assert kv.reserve("b", 12)
    assert not kv.reserve("a", 24)  # a outgrows its reservation: no room next to b
    kv.remove("b")
    assert kv.reserve("a", 24)
    assert kv.as_dict()["blocks_reserved"] == 6
    kv.remove("a")
    assert kv.as_dict()["blocks_reserved"] == 0


def test_a_shared_block_is_copied_before_a_write_and_the_other_holder_keeps_its_keys():
    kv = _blocks()
    _caching(kv, "a")
    _feed(kv, "a", 0, [1, 2, 3, 4, 5])  # block 0 is full and indexed
    assert kv.as_dict()["blocks_cached"] == 1
    kv.add("b")
    hit = kv.lookup("b", [1, 2, 3, 4, 9], _plan())
    assert hit is not None and hit[0] == BS
    shared = kv.table("b")[0]
    assert shared == kv.table("a")[0] and kv.allocator.refs[shared] == 2
    kv.cache.keys[0][shared].fill_(3.0)
    kv.prepare("b", 2, 1)  # b moves back into the shared block and writes position 2
    assert kv.table("b")[0] != shared, "b wrote into a block a still reads"
    copy = kv.table("b")[0]
    assert torch.equal(kv.cache.keys[0][copy, :2], kv.cache.keys[0][shared, :2])  # positions before the write kept
    assert kv.allocator.refs[shared] == 1


def test_a_cached_block_nobody_holds_is_evicted_least_recently_released_first():
    kv = _blocks(max_blocks=5, blocks=5)  # 4 usable blocks
    for rid, first in (("a", 10), ("b", 20)):
        _caching(kv, rid)
        _feed(kv, rid, 0, [first + i for i in range(BS + 1)])
    kv.remove("a")
    kv.remove("b")
    assert kv.as_dict()["blocks_cached"] == 2 and kv.allocator.held == 0
    kv.add("c")
    kv.prepare("c", 0, 3 * BS)  # needs 3 of 4: one cached block must go, a's (released first)
    assert kv.allocator.evictions == 1
    kv.add("d")
    assert kv.lookup("d", [10, 11, 12, 13, 0], _plan()) is None
    kv.add("e")
    assert kv.lookup("e", [20, 21, 22, 23, 0], _plan()) is not None


FIRST_BLOCK_ROWS = (BS * D + HEADS * BS * BS) * 4  # float32 hidden (BS, D) + attention (HEADS, BS, BS)


def test_past_the_rows_budget_the_least_recently_released_cached_block_is_evicted():
    kv = _blocks(rows_budget=FIRST_BLOCK_ROWS)  # room for one first block's rows; blocks are plentiful
    for rid, first in (("a", 10), ("b", 20)):
        _caching(kv, rid)
        _feed(kv, rid, 0, [first + i for i in range(BS + 1)])
        kv.remove(rid)
    stats = kv.as_dict()
    assert stats["cached_rows_bytes"] == FIRST_BLOCK_ROWS == stats["cached_rows_budget_bytes"]
    assert stats["blocks_cached"] == 1 and kv.allocator.evictions == 1
    kv.add("c")
    assert kv.lookup("c", [10, 11, 12, 13, 0], _plan()) is None  # a's went
    kv.add("d")
    assert kv.lookup("d", [20, 21, 22, 23, 0], _plan()) is not None
    kv.remove("c")
    kv.remove("d")
    assert kv.allocator.held == 0 and kv.allocator.free == kv.allocator.num_blocks - 1  # the evicted block is free


def test_while_every_cached_block_is_held_a_new_one_waits_for_room():
    kv = _blocks(rows_budget=FIRST_BLOCK_ROWS)
    _caching(kv, "a")
    _feed(kv, "a", 0, [10 + i for i in range(BS + 1)])
    _caching(kv, "b")
    _feed(kv, "b", 0, [20 + i for i in range(BS + 1)])  # a still holds the only cached block
    assert kv.as_dict()["blocks_cached"] == 1 and kv.index.rows_bytes == FIRST_BLOCK_ROWS
    kv.add("probe")
    assert kv.lookup("probe", [20, 21, 22, 23, 0], _plan()) is None
    kv.remove("probe")
    kv.remove("a")
    _feed(kv, "b", BS + 1, [25])  # b's next forward offers its block again: a's makes room
    kv.add("probe")
    assert kv.lookup("probe", [20, 21, 22, 23, 0], _plan()) is not None
    assert kv.index.rows_bytes == FIRST_BLOCK_ROWS and kv.allocator.evictions == 1


def test_the_kept_rows_are_counted_as_blocks_come_and_go_and_a_prefix_loses_its_tail_first():
    kv = _blocks(max_blocks=5, blocks=5)
    _caching(kv, "a")
    _feed(kv, "a", 0, list(range(2 * BS + 1)))  # two full blocks: ends 4 and 8
    second = (BS * D + HEADS * BS * 2 * BS) * 4
    assert kv.index.rows_bytes == FIRST_BLOCK_ROWS + second
    kv.remove("a")
    kv.add("b")
    kv.prepare("b", 0, 3 * BS)  # 3 of 4 blocks: one cached block goes, the prefix's tail
    assert kv.index.rows_bytes == FIRST_BLOCK_ROWS and kv.allocator.evictions == 1
    kv.add("c")
    hit = kv.lookup("c", list(range(2 * BS + 1)), _plan())
    assert hit is not None and hit[0] == BS  # the head still serves its prefix


def test_a_hit_gives_the_captured_rows_and_ends_where_they_do_not_cover_the_plan():
    kv = _blocks()
    _caching(kv, "a")
    first = _feed(kv, "a", 0, list(range(BS)))
    _feed(kv, "a", BS, list(range(BS, 2 * BS)), attention=False)  # a newest-row-only feed: no attention rows
    kv.prepare("a", 2 * BS, 1)
    kv.record("a", 2 * BS, [99], _captured(2 * BS, 1), steered=False)
    prompt = list(range(2 * BS)) + [99, 5]
    kv.add("b")
    n, rows = kv.lookup("b", prompt, _plan())
    assert n == BS, "the second block lacks attention rows the plan asks for"
    assert torch.equal(rows.hidden[LAYER], first.hidden[LAYER])
    assert torch.equal(rows.attention[LAYER], first.attention[LAYER])
    kv.add("c")
    n, rows = kv.lookup("c", prompt, _plan(attention=False))
    assert n == 2 * BS and rows.hidden[LAYER].shape == (2 * BS, D) and not rows.attention
    assert torch.equal(rows.hidden[LAYER][:, 0], torch.arange(2 * BS, dtype=torch.float32))
    kv.add("d")
    assert kv.lookup("d", [0, 1, 2, 3], _plan()) is None  # the last token is always fed


def test_steered_positions_and_everything_after_them_are_never_cached():
    kv = _blocks()
    _caching(kv, "a")
    _feed(kv, "a", 0, [1, 2, 3, 4])
    kv.prepare("a", BS, 2)
    kv.record("a", BS, [5, 6], _captured(BS, 2), steered=True)
    _feed(kv, "a", BS + 2, [7, 8, 9, 10, 11])
    assert kv.as_dict()["blocks_cached"] == 1
    kv.add("b")
    assert kv.lookup("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], _plan())[0] == BS


def test_the_view_writes_each_token_into_its_block_and_gathers_each_row_in_position_order():
    kv = _blocks()
    kv.add("a")
    kv.add("b")
    tables = [kv.prepare("a", 0, 6), kv.prepare("b", 0, 2)]
    view, positions = BatchCacheView.build(kv.cache, tables, [0, 0], [6, 2])
    assert positions.tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 1]]
    new = torch.arange(2 * 6, dtype=torch.float32).view(2, 1, 6, 1).repeat(1, 1, 1, 2)  # (B, kv, q, hd)
    keys, _ = view.update(new, new, 0)
    assert keys.shape == (2, 1, 6, 2)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert keys[1, 0, :2, 0].tolist() == [10, 11]  # b's two real tokens, not its padding columns
    blocks_a = kv.table("a")
    assert kv.cache.keys[0][blocks_a[1], 1, 0, 0].item() == 5  # position 5: block 1, offset 1


@pytest.mark.parametrize("key,bad", [("kv_block_size", 0), ("kv_block_size", 2048), ("kv_block_size", True),
                                     ("prefix_cache_rows_mb", -1), ("prefix_cache_rows_mb", 1.5),
                                     ("prefix_cache_rows_mb", True)])
def test_a_bad_paging_value_is_a_config_error_naming_the_key(key, bad):
    from engine.config import BackendConfig
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        BackendConfig(**{key: bad})


def test_the_cache_goes_under_the_name_the_models_forward_takes():
    from engine.model.kv_cache import cache_argument

    class Renamed(torch.nn.Module):  # transformers 5.24+
        def forward(self, input_ids=None, cache=None, **kwargs):
            return cache

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    class Compiled(torch.nn.Module):  # torch.compile's wrapper keeps the model as _orig_mod
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

        def forward(self, *args, **kwargs):
            return self._orig_mod(*args, **kwargs)

    marker = object()
    assert cache_argument(Renamed(), marker) == {"cache": marker}
    assert cache_argument(Older(), marker) == {"past_key_values": marker}
    assert cache_argument(Compiled(Renamed()), marker) == {"cache": marker}
    assert Compiled(Older())(**cache_argument(Compiled(Older()), marker)) is marker
