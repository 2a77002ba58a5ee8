"""The quarantine of requests that were running alone on a generator when its process died
(pipelines/serve/quarantine.py), without Ray: generators are plain objects with an actor id, the
clock is the test's."""

from __future__ import annotations

import dataclasses

import pytest

from engine.core.inputs import GenerationRequest
from engine.errors import QuarantinedRequestError
from pipelines.serve.quarantine import CrashQuarantine, fingerprint


class Generator:
    """What the quarantine reads of an actor handle: its ``_actor_id``."""

    def __init__(self, name: str) -> None:
        self._actor_id = bytes(name, "ascii")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


REQUEST = GenerationRequest(prompt="crash me", response_format={"type": "grammar", "grammar": 'start: "a"'},
                            request_id="first")


def test_a_request_alone_when_its_generator_died_is_refused_when_sent_again_and_others_are_not():
    clock, gen = Clock(), Generator("g1")
    quarantine = CrashQuarantine(ttl_s=60, clock=clock)
    quarantine.check(REQUEST)  # positive control: nothing quarantined yet
    assert quarantine.end(quarantine.begin(gen, REQUEST), lost=True) is True
    retry = dataclasses.replace(REQUEST, request_id="a-retry")  # a retry gets a new id: still the same work
    assert fingerprint(retry) == fingerprint(REQUEST)
    with pytest.raises(QuarantinedRequestError, match=r"refused for 60 more s") as err:
        quarantine.check(retry)
    assert isinstance(err.value, ValueError) and quarantine.quarantined == 1
    quarantine.check(dataclasses.replace(REQUEST, seed=7))  # different work passes
    quarantine.check(dataclasses.replace(REQUEST, prompt="crash me!"))
    clock.now += 61  # the entry ends
    quarantine.check(retry)
    assert quarantine.quarantined == 0


def test_requests_that_died_together_are_not_blamed_whatever_order_their_streams_notice_it():
    gen, quarantine = Generator("g1"), CrashQuarantine()
    requests = [dataclasses.replace(REQUEST, seed=i) for i in range(3)]
    running = [quarantine.begin(gen, r) for r in requests]
    assert [quarantine.end(r, lost=True) for r in running] == [False, False, False]
    for request in requests:
        quarantine.check(request)
    # the generator restarted (same actor id), answered, and a request then dies alone on it: it is blamed
    assert quarantine.is_down(gen)
    quarantine.answered(gen)
    assert quarantine.end(quarantine.begin(gen, requests[0]), lost=True) is True
    with pytest.raises(QuarantinedRequestError):
        quarantine.check(requests[0])


def test_a_request_sent_to_a_generator_already_dead_is_not_blamed_until_it_answers_again():
    gen, quarantine = Generator("g1"), CrashQuarantine()
    assert quarantine.end(quarantine.begin(gen, REQUEST), lost=True) is True  # the crash: noticed, blamed
    assert quarantine.is_down(gen)
    later = dataclasses.replace(REQUEST, seed=1)
    assert quarantine.end(quarantine.begin(gen, later), lost=True) is False  # sent while down: not its doing
    quarantine.check(later)
    quarantine.answered(gen)  # restarted
    assert not quarantine.is_down(gen)
    assert quarantine.end(quarantine.begin(gen, later), lost=True) is True


def test_a_request_that_ends_normally_or_on_another_generator_is_not_blamed():
    quarantine = CrashQuarantine()
    one, other = Generator("g1"), Generator("g2")
    finished = quarantine.begin(one, REQUEST)
    assert quarantine.end(finished, lost=False) is False
    neighbour = quarantine.begin(other, dataclasses.replace(REQUEST, seed=1))
    lone = quarantine.begin(one, dataclasses.replace(REQUEST, seed=2))
    assert quarantine.end(lone, lost=True) is True  # alone on its generator; the other generator's does not count
    assert quarantine.end(neighbour, lost=False) is False
    quarantine.check(REQUEST)
    quarantine.check(dataclasses.replace(REQUEST, seed=1))


def test_the_quarantine_keeps_at_most_its_capacity_oldest_out_first():
    quarantine = CrashQuarantine(capacity=2)
    requests = [dataclasses.replace(REQUEST, seed=i) for i in range(3)]
    for i, request in enumerate(requests):
        assert quarantine.end(quarantine.begin(Generator(f"g{i}"), request), lost=True)
    assert quarantine.quarantined == 2
    quarantine.check(requests[0])
    for request in requests[1:]:
        with pytest.raises(QuarantinedRequestError):
            quarantine.check(request)
