"""``POST /v1/embeddings``: ``Engine.embed`` over HTTP.

Each input is embedded as :meth:`engine.Engine.embed` embeds a text: tokenised as plain text (no
chat template, no BOS), one fresh forward, the final normed hidden states averaged over its
tokens; a list of token ids is taken as such a text's ids. The vectors are the model's own (not
scaled to unit length); ``dimensions`` cannot shorten them, so it must be null or the model's
hidden size. ``encoding_format: "base64"`` sends each vector as its little-endian float32 bytes in
base64, as OpenAI does (what the ``openai`` client asks for by default).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from engine.errors import RaylensError
from engine.model.embeddings import tokenize_texts

from .bridge import run_job
from .errors import ApiError, ErrorCode, api_error_from
from .openai_common import service_of
from .openai_models import ERRORS, MAX_EMBEDDING_INPUTS, EmbeddingRequest
from .openai_prompts import split_inputs
from .service import Service

__all__ = ["router", "embedding_inputs"]

router = APIRouter(prefix="/v1", tags=["openai"])

_SHAPE = "a non-empty string, a list of them, a non-empty list of token ids, or a list of them"


def embedding_inputs(service: Service, raw: Any) -> list[list[int]]:
    """Each input's token ids (texts tokenised as ``Engine.embed`` tokenises them); a 400 naming
    the input that is empty, out of the vocabulary or longer than the context."""
    items, names = split_inputs(raw, "input", MAX_EMBEDDING_INPUTS, _SHAPE)
    limit = service.info.max_context
    out = []
    for item, name in zip(items, names):
        if isinstance(item, str):
            try:
                (ids,) = tokenize_texts(service.tokenizer, [item], limit)
            except RaylensError as err:  # its message names `texts[0]`: this route calls it `name`
                coded = api_error_from(err)
                raise ApiError(coded.code, coded.message.replace("`texts[0]`", f"`{name}`"), name) from None
        else:
            service.check_token_ids(item, name)
            if len(item) > limit:
                raise ApiError(ErrorCode.CONTEXT_TOO_LONG, f"`{name}` must fit the model's context of {limit} "
                                                           f"tokens, got {len(item)}; shorten it.", name)
            ids = list(item)
        out.append(ids)
    return out


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(v) for v in vector]


@router.post("/embeddings", responses=ERRORS)
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    service = service_of(request)
    if body.model != service.model_id:
        modded = body.model.startswith(service.model_id + "/")
        raise ApiError(ErrorCode.INVALID_REQUEST if modded else ErrorCode.NOT_FOUND,
                       f"`model` must be {service.model_id!r} on /v1/embeddings (mods change generation, not "
                       f"embeddings), got {body.model!r}.", "model")
    width = int(service.info.hidden_size)
    if body.dimensions is not None and body.dimensions != width:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`dimensions` must be null or the model's hidden size {width} "
                                                  f"(vectors are not shortened), got {body.dimensions}.", "dimensions")
    ids = embedding_inputs(service, body.input)
    vectors = await run_job(service.engine, "embed_tokens", ids, request=request,  # (len(ids), width) float32
                            timeout_s=service.settings.request_timeout_s)
    tokens = sum(len(i) for i in ids)
    return {"object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
