"""A stuck or crashing mod in one request never stalls or kills the others in its batch.

Scripted model (tests/helpers.ScriptedBackend): every request wants to write "hello world". One
request carries the faulty mod; its neighbour, submitted at the same time, must finish normally.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine.core.result import FinishReason
from mods import ForwardPass
from tests.helpers import CharTokenizer, assert_payload_valid, scripted_engine

TOK = CharTokenizer()


def _pair(faulty, **generation):
    eng = scripted_engine(**generation)
    try:
        bad = eng.submit(input_ids=TOK.encode("Q:"), mods=[faulty])
        good = eng.submit(input_ids=TOK.encode("Q:"))
        return bad.result(timeout=60), good.result(timeout=60)
    finally:
        eng.close()


def test_a_mod_that_never_returns_fails_its_request_and_frees_the_batch():
    release = threading.Event()

    def stuck(event, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step == 2:
            release.wait(30)  # far beyond the limit; released at the end so the thread exits
        return None

    try:
        bad, good = _pair(stuck, mod_call_timeout_s=0.5)
    finally:
        release.set()
    assert bad.finish_reason is FinishReason.ERROR
    assert "stuck" in bad.error and "did not return within 0.5" in bad.error
    assert good.finish_reason is FinishReason.STOP and good.output_text == "hello world"
    assert_payload_valid(bad.payload)


@pytest.mark.parametrize("stuck_in", ["native code", "a Python loop"])
def test_the_loop_thread_stuck_in_a_mod_is_replaced_and_the_engine_goes_on_serving(stuck_in):
    """Mods run on the step loop's thread: one stuck past its limit is abandoned with that thread, a
    new loop thread finishes the step and serves every later request; the stuck thread ends, having
    changed nothing, once its mod returns."""
    from mods.manager import abandoned_mod_threads

    release = threading.Event()
    stuck_on: list[tuple[threading.Thread, threading.Thread | None]] = []  # (the call's thread, the loop's)

    def stuck(event, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step == 2:
            stuck_on.append((threading.current_thread(), eng.loop._thread))
            if stuck_in == "native code":
                release.wait(30)
            else:
                deadline = time.monotonic() + 30
                while not release.is_set() and time.monotonic() < deadline:
                    pass
        return None

    eng = scripted_engine(mod_call_timeout_s=0.5)
    try:
        with eng.loop.admission_held():
            bad = eng.submit(input_ids=TOK.encode("Q:"), mods=[stuck])
            good = eng.submit(input_ids=TOK.encode("Q:"), mods=[lambda e, t=None: None])
        bad_result, good_result = bad.result(timeout=60), good.result(timeout=60)
        [(first_loop, loop_then)] = stuck_on
        assert first_loop is loop_then  # mods run on the loop's own thread: that thread is stuck
        assert bad_result.finish_reason is FinishReason.ERROR and "did not return within 0.5" in bad_result.error
        assert good_result.finish_reason is FinishReason.STOP and good_result.output_text == "hello world"
        assert eng.loop._thread is not first_loop and abandoned_mod_threads() == [first_loop]
        later = eng.generate(input_ids=TOK.encode("Q:"), mods=[lambda e, t=None: None])
        assert later.finish_reason is FinishReason.STOP and later.output_text == "hello world"
        release.set()
        first_loop.join(10)
        assert not first_loop.is_alive() and not abandoned_mod_threads()
        again = eng.generate(input_ids=TOK.encode("Q:"))
        assert again.output_text == "hello world"
    finally:
        release.set()
        eng.close()


def test_closing_the_engine_while_a_mod_is_stuck_returns_once_its_request_ended_not_with_the_stuck_call():
    """``close`` waits for this engine's requests; one whose mod is stuck ends when the thread that
    takes over at the limit fails it, and ``close`` returns then, the stuck call still running
    (waiting for that call would take until its mod gives up, 60 s here)."""
    release, entered = threading.Event(), threading.Event()
    stuck_in: list[threading.Thread] = []

    def stuck(event, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step == 1:
            stuck_in.append(threading.current_thread())
            entered.set()
            release.wait(60)
        return None

    eng = scripted_engine(mod_call_timeout_s=0.5)
    try:
        handle = eng.submit(input_ids=TOK.encode("Q:"), mods=[stuck])
        assert entered.wait(30)
        stuck_thread = stuck_in[0]
        eng.close()
        assert stuck_thread.is_alive(), "close waited for the stuck call, not for its request"
        result = handle.result(timeout=0)  # ended before close returned
        assert result.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED)
        # closing the loop itself (what an engine that owns its backend does) ends the loop thread
        # that took over; the stuck one runs on until its mod returns
        eng.loop.close()
        took_over = eng.loop._thread
        assert took_over is not stuck_thread and not took_over.is_alive() and stuck_thread.is_alive()
    finally:
        release.set()


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()], ids=lambda e: type(e).__name__)
def test_a_mod_raising_a_base_exception_fails_its_request_only(exc):
    def exits(event, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step == 1:
            raise exc
        return None

    bad, good = _pair(exits)
    assert bad.finish_reason is FinishReason.ERROR and type(exc).__name__ in bad.error
    assert bad.output_text == "h"
    assert good.finish_reason is FinishReason.STOP and good.output_text == "hello world"


def test_writing_into_the_event_logits_is_refused_and_changes_nothing():
    def writer(event, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step == 0:
            event.logits[0, TOK.encode("h")[0]] = -1e9  # would silently change the sample
        return None

    bad, good = _pair(writer)
    assert bad.output_text == good.output_text == "hello world"  # the write did not take effect
    call = next(c for c in bad.payload["mod_calls"] if c["exception_occurred"])
    assert "read-only" in call["exception_message"]


def test_a_forward_that_fails_for_one_request_ends_that_request_and_the_batch_goes_on():
    from engine import Engine
    from engine.config import RaylensConfig
    from tests.helpers import ScriptedBackend, build_generation_cfg

    class FailsForOne(ScriptedBackend):
        """Raises whenever a forward holds the row of request "bad" past its prompt."""

        def execute(self, batch):
            if any(r.request_id == "bad" and r.start > 0 for r in batch.rows):
                raise RuntimeError("device fault on request bad")
            return super().execute(batch)

    eng = Engine(RaylensConfig(generation=build_generation_cfg(temperature=0.0, max_tokens=32)),
                 backend=FailsForOne())
    try:
        bad = eng.submit(input_ids=TOK.encode("Q:"), request_id="bad")
        good = eng.submit(input_ids=TOK.encode("Q:"), request_id="good")
        bad_result, good_result = bad.result(timeout=60), good.result(timeout=60)
    finally:
        eng.close()
    assert bad_result.finish_reason is FinishReason.ERROR and "device fault on request bad" in bad_result.error
    assert good_result.finish_reason is FinishReason.STOP and good_result.output_text == "hello world"
