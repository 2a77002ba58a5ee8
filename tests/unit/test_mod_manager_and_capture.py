"""ModManager dispatch and per-call capture of prints and logging, including under threads."""

from __future__ import annotations

import logging
import sys
import threading

from mods import ForceTokens, Noop, Sampled, mod
from mods.capture import capture_mod_output
from mods.manager import ModManager


def test_dispatch_calls_every_mod_in_registration_order_and_tags_actions():
    order = []

    def first(event, tokenizer=None):
        order.append("first")
        return ForceTokens([1])

    def second(event, tokenizer=None):
        order.append("second")
        print("second says hi")

    manager = ModManager([first], tokenizer="tok")
    manager.register(second)
    actions = manager.dispatch(Sampled("r", 0, 1))
    assert order == ["first", "second"]
    assert isinstance(actions[0], ForceTokens) and actions[0]._source == "first"
    assert isinstance(actions[1], Noop) and actions[1]._mod_logs == "second says hi\n"


def test_dispatch_records_timing_exceptions_and_invalid_results():
    def raises(event, tokenizer=None):
        raise ValueError("bad mod")

    def invalid(event, tokenizer=None):
        return "not an action"

    calls = ModManager([raises, invalid]).dispatch_traced(Sampled("r", 3, 1))
    assert [c.exception.type for c in calls] == ["ValueError", "InvalidActionError"]
    assert all(isinstance(c.action, Noop) for c in calls)
    assert all(c.elapsed_ms >= 0 and c.step == 3 and c.event_type == "Sampled" for c in calls)
    assert "[mods] Mod raised exception on Sampled: bad mod" in calls[0].logs[0].message
    assert all(c.noteworthy for c in calls)


def test_logging_in_a_mod_is_captured_with_its_level():
    log = logging.getLogger("tests.a_mod")
    log.setLevel(logging.DEBUG)

    @mod
    def chatty(event, actions, tokenizer):
        print("printed")
        log.warning("careful")
        log.debug("details")

    (call,) = ModManager([chatty]).dispatch_traced(Sampled("r", 0, 1))
    assert [(e.level, e.message) for e in call.logs] == [
        ("INFO", "printed\n"), ("WARNING", "careful"), ("DEBUG", "details")]


def test_prints_outside_a_mod_call_still_reach_stdout(capsys):
    with capture_mod_output() as buffer:
        print("inside")
    print("outside")
    assert capsys.readouterr().out == "outside\n"
    assert buffer.logs()[0].message == "inside\n"


def test_concurrent_threads_keep_their_captures_apart():
    """Two threads print interleaved; each capture holds only its own lines (no stdout swap race)."""
    barrier = threading.Barrier(2)
    results: dict[str, str] = {}

    def worker(name: str) -> None:
        with capture_mod_output() as buffer:
            for i in range(200):
                if i == 50:
                    barrier.wait(timeout=10)
                print(f"{name}-{i}")
        results[name] = "".join(e.message for e in buffer.logs())

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for name, other in (("a", "b"), ("b", "a")):
        lines = results[name].splitlines()
        assert lines == [f"{name}-{i}" for i in range(200)], f"capture of {name} got foreign lines"
        assert f"{other}-" not in results[name]


def test_the_stdout_router_is_installed_once_not_per_call():
    with capture_mod_output():
        pass
    router = sys.stdout
    with capture_mod_output():
        pass
    assert sys.stdout is router


def test_silent_noops_get_no_record_when_the_caller_asks_but_are_counted():
    from mods.manager import CallRunner

    @mod
    def silent(event, actions, tokenizer):
        return None

    @mod
    def printing(event, actions, tokenizer):
        print("hello")

    @mod
    def acting(event, actions, tokenizer):
        return actions.force_tokens([5])

    def raising(event, tokenizer=None):
        raise ValueError("bad")

    quiet = ModManager([silent, silent], call_timeout_s=30.0)
    loud = ModManager([silent, printing, acting, raising, silent], call_timeout_s=30.0)
    inline = ModManager([silent, acting], call_timeout_s=None)
    jobs = [(quiet, Sampled("a", 0, 1)), (loud, Sampled("b", 0, 1)), (inline, Sampled("c", 0, 1))]
    runner = CallRunner()

    def made(keep_silent: bool) -> list[list]:
        groups = [(manager, manager.pending_calls(event)) for manager, event in jobs]
        runner.run([pending for manager, pendings in groups[:2] for pending in pendings])  # with a limit
        for pending in groups[2][1]:
            pending.run()  # no limit: inline
        return [manager.records(pendings, keep_silent=keep_silent) for manager, pendings in groups]
    try:
        kept = made(keep_silent=False)
        assert kept[0] == []
        assert [c.mod_name for c in kept[1]] == ["printing", "acting", "raising"]
        assert [c.mod_name for c in kept[2]] == ["acting"]
        assert (quiet.call_stats.calls, loud.call_stats.calls, inline.call_stats.calls) == (2, 5, 2)
        assert loud.call_stats.errors == 1
        everything = made(keep_silent=True)  # the default: a record for every call
        assert [len(calls) for calls in everything] == [2, 5, 2]
        assert all(isinstance(c.action, Noop) and not c.noteworthy for c in everything[0])
    finally:
        runner.close()
