"""A step's phases across its requests: each request's machine runs a phase (Prefilled, ForwardPass,
Sampled, Added) as a generator that yields the calls its mods are to get for an event and is sent
them back made; :func:`drive` runs the phases of every request of the step together, so that each
round's calls go to the mods in one hand-off (:func:`mods.manager.run_batch`: one thread switch per
round, not one per call). A fault in one request's part of a step ends that request alone
(:func:`run_guarded`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence, TypeVar, TypeVarTuple, Unpack

from engine.errors import GrammarError
from mods.manager import CallRunner, ModCall, PendingCall, run_batch

if TYPE_CHECKING:
    from engine.core.machine import RequestMachine

__all__ = ["Phase", "drive", "run_guarded"]

log = logging.getLogger("raylens.step_loop")

T = TypeVar("T")
Args = TypeVarTuple("Args")
Phase = Generator[list[PendingCall], list[ModCall], T]  # yields calls to make, is sent what they did, returns T


def drive(phases: Sequence[tuple["RequestMachine", Phase[Any]]], runner: CallRunner) -> list[Any]:
    """Run each machine's phase to its end; every round, the calls all of them wait on are made
    together (one thread hand-off for the round, not one per call). A phase that raises fails its
    request alone (its result is None)."""
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
        # silent Noops (most calls) come back without a record: there is nothing to apply or record for one
        calls = run_batch([(phases[i][0].manager, pending) for i, pending in now], runner, keep_silent=False)
        for (i, _), made in zip(now, calls):
            advance(i, made)
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
