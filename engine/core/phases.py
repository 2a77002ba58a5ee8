"""A step's phases across its requests: each request's machine runs a phase (Prefilled, Sampled,
Added, and the Added of a step that forces tokens instead of sampling) as a generator that yields
the calls its mods are to get for an event and is sent them back made; :func:`drive` runs the
phases of every request of the step together, a round at a time (the ForwardPass round needs no
phase: the step loop gathers every request's calls and hands each its own back,
:meth:`~engine.core.machine.RequestMachine.forward_calls`). Each round's calls go to whoever
drives it in one batch (the step loop makes them on its own thread, :mod:`engine.core.loop_calls`).
A fault in one request's part of a step ends that request alone (:func:`run_guarded`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence, TypeVar, TypeVarTuple, Unpack

from engine.errors import GrammarError
from mods.manager import ModCall, ModManager, PendingCall

if TYPE_CHECKING:
    from engine.core.machine import RequestMachine

__all__ = ["Phase", "Round", "Driven", "drive", "run_guarded"]

log = logging.getLogger("raylens.step_loop")

T = TypeVar("T")
Args = TypeVarTuple("Args")
Phase = Generator[list[PendingCall], list[ModCall], T]  # yields calls to make, is sent what they did, returns T
Round = list[tuple[ModManager, list[PendingCall]]]  # a round's calls, each request's with its manager
Driven = Generator[Round, None, list[Any]]  # yields rounds to make (and is resumed once they are made)


def drive(phases: Sequence[tuple["RequestMachine", Phase[Any]]]) -> Driven:
    """Run each machine's phase to its end, a round at a time: each round yields the calls every
    phase waits on, to be made together by the driver (which resumes this generator once they are
    made; it may be another thread than the one that started it). Returns each phase's result; a
    phase that raises fails its request alone (its result is None)."""
    results: list[Any] = [None] * len(phases)
    waiting: list[tuple[int, list[PendingCall]]] = []

    def advance(i: int, value: Any) -> None:
        machine, phase = phases[i]
        try:
            pending = phase.send(value)
        except StopIteration as done:
            results[i] = done.value
            return
        except Exception as err:
            _fault(machine, err)
            return
        waiting.append((i, pending))

    for i in range(len(phases)):
        advance(i, None)
    while waiting:
        now, waiting[:] = list(waiting), []
        batch = [(phases[i][0].manager, pending) for i, pending in now]
        yield batch
        # silent Noops (most calls) come back without a record: there is nothing to apply or record for one
        for (i, _), (manager, pending) in zip(now, batch):
            advance(i, manager.records(pending, keep_silent=False))
    return results


def run_guarded(machine: "RequestMachine", fn: Callable[[Unpack[Args]], T], *args: Unpack[Args]) -> T | None:
    """Run ``fn(*args)``, one request's part of a step; a fault ends that request alone (None is
    returned)."""
    try:
        return fn(*args)
    except Exception as err:
        _fault(machine, err)
        return None


def _fault(machine: "RequestMachine", err: Exception) -> None:
    """A fault in one request's part of a step ends it alone; a grammar's names the request field
    it came from (``response_format``, ``tool_choice``)."""
    log.warning("request %s failed: %s: %s", machine.request_id, type(err).__name__, err)
    machine.fail(f"{type(err).__name__}: {err}", err.parameter if isinstance(err, GrammarError) else None)
