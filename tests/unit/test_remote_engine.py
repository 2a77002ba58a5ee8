"""The Serve replica's engine adapter without a cluster: the handle's stream, result, errors and
cancel; Ray's error wrapper removed; errors the actor raises survive pickling; mods sent as payloads."""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import pytest

from engine.core.stream import Erased, TokenEvent
from engine.errors import InvalidRequestError, TokenOutOfVocabularyError

pytestmark = pytest.mark.timeout(60)


def _result(**over):
    """A finished request as the actor sends it: a portable GenerationResult."""
    from engine.core.result import FinishReason, GenerationResult

    base = {"request_id": "r1", "output_text": "hi", "output_ids": [5, 6], "finish_reason": FinishReason.STOP,
            "events": [], "actions": [], "ignored_actions": [], "payload": {}, "metadata": {"steps": 2},
            "prompt_ids": [1, 2, 3], "sequence_ids": [5, 6, 0], "token_logprobs": None}
    return GenerationResult(**{**base, **over})


def _accepted(request_id="r1"):
    """The actor's first stream item: the request as the engine took it (portable)."""
    from engine.core.request import EngineRequest
    from engine.model.sampling import SamplingParams

    return EngineRequest(request_id=request_id, input_ids=(1, 2, 3), max_tokens=2, sampling=SamplingParams(0.0),
                         stop_ids=frozenset({0}), step_limit=72)


def _events():
    return [TokenEvent("r1", (5,), False, (-0.5,)), Erased("r1", 1), TokenEvent("r1", (6,), False, (None,))]


def test_the_handle_yields_the_events_then_gives_the_result():
    from engine.core.result import GenerationResult
    from pipelines.serve.remote_engine import RemoteHandle

    handle = RemoteHandle(_accepted(), iter([*_events(), {"result": _result()}]), lambda: None)
    assert handle.request.stop_ids == frozenset({0}) and handle.request_id == "r1"
    assert list(handle) == _events()
    assert list(handle) == []  # a second iteration ends at once
    result = handle.result(timeout=10)
    assert isinstance(result, GenerationResult)
    assert (result.prompt_ids, result.output_ids, result.output_text) == ([1, 2, 3], [5, 6], "hi")
    assert str(result.finish_reason) == "stop" and result.sequence_ids == [5, 6, 0]
    assert result.to_dict()["metadata"] == {"steps": 2}


def test_the_result_arrives_even_when_nobody_iterates():
    from pipelines.serve.remote_engine import RemoteHandle

    handle = RemoteHandle(_accepted(), iter([*_events(), {"result": _result(finish_reason="length")}]), lambda: None)
    assert str(handle.result(timeout=10).finish_reason) == "length"


def test_a_failure_mid_stream_ends_the_events_and_raises_from_result():
    from pipelines.serve.remote_engine import RemoteHandle

    def items():
        yield _events()[0]
        raise InvalidRequestError("`x` must be y, got z", parameter="x")

    handle = RemoteHandle(_accepted(), items(), lambda: None)
    assert list(handle) == _events()[:1]
    with pytest.raises(InvalidRequestError, match="must be y"):
        handle.result(timeout=10)


def test_a_stream_without_a_result_is_an_error_not_a_hang():
    from pipelines.serve.remote_engine import RemoteHandle

    handle = RemoteHandle(_accepted(), iter(_events()), lambda: None)
    with pytest.raises(RuntimeError, match="ended without a result"):
        handle.result(timeout=10)


def test_result_times_out_while_the_actor_still_runs():
    from pipelines.serve.remote_engine import RemoteHandle

    release = threading.Event()

    def items():
        release.wait(30)
        yield {"result": _result()}

    handle = RemoteHandle(_accepted(), items(), lambda: None)
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.05)
    release.set()
    assert handle.result(timeout=10).request_id == "r1"


def test_cancel_asks_the_actor_once_and_not_after_the_end():
    from pipelines.serve.remote_engine import RemoteHandle

    release, calls = threading.Event(), []

    def items():
        release.wait(30)
        yield {"result": _result(finish_reason="cancelled")}

    handle = RemoteHandle(_accepted(), items(), lambda: calls.append("cancel"))
    handle.cancel()
    handle.cancel()
    release.set()
    assert str(handle.result(timeout=10).finish_reason) == "cancelled"
    handle.cancel()
    assert calls == ["cancel"]
    done = RemoteHandle(_accepted("r2"), iter([{"result": _result(request_id="r2")}]), lambda: calls.append("late"))
    done.result(timeout=10)
    done.cancel()
    assert calls == ["cancel"]


def test_unwrap_returns_the_actors_own_typed_error():
    from ray.exceptions import RayTaskError

    from pipelines.serve.errors import ErrorCode, api_error_from
    from pipelines.serve.remote_engine import unwrap

    cause = TokenOutOfVocabularyError("`input_ids` must hold token ids in [0, 10), got [99]", parameter="input_ids")
    wrapped = RayTaskError("GeneratorActor.stream", "Traceback …", cause)
    assert unwrap(wrapped) is cause
    api = api_error_from(unwrap(wrapped))
    assert (api.code, api.parameter) == (ErrorCode.INVALID_TOKEN, "input_ids")
    other = TimeoutError("no answer")
    assert unwrap(other) is other


def test_errors_the_actor_raises_survive_pickling_with_their_fields():
    from actors.generator import portable_error
    from mods.loading import ModDirNotAllowedError, ModPayloadError

    plain = InvalidRequestError("`a` must be b", parameter="a", value=1)
    assert portable_error(plain) is plain
    strict = ModDirNotAllowedError("`mods[0].dir` must be under generation.mod_dirs", parameter="mods", value="/x")
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(strict))  # the reason portable_error exists
    twin = pickle.loads(pickle.dumps(portable_error(strict)))
    assert isinstance(twin, ModPayloadError) and str(twin) == str(strict)
    assert (twin.parameter, twin.value) == ("mods", "/x")


def test_registered_mods_reach_an_actor_backed_engine_as_payloads():
    from pipelines.serve.service import Service
    from pipelines.serve.settings import ServeSettings

    payload = {"language": "python", "source": "def mod(event, tokenizer):\n    return None\n", "entrypoint": "mod"}
    local = Service(SimpleNamespace(sae_features_inline=False), ServeSettings())
    remote = Service(SimpleNamespace(mods_as_payloads=True, sae_features_inline=False), ServeSettings())
    for service in (local, remote):
        service.mods.register("noop", payload, load_timeout_s=service.settings.mod_load_timeout_s)
    assert callable(local.mod("noop"))
    assert remote.mod("noop") == payload
    assert remote.sae_features_available() is False
    assert local.sae_features_available() is False


def _dies_after(events):
    """A replica's stream that yields ``events`` and then loses its actor."""
    from ray.exceptions import ActorDiedError

    def items():
        yield from events
        raise ActorDiedError()

    return items()


def test_a_replica_lost_before_the_first_token_reruns_the_request_elsewhere_unseen():
    from pipelines.serve.remote_engine import Attempt, RemoteHandle

    ended, reran = [], []

    def rerun(dead):
        reran.append(dead.replica)
        return Attempt("r1", "r1-retry1", iter([*_events(), {"result": _result(request_id="r1-retry1")}]),
                       lambda: None)

    handle = RemoteHandle(_accepted(), Attempt("r0", "r1", _dies_after([]), lambda: None), rerun=rerun,
                          on_end=lambda a, lost: ended.append((a.replica, lost)))
    assert list(handle) == _events()  # the reader never sees the lost attempt
    assert handle.result(timeout=10).request_id == "r1-retry1"
    assert reran == ["r0"] and handle.reruns == 1 and handle.replica == "r1"
    assert ended == [("r0", True), ("r1", False)]


def test_a_replica_lost_after_a_token_ends_the_stream_with_a_clean_retryable_error():
    from engine.errors import ReplicaLostError
    from pipelines.serve.errors import ErrorCode, api_error_from
    from pipelines.serve.remote_engine import Attempt, RemoteHandle

    reran = []
    handle = RemoteHandle(_accepted(), Attempt("r0", "r1", _dies_after(_events()[:1]), lambda: None),
                          rerun=lambda dead: reran.append(dead) or None)
    assert list(handle) == _events()[:1]
    with pytest.raises(ReplicaLostError, match="must stay up until its end") as caught:
        handle.result(timeout=10)
    assert reran == [] and caught.value.recoverable
    api = api_error_from(caught.value)
    assert api.code is ErrorCode.UNAVAILABLE and api.headers["Retry-After"]


def test_reruns_are_bounded_when_every_replica_keeps_dying():
    from engine.errors import ReplicaLostError
    from pipelines.serve.remote_engine import MAX_RERUNS, Attempt, RemoteHandle

    count = []

    def rerun(dead):
        count.append(dead.replica)
        return Attempt(f"r{len(count)}", "r1", _dies_after([]), lambda: None)

    handle = RemoteHandle(_accepted(), Attempt("r0", "r1", _dies_after([]), lambda: None), rerun=rerun)
    with pytest.raises(ReplicaLostError, match=f"before its first token, {MAX_RERUNS + 1} times"):
        handle.result(timeout=10)
    assert len(count) == MAX_RERUNS
