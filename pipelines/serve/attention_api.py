"""The attention-streaming API: model info, tokenize, detokenize, generate, and a WebSocket stream.

The client owns the conversation as token ids; the server is stateless. For every generated token
the stream sends ``{"type": "token", "request_id", "token": {token_id, text, logprob,
top_logprobs}, "attention": {...}}``, then ``{"type": "done", "finish_reason", "total_tokens",
"generation_time_ms"}``; failures send ``{"type": "error", "error", "error_code"}``. The attention
of a token is the row of every layer and head from the newest token in context (the one whose
forward produced this token) to every context position: shape ``[num_layers, num_heads,
context_length]``, ``attention[..., i]`` belonging to ``input_ids[i]`` for ``i`` below the prompt
length and to the earlier generated tokens after it. See :mod:`.codec` for the encodings.

``POST /api/v1/generate`` runs the same producer as the WebSocket and collects it, so both
answer the same tokens for the same request. Stop tokens end generation and are not sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncGenerator, Callable, Literal

from fastapi import APIRouter, Request, WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.core.inputs import GenerationRequest
from engine.errors import InvalidRequestError

from .bridge import Stream, open_stream
from .codec import AttentionEncoding, encode_attention
from .engine_stream import Erased, TokenEvent
from .errors import ApiError, ErrorCode, api_error_from, result_error, validation_error
from .service import Service

__all__ = ["router", "GenerateRequest"]

router = APIRouter(prefix="/api/v1", tags=["attention"])

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class AttentionError(BaseModel):
    type: Literal["error"] = "error"
    error: str
    error_code: str
    parameter: str | None = None


_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": AttentionError} for code in (400, 401, 413, 501, 503, 504)}


class ModelInfoResponse(BaseModel):
    model_name: str
    architecture: str | None
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    max_position_embeddings: int
    rope_theta: float | None
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: list[int]
    special_tokens: dict[str, Any]
    chat_template: str | None
    torch_dtype: str
    context_length: int
    device: str
    sae_features_available: bool


class TokenizeRequest(BaseModel):
    """``text`` as is, or ``messages`` (``[{role, content}]``) through the model's chat template
    with the assistant's generation prompt appended: exactly one of them."""

    model_config = _STRICT
    text: str | None = None
    messages: list[dict[str, str]] | None = Field(None, min_length=1)
    add_special_tokens: bool = False


class TokenOut(BaseModel):
    token_id: int
    text: str


class TokenizeResponse(BaseModel):
    tokens: list[TokenOut]
    token_ids: list[int]
    token_count: int


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    token_ids: list[int]


class DetokenizeResponse(BaseModel):
    text: str


class GenerateRequest(BaseModel):
    """One generation. Unset sampling fields take the server config's defaults."""

    model_config = _STRICT
    type: Literal["generate"] = "generate"
    request_id: str | None = Field(None, min_length=1, max_length=128)
    input_ids: list[int] = Field(min_length=1)
    # sampling values are checked by the engine's one request type, as from every other door
    max_new_tokens: int | None = Field(None, strict=True, description=">= 1 (and at most the server's serve.max_new_tokens)")
    temperature: float | None = Field(None, le=100, description=">= 0; 0 is greedy")
    top_p: float | None = Field(None, description="in (0, 1]")
    top_k: int | None = Field(None, strict=True, description=">= 0; 0 disables top-k")
    repetition_penalty: float = Field(1.0, le=100, description="> 0; 1 is off")
    stop_tokens: list[int] = Field(default_factory=list)
    banned_tokens: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(None, strict=True, description="in [0, 2**64 - 1]")
    return_attention: bool = False
    attention_format: Literal["per_layer", "aggregated"] = "per_layer"
    aggregation_mode: Literal["mean", "max"] = "mean"
    attention_dtype: Literal["float32", "float16"] = "float32"
    attention_compression: Literal["none", "gzip"] = "none"
    binary: bool = Field(False, description="WebSocket only: attention bytes in a binary frame after each token message")
    top_logprobs: int = Field(0, strict=True, description="in [0, 20]")
    sae_features: bool = False


class GeneratedToken(BaseModel):
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    request_id: str
    generated_tokens: list[GeneratedToken]
    generated_text: str
    finish_reason: str
    total_tokens: int
    generation_time_ms: float
    attention_data: list[dict[str, Any]] | None = None


# ------------------------------------------------------------------------------------ routes


def _service(request: Request | WebSocket) -> Service:
    return request.app.state.service


@router.get("/model/info", response_model=ModelInfoResponse)
def model_info(request: Request) -> dict[str, Any]:
    service = _service(request)
    info, tok = service.info, service.tokenizer
    config = getattr(getattr(service.engine.backend, "model", None), "config", None)
    specials = {k: v for k, v in {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                                  "unk_token": getattr(tok, "unk_token", None)}.items() if v is not None}
    for name in ("<|im_start|>", "<|im_end|>"):
        token_id = tok.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != tok.unk_token_id:
            specials[name.strip("<|>") + "_id"] = token_id
    rope = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return {
        "model_name": info.model_id,
        "architecture": (getattr(config, "architectures", None) or [None])[0],
        "vocab_size": info.vocab_size,
        "num_layers": info.num_layers,
        "num_attention_heads": info.num_attention_heads,
        "num_key_value_heads": info.num_key_value_heads,
        "hidden_size": info.hidden_size,
        "max_position_embeddings": info.max_context,
        "rope_theta": float(rope) if rope is not None else None,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": info.eos_token_ids[0] if info.eos_token_ids else None,
        "eos_token_ids": list(info.eos_token_ids),
        "special_tokens": specials,
        "chat_template": getattr(tok, "chat_template", None),
        "torch_dtype": info.dtype,
        "context_length": info.max_context,
        "device": info.device,
        "sae_features_available": service.sae_features_available(),
    }


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    service = _service(request)
    if (body.text is None) == (body.messages is None):
        raise ApiError(ErrorCode.INVALID_REQUEST, "exactly one of `text` and `messages` must be given, got "
                                                  f"{'both' if body.text is not None else 'neither'}.", "text")
    if body.messages is not None:
        try:
            ids = service.engine.encode(messages=body.messages)
        except Exception as err:
            raise api_error_from(err) from err
    else:
        ids = [int(t) for t in service.tokenizer.encode(body.text, add_special_tokens=body.add_special_tokens)]
    return {"tokens": [{"token_id": t, "text": service.token_text(t)} for t in ids], "token_ids": ids,
            "token_count": len(ids)}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    service = _service(request)
    service.check_token_ids(body.token_ids, "token_ids")
    return {"text": service.tokenizer.decode(body.token_ids, skip_special_tokens=False)}


@router.post("/generate", response_model=GenerateResponse, responses=_ERRORS)
async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
    if body.binary:
        raise ApiError(ErrorCode.INVALID_REQUEST, "`binary` must be false on POST /api/v1/generate, got true; "
                                                  "binary frames exist only on the WebSocket stream.", "binary")
    service = _service(request)
    tokens: list[dict[str, Any]] = []
    attention: list[dict[str, Any]] = []
    done: dict[str, Any] = {}
    async for message, _ in generation_messages(service, body):
        if message["type"] == "token":
            tokens.append(message["token"])
            if body.return_attention:
                attention.append({"token_id": message["token"]["token_id"], "text": message["token"]["text"],
                                  "attention": message.get("attention")})
        elif message["type"] == "erased":
            del tokens[len(tokens) - message["n"]:]
            if body.return_attention:
                del attention[max(0, len(attention) - message["n"]):]
        else:
            done = message
    ids = [t["token_id"] for t in tokens]
    return {"request_id": done["request_id"], "generated_tokens": tokens,
            "generated_text": service.tokenizer.decode(ids, skip_special_tokens=False),
            "finish_reason": done["finish_reason"], "total_tokens": done["total_tokens"],
            "generation_time_ms": done["generation_time_ms"],
            "attention_data": attention if body.return_attention else None}


# -------------------------------------------------------------------------------- producer


# the attention API's names for request fields the engine's request calls otherwise
_FIELD_NAMES = {"max_tokens": "max_new_tokens", "attention": "return_attention"}


def _request(service: Service, body: GenerateRequest) -> GenerationRequest:
    """The engine's request for ``body``; the engine checks every value (vocabulary, context,
    ranges, the server's ``max_new_tokens``) by the same rules as every other door. What only
    this server decides (whether SAE features can be streamed) is checked here."""
    if body.sae_features and not service.sae_features_available():
        raise ApiError(ErrorCode.FEATURES_UNAVAILABLE, "`sae_features` must be false on this server, got true: "
                                                       "its engine does not encode SAE features inline (start "
                                                       "it with sae.enabled and sae.mode: inline). Ask without "
                                                       "them (see GET /api/v1/model/info, "
                                                       "sae_features_available).", "sae_features")
    try:
        return GenerationRequest(
            input_ids=tuple(body.input_ids), max_tokens=body.max_new_tokens, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop_tokens=tuple(body.stop_tokens) or None,
            ignore_eos=body.ignore_eos or None, request_id=body.request_id, banned_tokens=tuple(body.banned_tokens),
            repetition_penalty=body.repetition_penalty if body.repetition_penalty != 1.0 else None,
            top_logprobs=body.top_logprobs, attention="all" if body.return_attention else None,
            max_tokens_cap=service.settings.max_new_tokens)
    except InvalidRequestError as err:
        name = _FIELD_NAMES.get(err.parameter or "", err.parameter)
        message = str(err).replace(f"`{err.parameter}`", f"`{name}`") if name != err.parameter else str(err)
        raise api_error_from(type(err)(message, parameter=name, value=err.value)) from None


_FINISH = {"stop": "stop_token", "length": "length", "tool_calls": "tool_calls", "cancelled": "cancelled"}


async def generation_messages(service: Service, body: GenerateRequest, *,
                              on_start: Callable[[Stream], None] | None = None,
                              ) -> AsyncGenerator[tuple[dict[str, Any], bytes | None], None]:
    """Token messages (each with the binary attention frame to send after it, if any), then done.

    Raises :class:`ApiError` for bad input (before anything is yielded) and for failures after.
    ``on_start`` receives the running stream (so a WebSocket can cancel it when its client leaves).
    """
    started = time.perf_counter()
    stream = await open_stream(service.engine, _request(service, body), timeout_s=service.settings.request_timeout_s)
    if on_start is not None:
        on_start(stream)
    request_id = stream.handle.request_id
    stop = stream.handle.request.stop_ids
    enc = AttentionEncoding(body.attention_format, body.aggregation_mode, body.attention_dtype,
                            body.attention_compression, body.binary)
    sent = 0
    try:
        async for event in stream:
            if isinstance(event, Erased):
                n = min(event.n, sent)
                sent -= n
                if n:
                    yield {"type": "erased", "request_id": request_id, "n": n}, None
                continue
            if not isinstance(event, TokenEvent):
                continue
            for message, frame in _token_messages(service, body, enc, request_id, event, stop):
                sent += 1
                yield message, frame
        result = await stream.result()
    finally:
        stream.cancel()
    finish = str(result.finish_reason)
    if finish == "error":
        raise result_error(result)
    yield {"type": "done", "request_id": request_id, "finish_reason": _FINISH.get(finish, finish),
           "total_tokens": sent, "generation_time_ms": round((time.perf_counter() - started) * 1000.0, 3)}, None


def _token_messages(service: Service, body: GenerateRequest, enc: AttentionEncoding, request_id: str,
                    event: Any, stop: frozenset[int]):
    """One message per token of the event; the attention (of the forward that produced the event)
    rides on its first token."""
    for i, token_id in enumerate(event.token_ids):
        if token_id in stop:
            continue
        token: dict[str, Any] = {"token_id": int(token_id), "text": service.token_text(token_id),
                                 "logprob": event.logprobs[i] if i < len(event.logprobs) else None,
                                 "top_logprobs": []}
        if event.top_logprobs is not None and i < len(event.top_logprobs):
            token["top_logprobs"] = [{"token_id": int(t), "text": service.token_text(t), "logprob": float(lp)}
                                     for t, lp in event.top_logprobs[i]]
        message: dict[str, Any] = {"type": "token", "request_id": request_id, "token": token}
        frame = None
        if body.return_attention and i == 0 and event.attention is not None:
            message["attention"], frame = encode_attention(event.attention, enc)
        features = getattr(event, "sae_features", None)
        if body.sae_features and i == 0 and features is not None:  # the sampled token's features
            message["sae_features"] = {"release": features.release, "layer": int(features.layer),
                                       "ids": [int(f) for f in features.ids],
                                       "values": [round(float(v), 5) for v in features.values]}
        yield message, frame


# ------------------------------------------------------------------------------- websocket


class _Connection:
    """One WebSocket: a reader task fills an inbox (and cancels the running generation when the
    client leaves or sends ``{"type": "cancel"}``); the handler answers requests one at a time."""

    def __init__(self, ws: WebSocket, service: Service) -> None:
        self.ws, self.service = ws, service
        self.inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.current: Stream | None = None

    async def read(self) -> None:
        limit = self.service.settings.max_message_bytes
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                raw = msg.get("text") if msg.get("text") is not None else (msg.get("bytes") or b"")
                size = len(raw.encode("utf-8")) if isinstance(raw, str) else len(raw)
                if size > limit:
                    await self.inbox.put(("too_large", size))
                    break
                try:
                    data = json.loads(raw)
                except ValueError:
                    data = None
                if isinstance(data, dict) and data.get("type") == "cancel":
                    if self.current is not None:
                        self.current.cancel()
                    continue
                await self.inbox.put(("message", data))
        finally:
            if self.current is not None:  # the client left: free the request's slot now
                self.current.cancel()
            await self.inbox.put(("closed", None))

    def started(self, stream: Stream) -> None:
        self.current = stream

    async def send(self, message: dict[str, Any], frame: bytes | None = None) -> None:
        await self.ws.send_text(json.dumps(message))
        if frame is not None:
            await self.ws.send_bytes(frame)


@router.websocket("/generate/stream")
async def generate_stream(ws: WebSocket) -> None:
    service = _service(ws)
    if not service.claim_ws():
        await ws.accept()
        error = ApiError(ErrorCode.TOO_MANY_CONNECTIONS, f"open WebSocket connections must be at most "
                                                         f"{service.settings.max_ws_connections}, got one more; "
                                                         f"retry after another closes.")
        await ws.send_text(json.dumps(error.attention_body()))
        await ws.close(code=1013)
        return
    conn = _Connection(ws, service)
    reader: asyncio.Task[None] | None = None
    try:
        await ws.accept()
        reader = asyncio.create_task(conn.read())
        while True:
            kind, data = await conn.inbox.get()
            if kind == "closed":
                return
            if kind == "too_large":
                error = ApiError(ErrorCode.MESSAGE_TOO_LARGE, f"a message must be at most "
                                                              f"{service.settings.max_message_bytes} bytes, got {data}.")
                await conn.send(error.attention_body())
                await ws.close(code=1009)
                return
            await _serve_one(conn, data)
    except Exception as err:  # the client left while we were sending: nothing to report to
        from starlette.websockets import WebSocketDisconnect

        if not isinstance(err, WebSocketDisconnect):
            raise
    finally:
        if reader is not None:
            reader.cancel()
        service.release_ws()


async def _serve_one(conn: _Connection, data: Any) -> None:
    request_id = data.get("request_id") if isinstance(data, dict) and isinstance(data.get("request_id"), str) else None
    try:
        body = GenerateRequest.model_validate(data)
    except ValidationError as err:
        await conn.send(validation_error(err.errors()).attention_body(request_id))
        return
    messages = generation_messages(conn.service, body, on_start=conn.started)
    try:
        async for message, frame in messages:
            await conn.send(message, frame)
    except ApiError as err:
        await conn.send(err.attention_body(request_id))
    finally:
        conn.current = None
        await messages.aclose()  # cancels the engine request if it is still running
