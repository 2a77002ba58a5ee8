"""The routing policy (pipelines/cluster/router.py) on its own: prefix affinity from reported cache
events, load as the tie-break and the queue bound as the override, groups that stay together,
replicas that die, drain and come back, and round-robin as the control."""

from __future__ import annotations

import pytest

from engine.cache_events import (AllBlocksCleared, BlockRemoved, BlockStored, CacheCursor, CacheEvents,
                                 leading_block_keys)
from pipelines.cluster.router import RouteRequest, Router

BS = 4
SYSTEM_A = list(range(1000, 1040))  # 10 blocks
SYSTEM_B = list(range(2000, 2040))


def _keys(tokens) -> tuple[bytes, ...]:
    return tuple(leading_block_keys(tokens, BS))


def _report(router: Router, replica: str, stored=(), removed=(), *, load=0, at=0.0, draining=False,
            resync=False) -> None:
    events = ((AllBlocksCleared(),) if resync else ()) + tuple(BlockStored(k) for k in stored) + tuple(
        BlockRemoved(k) for k in removed)
    router.on_cache_events(replica, CacheEvents(CacheCursor("e", 0), events, BS, resync), read_at=at, load=load,
                           draining=draining)


def _best(router: Router, request: RouteRequest) -> str:
    return router.choose_replicas(None, request)[0][0]


def _route(router: Router, request: RouteRequest) -> str:
    best = _best(router, request)
    router.on_request_routed(request, best)
    return best


def test_a_request_goes_to_the_replica_that_reported_its_prefix_and_load_decides_without_one():
    router = Router(queue_bound=8)
    router.update_replicas(["r0", "r1"])
    _report(router, "r1", _keys(SYSTEM_A + [0]))
    _report(router, "r0", load=0)
    _report(router, "r1", load=3)  # busier, but it holds the prefix
    assert _best(router, RouteRequest("a", _keys(SYSTEM_A + [7, 8, 9, 10, 11]))) == "r1"
    assert _best(router, RouteRequest("b", _keys(SYSTEM_B + [7, 8, 9, 10, 11]))) == "r0"  # control: no prefix


def test_the_longest_reported_run_wins_and_a_gap_ends_a_run():
    router = Router(queue_bound=8)
    router.update_replicas(["r0", "r1"])
    keys = _keys(SYSTEM_A + [1] * 9)
    _report(router, "r0", keys[:3])
    _report(router, "r1", keys[:2] + keys[3:])  # more keys in all, but its run from the start is shorter
    assert _best(router, RouteRequest("a", keys)) == "r0"
    _report(router, "r0", removed=keys[1:2])  # evicted: r0's run is now one block
    assert _best(router, RouteRequest("b", keys)) == "r1"


def test_a_replica_over_its_queue_bound_is_skipped_while_another_has_room():
    router = Router(queue_bound=2)
    router.update_replicas(["r0", "r1"])
    _report(router, "r0", _keys(SYSTEM_A + [0]), load=2)
    _report(router, "r1", load=1)
    request = RouteRequest("a", _keys(SYSTEM_A + [5]))
    assert router.choose_replicas(None, request) == [["r1"], ["r0"]]
    assert router.stats().skipped == {"r0": 1}
    _report(router, "r1", load=5)  # every replica full: the least loaded, prefix or not
    assert _best(router, request) == "r0"
    _report(router, "r0", load=1)  # room again: the prefix wins
    assert _best(router, request) == "r0"


def test_requests_this_router_sent_count_as_load_before_any_report():
    router = Router(queue_bound=2)
    router.update_replicas(["r0", "r1"])
    placed = [_route(router, RouteRequest(f"q{i}")) for i in range(4)]
    assert sorted(placed) == ["r0", "r0", "r1", "r1"]
    assert router.stats().replicas["r0"].load == 2


def test_the_choices_of_one_group_stay_on_one_replica():
    router = Router(queue_bound=8)
    router.update_replicas(["r0", "r1"])
    _report(router, "r1", _keys(SYSTEM_A + [0]))
    first = _route(router, RouteRequest("c0", _keys(SYSTEM_B + [1]), group="g"))
    assert first == "r0"
    _report(router, "r0", load=5)  # busier now, and r1 holds a better prefix for the next choice
    assert _route(router, RouteRequest("c1", _keys(SYSTEM_A + [1]), group="g")) == "r0"
    assert router.stats().decisions[("r0", "group")] == 1
    for rid in ("c0", "c1"):
        router.on_request_finished(RouteRequest(rid, group="g"), "r0", at=1.0)
    assert _route(router, RouteRequest("c2", _keys(SYSTEM_A + [1]), group="g")) == "r1"  # the group ended


def test_a_dead_replica_gets_nothing_until_it_reports_and_its_cache_is_forgotten():
    router = Router(queue_bound=8)
    router.update_replicas(["r0", "r1"])
    _report(router, "r0", _keys(SYSTEM_A + [0]))
    router.on_replica_actor_died("r0")
    assert router.choose_replicas(None, RouteRequest("a", _keys(SYSTEM_A + [1]))) == [["r1"]]
    _report(router, "r0", resync=True)  # back, from a new process: nothing cached
    assert router.stats().replicas["r0"] == router.stats().replicas["r0"].__class__(True, False, 0, 0)
    _report(router, "r1", load=1)
    assert _best(router, RouteRequest("b", _keys(SYSTEM_A + [1]))) == "r0"  # rejoined: least loaded


def test_a_draining_replica_gets_nothing_and_no_replica_up_means_no_choice():
    router = Router(queue_bound=8)
    router.update_replicas(["r0", "r1"])
    _report(router, "r1", _keys(SYSTEM_A + [0]), draining=True)
    assert router.choose_replicas(None, RouteRequest("a", _keys(SYSTEM_A + [1]))) == [["r0"]]
    router.on_replica_actor_died("r0")
    assert router.choose_replicas(None, RouteRequest("b")) == []


def test_keys_sent_to_a_replica_count_until_a_report_read_after_the_request_finished():
    router = Router(queue_bound=8)
    router.update_replicas(["r0", "r1"])
    keys = _keys(SYSTEM_A + [1])
    assert _route(router, RouteRequest("first", keys)) == "r0"
    assert _best(router, RouteRequest("second", keys)) == "r0"  # in flight there: its prefix will be
    router.on_request_finished(RouteRequest("first", keys), "r0", at=5.0)
    _report(router, "r0", at=4.0)  # a read sent before it finished: the claim stays
    assert _best(router, RouteRequest("third", keys)) == "r0"
    _report(router, "r1", keys[:2])
    assert _best(router, RouteRequest("fourth", keys)) == "r0"  # the claim's whole run beats r1's two blocks
    _report(router, "r0", at=6.0)  # read after it finished, and nothing reported (say, evicted): gone
    assert _best(router, RouteRequest("fifth", keys)) == "r1"


def test_round_robin_takes_turns_whatever_is_cached():
    router = Router("round_robin", queue_bound=8)
    router.update_replicas(["r0", "r1", "r2"])
    _report(router, "r2", _keys(SYSTEM_A + [0]))
    placed = [_route(router, RouteRequest(f"q{i}", _keys(SYSTEM_A + [i]))) for i in range(6)]
    assert placed == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_sixteen_chats_over_two_prompts_split_by_prompt_under_affinity_and_not_under_round_robin():
    """A model of the e2e test: each replica caches what it served (no eviction)."""
    order = [SYSTEM_A, SYSTEM_A, SYSTEM_B, SYSTEM_B] * 4

    def served(policy: str) -> dict[str, set[int]]:
        router = Router(policy, queue_bound=8)
        router.update_replicas(["r0", "r1"])
        prompts: dict[str, set[int]] = {"r0": set(), "r1": set()}
        for i, system in enumerate(order):
            keys = _keys(system + [i, i, i, i, i])
            replica = _route(router, RouteRequest(f"c{i}", keys))
            router.on_request_finished(RouteRequest(f"c{i}", keys), replica, at=float(i))
            _report(router, replica, keys, at=i + 0.5)
            prompts[replica].add(system[0])
        return prompts

    assert sorted(map(len, served("affinity").values())) == [1, 1]  # each replica one system prompt
    assert sorted(map(len, served("round_robin").values())) == [2, 2]  # control: both prompts on both


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="`policy` must be affinity or round_robin"):
        Router("random", queue_bound=1)  # type: ignore[arg-type]
