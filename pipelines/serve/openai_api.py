"""The OpenAI-compatible API: models, mod registration, and the routes of its other modules.

Behaviour follows the original engine's OpenAI server, so existing clients and mods work unchanged:

* ``model`` = ``<model id>/<mod name>`` runs the mod registered under that name with
  ``POST /v1/mods`` (payload ``{"name", "language": "python", "entrypoint", "source"}`` or the
  other forms the mod loader accepts); answer ``{"name", "replaced", "description"}``.
* Chat completions (:mod:`.openai_chat`): a mod's ForceOutput, ToolCalls, EmitError and Backtrack
  become content, ``tool_calls``, an OpenAI error and ``delta.removed``.
* Legacy completions (:mod:`.openai_completions`): text or token-id prompts, ``echo`` with the
  prompt's log-probs (a scoring forward), ``max_tokens: 0`` to score only.
* Embeddings (:mod:`.openai_embeddings`): ``Engine.embed`` over HTTP.
* ``n`` choices run as one seeded batch (:mod:`.openai_choices`); the ``raylens`` body extension
  (:mod:`.openai_raylens`) adds steering, SAE features per token and named captures.

Deliberate differences: an unknown model or mod name is a 404 rather than being ignored; tool
calls also stream (as one ``delta.tool_calls`` chunk at the end); ``usage`` counts real prompt
tokens; parameters the engine cannot honour are refused with 400 instead of being dropped.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request

from . import openai_chat, openai_completions, openai_embeddings
from .errors import ApiError, ErrorCode, validation_error
from .openai_common import resolve_model, service_of
from .openai_models import ERRORS, ChatCompletionRequest, ModPayload

__all__ = ["router", "routers", "ChatCompletionRequest", "resolve_model"]

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
def list_models(request: Request) -> dict[str, Any]:
    service = service_of(request)
    ids = [service.model_id] + [f"{service.model_id}/{name}" for name in service.mods.names()]
    return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "raylens"} for i in ids]}


@router.post("/mods", responses=ERRORS)
def register_mod(request: Request, body: dict[str, Any] = Body(...)) -> dict[str, Any]:
    service = service_of(request)
    if not service.settings.allow_mod_registration:
        raise ApiError(ErrorCode.FORBIDDEN, "mod registration must be enabled to upload mods, got it off: start the "
                                            "server with --allow-mod-registration (mods run arbitrary code).")
    from pydantic import ValidationError

    from mods.loading import ModPayloadError

    try:
        payload = ModPayload.model_validate(body)
    except ValidationError as err:
        raise validation_error(err.errors()) from None

    try:
        replaced = service.mods.register(payload.name, body, load_timeout_s=service.settings.mod_load_timeout_s)
    except ModPayloadError as err:
        raise ApiError(ErrorCode.INVALID_REQUEST, str(err), "source") from err
    return {"name": payload.name, "replaced": replaced, "description": payload.description}


#: every OpenAI router, for the app to include
routers = (router, openai_chat.router, openai_completions.router, openai_embeddings.router)
