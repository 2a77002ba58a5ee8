"""The output side of a request, off the step thread: once a request leaves the batch, a finisher
thread decodes its text, builds and delivers its ingest payload (or, when payloads go nowhere,
leaves it to be built if the result's ``payload`` is read), and assembles its
:class:`~engine.core.result.GenerationResult` and requests-table row. Nothing here runs while the
batch steps, so a slow tokenizer or ingest backend never stalls other requests."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

from engine.core.request import RequestState
from engine.core.result import DeferredPayload, FinishReason, GenerationResult
from engine.model.sampling import SamplingParams
from engine.services.store import ActivationStore, RequestRecord

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """Builds results for one engine: its tokenizer and model, its ingest client and store (either
    may be None), and ``sae_metadata`` — what the engine's SAE reports for a result, if any."""

    def __init__(self, *, tokenizer: Any, info: Any, backend_type: str, layer: int, ingest: Any,
                 store: ActivationStore | None, sae_metadata: Callable[[], dict[str, Any] | None]) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.backend_type = backend_type
        self.layer = layer
        self.ingest = ingest
        self.store = store
        self.sae_metadata = sae_metadata

    def result(self, state: RequestState, elapsed_ms: float,
               steers: list[dict[str, Any]] | None = None) -> GenerationResult:
        """The finished request's result: the output with its stop tokens left out (and nothing when
        it ended in tool calls), the ingest payload built and delivered (built on first read when
        there is no ingest backend), the store row written."""
        tokens = state.forced_output if state.forced_output is not None else state.generated
        stop = state.request.stop_ids
        output_ids = [] if state.finish is FinishReason.TOOL_CALLS else [t for t in tokens if t not in stop]
        output_text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        deferred = DeferredPayload(functools.partial(
            state.payload.build, final_ids=output_ids, final_text=output_text,  # type: ignore[attr-defined]
            finish_reason=str(state.finish), prompt_tokens=len(state.prompt_ids),
            extra={"tool_calls": state.tool_calls, "error": state.error}, completed_at=time.time()))
        metadata = self._metadata(state, elapsed_ms)
        given = state.request.caller_request_id
        if given is not None and given != state.request_id:
            metadata["given_request_id"] = given  # a reused id ran under a fresh one
        if steers:
            metadata["steers"] = list(steers)  # also in the requests table; never an ingest action
        payload: dict[str, Any] | DeferredPayload = deferred
        if self.ingest is not None:  # sent now; otherwise built only if the result's payload is read
            payload = deferred.get()
            delivery = self.ingest.send(payload)
            metadata["ingest"] = {"delivered": delivery.delivered, "spooled_to": delivery.spooled_to}
        sae = self.sae_metadata()
        if sae is not None:
            metadata["sae"] = sae
        result = GenerationResult(
            request_id=state.request_id, prompt_ids=list(state.prompt_ids), output_ids=output_ids,
            output_text=output_text, finish_reason=state.finish, events=state.events,  # type: ignore[arg-type]
            actions=state.actions, ignored_actions=state.ignored,
            payload=payload,  # type: ignore[arg-type]  # a DeferredPayload: built on its first read
            metadata=metadata,
            tool_calls=state.tool_calls, error=state.error, error_parameter=state.error_parameter,
            sequence_ids=list(state.generated),
            token_logprobs=list(state.logprobs) if state.request.logprobs >= 0 else None,
        )
        if self.store is not None:
            self.store.record_request(self.request_record(result, state.request.sampling))
        return result

    def _metadata(self, state: RequestState, elapsed_ms: float) -> dict[str, Any]:
        decode_ms = max(elapsed_ms - state.prefill_ms, 1e-9)
        return {
            "request_id": state.request_id,
            "backend": self.backend_type,
            "model_id": self.info.model_id,
            "device": self.info.device,
            "dtype": self.info.dtype,
            "layer": self.layer,
            "prompt_tokens": len(state.prompt_ids),
            "generated_tokens": len(state.generated),
            "max_tokens": state.max_tokens,
            "steps": state.step,
            "prefill_ms": round(state.prefill_ms, 3),
            "total_ms": round(elapsed_ms, 3),
            "tokens_per_s": round(len(state.generated) / (decode_ms / 1000.0), 3),
        }

    def request_record(self, result: GenerationResult, sampling: SamplingParams | None = None) -> RequestRecord:
        """The requests-table row of a result: readable without the ingest backend."""
        return RequestRecord(
            request_id=result.request_id, model_id=self.info.model_id,
            prompt_text=self.tokenizer.decode(result.prompt_ids), output_text=result.output_text,
            prompt_ids=list(result.prompt_ids), output_ids=list(result.sequence_ids),
            finish_reason=str(result.finish_reason),
            config={"sampling": dataclasses.asdict(sampling) if sampling else None,
                    "max_tokens": result.metadata["max_tokens"], "layer": self.layer,
                    "sae": result.metadata.get("sae"), "steers": result.metadata.get("steers")})
