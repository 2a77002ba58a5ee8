"""The prefix cache's event log (engine/cache_events.py): a reader that applies what ``since``
hands back always holds exactly the cached set — after a few events, after more than the ring
holds, after the log's process restarted — and the router's key chain is the KV manager's."""

from __future__ import annotations

import random

import pytest

from engine.cache_events import (AllBlocksCleared, BlockRemoved, BlockStored, CacheCursor, CacheEventLog,
                                 apply_events, leading_block_keys)
from engine.core.prefix_index import PrefixIndex, block_key


def _key(i: int) -> bytes:
    return block_key(None, [i])


def _follow(log: CacheEventLog, cursor, view: set[bytes]):
    answer = log.since(cursor)
    apply_events(view, answer.events)
    return answer


def test_a_reader_following_the_log_holds_exactly_the_cached_set_through_random_changes():
    rng = random.Random(7)
    log, view, cursor, truth = CacheEventLog(16, capacity=24), set(), None, set()
    resyncs = 0
    for round_ in range(200):
        for _ in range(rng.randint(0, 40)):  # sometimes more than the ring holds between two reads
            key = _key(rng.randint(0, 50))
            if key in truth and rng.random() < 0.5:
                truth.discard(key)
                log.removed(key)
            else:
                truth.add(key)
                log.stored(key)
        answer = _follow(log, cursor, view)
        cursor, resyncs = answer.cursor, resyncs + answer.resync
        assert view == truth, f"round {round_}: the reader holds {len(view)} keys, the log {len(truth)}"
    assert 1 < resyncs < 200, f"the ring must both overflow and not overflow in this run, got {resyncs} resyncs"


def test_an_up_to_date_reader_gets_only_new_events_in_order():
    log = CacheEventLog(16)
    first = log.since(None)
    assert first.resync and first.events == (AllBlocksCleared(),) and first.block_size == 16
    log.stored(_key(1))
    log.stored(_key(2))
    log.removed(_key(1))
    answer = log.since(first.cursor)
    assert not answer.resync and answer.events == (BlockStored(_key(1)), BlockStored(_key(2)), BlockRemoved(_key(1)))
    assert log.since(answer.cursor).events == () and len(log) == 1


def test_a_cursor_from_another_process_gets_a_resync_of_the_whole_set():
    log = CacheEventLog(16)
    log.stored(_key(3))
    stale = CacheCursor("another-epoch", 1)
    answer = log.since(stale)
    assert answer.resync and answer.events == (AllBlocksCleared(), BlockStored(_key(3)))
    view = {_key(99)}  # what the reader knew of the process that is gone
    apply_events(view, answer.events)
    assert view == {_key(3)}


def test_the_prefix_index_reports_what_it_indexes_and_forgets():
    from engine.core.prefix_index import BlockRows

    index, log = PrefixIndex(), CacheEventLog(4)
    index.listener = log
    rows = BlockRows({}, {})
    assert index.put(_key(1), 5, rows) and not index.put(_key(1), 6, rows)  # a second holder is not indexed
    index.put(_key(2), 7, rows)
    index.evict(5)
    index.evict(5)  # already gone: nothing more to report
    assert log.since(CacheCursor(log.epoch, 0)).events == (BlockStored(_key(1)), BlockStored(_key(2)),
                                                             BlockRemoved(_key(1)))


@pytest.mark.parametrize("length, blocks", [(0, 0), (1, 0), (16, 0), (17, 1), (33, 2), (48, 2), (49, 3)])
def test_leading_keys_are_the_blocks_a_lookup_may_reuse(length, blocks):
    """The KV manager reuses full blocks and always leaves one token to feed: (n - 1) // size."""
    tokens = list(range(100, 100 + length))
    keys = leading_block_keys(tokens, 16)
    assert len(keys) == blocks
    parent = None
    for i, key in enumerate(keys):  # the chain, recomputed independently
        parent = block_key(parent, tokens[i * 16:(i + 1) * 16])
        assert key == parent
    if keys:  # positive control: another first token changes every key after it
        assert not set(leading_block_keys([0] + tokens[1:], 16)) & set(keys)
