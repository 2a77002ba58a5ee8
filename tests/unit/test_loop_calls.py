"""The step loop's mod calls run on the loop's own thread; a call past its time limit is abandoned
with that thread: the watchdog records it, renames the thread and hands the rest of the round to a
new loop thread; the stuck thread, once its call returns, finds it no longer owns the loop
(:class:`LoopAbandoned`) and touches nothing."""

from __future__ import annotations

import threading
import time

import pytest

from engine.core.loop_calls import LoopAbandoned, LoopCalls
from mods import ForceTokens, ForwardPass, Sampled
from mods.event_guard import turns_away
from mods.manager import ABANDONED_THREAD_NAME, ModManager, abandoned_mod_threads

LIMIT_S = 0.3


class Loop:
    """A stand-in for the step loop: runs rounds on threads it starts, and records take-overs."""

    def __init__(self) -> None:
        self.calls = LoopCalls(self.take_over)
        self.taken: list[tuple[list, int]] = []
        self.finished: list[tuple[str, list]] = []  # (how the thread ended, its calls' outcomes)
        self.done = threading.Event()

    def start(self, calls: list, start: int = 0) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(calls, start), name="raylens-step-loop", daemon=True)
        self.calls.own(thread)
        thread.start()
        return thread

    def take_over(self, calls, start) -> threading.Thread:
        self.taken.append((calls, start))
        thread = threading.Thread(target=self._run, args=(calls, start), name="raylens-step-loop", daemon=True)
        thread.start()
        return thread

    def _run(self, calls, start) -> None:
        try:
            self.calls.run(calls, start)
        except LoopAbandoned:
            self.finished.append(("abandoned", []))
            return
        self.finished.append(("done", [p.action for p in calls]))
        self.done.set()


def _round(*mods_per_request, limit=LIMIT_S):
    """One round: each request's calls (its mods on one Sampled event), flattened as the loop does."""
    managers = [ModManager(list(mods), call_timeout_s=limit) for mods in mods_per_request]
    groups = [(m, m.pending_calls(Sampled(f"r{i}", 3, 1))) for i, m in enumerate(managers)]
    return groups, [p for _, pendings in groups for p in pendings]


@pytest.fixture
def release(release_stuck_mods):
    return release_stuck_mods


def forcing(token):
    return lambda event, tokenizer=None: ForceTokens([token])


@pytest.mark.parametrize("stuck_in", ["native code", "a Python loop"])
def test_a_call_past_its_limit_hands_the_round_to_a_new_loop_thread(stuck_in, release):
    def stuck(event, tokenizer=None):
        if stuck_in == "native code":
            release.wait()  # the GIL released, as in a sleep or a socket read
        else:
            while not release.is_set():  # holds the GIL but for the interpreter's switches
                pass
        return ForceTokens([99])

    after_on_its_event = []
    groups, calls = _round([forcing(1)], [stuck, lambda e, t=None: after_on_its_event.append(e)], [forcing(3)])
    loop = Loop()
    first = loop.start(calls)
    assert loop.done.wait(10), "the round was not finished by a new loop thread"
    assert len(loop.taken) == 1 and loop.taken[0][1] == 2, "the rest of the round, after the stuck call"
    assert first.name.startswith(ABANDONED_THREAD_NAME) and "(stuck)" in first.name
    (ended, actions), = loop.finished
    assert ended == "done"
    assert [a.tokens for a in (actions[0], actions[3])] == [[1], [3]]  # the other requests' calls were made
    assert actions[1] is None and not after_on_its_event, "the stuck call has no outcome; the next on its event is skipped"
    stuck_call = calls[1]
    assert "stuck" in stuck_call.stack  # the record says where it was stuck
    record = groups[1][0].records(groups[1][1])[0]
    assert record.timed_out and record.fatal

    release.set()
    first.join(10)
    assert not first.is_alive()
    assert loop.finished[-1] == ("abandoned", []), "the stuck thread, once its call returned, touched nothing"
    assert calls[0].action.tokens == [1] and calls[3].action.tokens == [3]
    loop.calls.close()


def test_calls_within_their_limit_run_on_the_loops_own_thread_in_order(release):
    seen = []

    def note(token):
        def call(event, tokenizer=None):
            seen.append((token, threading.current_thread().name))
            time.sleep(LIMIT_S / 3)  # under the limit; together well over it
            return ForceTokens([token])
        return call

    _, calls = _round([note(1), note(2)], [note(3)], [note(4)])
    loop = Loop()
    thread = loop.start(calls)
    thread.join(10)
    assert loop.finished == [("done", [p.action for p in calls])] and not loop.taken
    assert seen == [(t, "raylens-step-loop") for t in (1, 2, 3, 4)]
    assert not abandoned_mod_threads()
    loop.calls.close()


def test_calls_without_a_limit_are_not_watched(release):
    def slow(event, tokenizer=None):
        time.sleep(LIMIT_S * 2)
        return ForceTokens([5])

    _, limited = _round([forcing(1)])  # the watchdog starts, with a short limit
    _, unlimited = _round([slow], limit=None)
    loop = Loop()
    loop.start(limited).join(10)
    loop.start(unlimited).join(10)
    assert not loop.taken and unlimited[0].action.tokens == [5]
    loop.calls.close()


def test_a_call_due_before_the_watchdogs_next_look_wakes_it(release):
    """The watchdog sleeps until the deadline of the call it saw running (here 600 s away); a later
    call whose own deadline comes before that wakes it, so it is abandoned at its own limit."""
    def stuck(event, tokenizer=None):
        release.wait()

    _, quick = _round([forcing(1)], limit=600.0)
    _, short = _round([stuck], limit=LIMIT_S)
    loop = Loop()
    loop.start(quick).join(10)  # the watchdog looked while it ran: it sleeps until its deadline
    loop.done.clear()
    loop.start(short)
    assert loop.done.wait(10)  # abandoned at its own limit, not at the watchdog's next look, 600 s away
    assert len(loop.taken) == 1
    loop.calls.close()


def test_a_take_over_that_cannot_start_a_thread_is_tried_again(release, caplog):
    """Starting the new loop thread may fail (a process at its thread limit): the failure is
    logged, the stuck call stays watched, and the watchdog tries again."""
    def stuck(event, tokenizer=None):
        release.wait()

    class Failing(Loop):
        def take_over(self, calls, start):
            if not self.taken:
                self.taken.append(("failed", start))
                raise RuntimeError("can't start new thread")
            return super().take_over(calls, start)

    _, calls = _round([stuck], [forcing(2)])
    loop = Failing()
    first = loop.start(calls)
    assert loop.done.wait(10), "the round was not finished after the second try"
    assert [start for _, start in loop.taken] == [1, 1]
    assert "could not start a loop thread" in caplog.text
    assert first.name.startswith(ABANDONED_THREAD_NAME)
    assert calls[1].action.tokens == [2]
    loop.calls.close()


def test_a_round_captures_each_calls_prints_and_forgets_the_guards_decisions_after_it(release):
    """A round checks the output capture once, before its first call, and resets the guards'
    decisions once, after its last (no guard is read between its calls): each call's prints are
    still its own, and a mod that rebinds what a guard reads is read afresh after the round."""
    namespace: dict = {"Kind": Sampled, "heard": []}
    exec("def guarded(event, tokenizer=None):\n    if isinstance(event, Kind):\n        heard.append(event)\n", namespace)
    guarded = namespace["guarded"]
    assert turns_away(guarded, Sampled("r", 1, 3)) is False  # decided: Sampled is heard

    def printing(token):
        def call(event, tokenizer=None):
            print(f"call {token}")
            namespace["Kind"] = ForwardPass  # the guard now hears ForwardPass only
            return ForceTokens([token])
        return call

    _, calls = _round([printing(1)], [printing(2), printing(3)])
    loop = Loop()
    loop.start(calls).join(10)
    assert loop.finished == [("done", [p.action for p in calls])]
    assert [[log.message for log in p.buffer.logs()] for p in calls] == [["call 1\n"], ["call 2\n"], ["call 3\n"]]
    assert turns_away(guarded, Sampled("r", 1, 3)) is True, "the round's calls rebound Kind: decided afresh"
    loop.calls.close()
