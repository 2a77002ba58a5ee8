"""A mod cannot hang or end the process it shares: a call past the manager's time limit is
abandoned and recorded, and ``BaseException``s raised in a mod are recorded, never propagated.
Both make the call fatal for its request."""

from __future__ import annotations

import gc
import threading

import pytest

from mods import ForceTokens, Noop, Sampled, conversation
from mods.loading import load_mod_from_payload
from mods.manager import ModManager, abandoned_mod_threads

LIMIT_S = 0.5  # short, so the test is quick; the stuck mod waits on an event, not on time


@pytest.fixture
def release(release_stuck_mods):
    return release_stuck_mods


def test_a_mod_that_never_returns_is_abandoned_recorded_and_fatal(release):
    later = []

    def stuck(event, tokenizer=None):
        print("started")
        release.wait()
        print("printed after the limit: dropped")

    def after(event, tokenizer=None):
        later.append(event)

    manager = ModManager([stuck, after], call_timeout_s=LIMIT_S)
    calls = manager.dispatch_traced(Sampled("r", 4, 1))
    assert len(calls) == 1 and not later, "mods after a fatal call are not called for that event"
    (call,) = calls
    assert call.timed_out and call.fatal and isinstance(call.action, Noop)
    assert call.exception.type == "ModCallTimeout"
    assert call.exception.message == f"mod stuck did not return within {LIMIT_S:g} s on Sampled step 4"
    assert "release.wait()" in call.exception.traceback, "the record shows where the mod was stuck"
    assert [e.message for e in call.logs] == ["started\n", f"[mods] {call.exception.message}\n"]
    assert call.elapsed_ms >= LIMIT_S * 1000
    assert len(abandoned_mod_threads()) == 1

    quick = manager.dispatch_traced(Sampled("r", 5, 1), mods=[lambda e, t=None: ForceTokens([1])])
    assert not quick[0].fatal and quick[0].action.tokens == [1], "the manager goes on with a fresh worker"


def test_the_worker_thread_sees_the_callers_capture_and_request_context():
    seen = {}

    def reads_context(event, tokenizer=None):
        seen["thread"] = threading.current_thread()
        print("from the worker")
        return ForceTokens([len(conversation.get_conversation())])

    conversation.set_conversation("ctx-req", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    try:
        (call,) = ModManager([reads_context], call_timeout_s=5.0).dispatch_traced(Sampled("ctx-req", 0, 1))
    finally:
        conversation.clear_request("ctx-req")
    assert seen["thread"] is not threading.current_thread(), "with a limit the call runs on the worker"
    assert call.exception is None and call.action.tokens == [2]
    assert [e.message for e in call.logs] == ["from the worker\n"]


@pytest.mark.parametrize("limit", [None, 0])
def test_without_a_limit_mods_run_inline_on_the_calling_thread(limit):
    seen = []
    ModManager([lambda e, t=None: seen.append(threading.current_thread())], call_timeout_s=limit).dispatch(
        Sampled("r", 0, 1))
    assert seen == [threading.current_thread()]


def test_in_a_batch_of_many_requests_each_call_keeps_its_own_limit(release):
    """The runner waits once for a whole batch of calls: a stuck call with a short limit behind a
    quick call with a long one is still abandoned at its own limit (the run returns while the
    long limit is far off), the calls after it on its event are skipped, and the other requests'
    calls before and after it run."""
    from mods.manager import CallRunner

    def quick(event, tokenizer=None):
        return ForceTokens([event.step])

    def stuck(event, tokenizer=None):
        release.wait()

    patient = ModManager([quick], call_timeout_s=600.0)
    hasty = ModManager([stuck, quick], call_timeout_s=LIMIT_S)
    last = ModManager([quick], call_timeout_s=600.0)
    runner, out = CallRunner(), []
    jobs = [(patient, Sampled("a", 1, 1)), (hasty, Sampled("b", 2, 1)), (last, Sampled("c", 3, 1))]
    groups = [(manager, manager.pending_calls(event)) for manager, event in jobs]

    def run() -> None:
        runner.run([pending for _, pendings in groups for pending in pendings])
        out.append([manager.records(pendings) for manager, pendings in groups])
    dispatcher = threading.Thread(target=run, daemon=True)
    dispatcher.start()
    dispatcher.join(timeout=60)  # a bound, far under the patient calls' 600 s
    assert not dispatcher.is_alive(), "the stuck call was not abandoned at its own limit"
    first, middle, final = out[0]
    assert [c.action.tokens for c in first] == [[1]] and [c.action.tokens for c in final] == [[3]]
    assert len(middle) == 1 and middle[0].timed_out and middle[0].fatal
    assert middle[0].exception.message == f"mod stuck did not return within {LIMIT_S:g} s on Sampled step 2"
    runner.close()


class CustomBase(BaseException):
    pass


@pytest.mark.parametrize("limit", [None, 5.0])
@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt(), GeneratorExit(), CustomBase("custom")])
def test_base_exceptions_in_a_mod_are_recorded_and_fatal_never_raised(raised, limit):
    later = []

    def raises(event, tokenizer=None):
        raise raised

    calls = ModManager([raises, lambda e, t=None: later.append(e)], call_timeout_s=limit).dispatch_traced(
        Sampled("r", 2, 1))
    assert len(calls) == 1 and not later
    (call,) = calls
    assert call.fatal and not call.timed_out and isinstance(call.action, Noop)
    assert call.exception.type == type(raised).__name__
    assert "raise raised" in call.exception.traceback


def test_system_exit_in_a_payload_mod_passes_the_bridge_and_is_recorded():
    source = "import sys\ndef m(event, tokenizer=None):\n    sys.exit(7)\n"
    loaded = load_mod_from_payload({"language": "python", "entrypoint": "m", "source": source})
    (call,) = ModManager([loaded], call_timeout_s=5.0).dispatch_traced(Sampled("r", 0, 1))
    assert call.fatal and call.exception.type == "SystemExit" and call.exception.message == "7"


def test_an_ordinary_exception_is_recorded_but_not_fatal():
    later = []

    def raises(event, tokenizer=None):
        raise ValueError("plain")

    calls = ModManager([raises, lambda e, t=None: later.append(e)], call_timeout_s=5.0).dispatch_traced(
        Sampled("r", 0, 1))
    assert len(calls) == 2 and len(later) == 1
    assert calls[0].exception.type == "ValueError" and not calls[0].fatal and not calls[0].timed_out


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "1", True])
def test_call_timeout_s_must_be_a_finite_non_negative_number(bad):
    with pytest.raises(ValueError, match="`call_timeout_s` must be a finite number of seconds >= 0 or None"):
        ModManager([], call_timeout_s=bad)


def test_the_worker_thread_ends_with_its_manager():
    threads = []
    record = lambda e, t=None: threads.append(threading.current_thread())  # noqa: E731
    closed = ModManager([record], call_timeout_s=5.0)
    closed.dispatch(Sampled("r", 0, 1))
    closed.close()
    dropped = ModManager([record], call_timeout_s=5.0)
    dropped.dispatch(Sampled("r", 0, 1))
    del dropped
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
    assert len(threads) == 2 and not any(t.is_alive() for t in threads)
