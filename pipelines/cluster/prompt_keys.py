"""What a caller hands the replica router about a request: its prompt's leading block hashes, and
which requests must share a replica.

The keys are the ones the replicas' KV managers cache blocks under
(:func:`engine.cache_events.leading_block_keys` over the prompt's token ids), so a request's
prompt is tokenized here exactly as a replica does it: through the engine's own
:class:`~engine.core.input_processor.InputProcessor` (chat template, tools), over this process's
copy of the tokenizer. A request that cannot be tokenized here is routed without keys (by load);
the replica then refuses it with its own typed error.

``same_replica()`` marks the requests submitted inside it (in this context, ``asyncio.to_thread``
included) as one group: the ``n`` choices of one OpenAI request run on one replica, as rows of one
batch (``pipelines/serve/openai_choices.py``).

:func:`prompt_keys_for` builds the keys for a caller without a tokenizer of its own (a Ray job's
driver): it loads the model's tokenizer files (no weights) and its dimensions from the replica.
"""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from typing import Any, Iterator

from engine.cache_events import leading_block_keys
from engine.config import RaylensConfig
from engine.core.inputs import GenerationRequest

__all__ = ["PromptKeys", "same_replica", "current_group", "prompt_keys_for"]

_GROUP: contextvars.ContextVar[str | None] = contextvars.ContextVar("raylens_replica_group", default=None)


@contextlib.contextmanager
def same_replica() -> Iterator[str]:
    """Requests submitted inside this block run on one replica (a fresh group id)."""
    token = _GROUP.set(uuid.uuid4().hex)
    try:
        yield _GROUP.get()  # type: ignore[misc]
    finally:
        _GROUP.reset(token)


def current_group() -> str | None:
    return _GROUP.get()


class PromptKeys:
    """A request's leading block hashes, tokenized as the replicas tokenize it."""

    def __init__(self, config: RaylensConfig, tokenizer: Any, info: Any) -> None:
        from engine.core.input_processor import InputProcessor

        self.block_size = config.backend.kv_block_size
        self.enabled = config.ray.router == "affinity" and config.backend.prefix_caching
        self._processor = InputProcessor(
            tokenizer=tokenizer, vocab_size=info.vocab_size, max_context=info.max_context,
            max_sequence=info.max_context, eos_token_ids=info.eos_token_ids, defaults=config.generation,
            load_mods=lambda specs, dirs: [])

    def __call__(self, request: GenerationRequest) -> tuple[bytes, ...]:
        if not self.enabled:
            return ()
        try:
            ids = self._processor.encode(request)
        except Exception:  # the replica refuses it with its own error; route it by load
            return ()
        return tuple(leading_block_keys(ids, self.block_size))


def prompt_keys_for(config: RaylensConfig, generator: Any) -> PromptKeys | None:
    """Keys for a caller holding only a generator's handle: the tokenizer from the model's files
    (converted by the generator), the dimensions from the generator; None when the files cannot
    be read here (requests are then routed by load alone)."""
    import ray
    from transformers import AutoTokenizer

    from engine.model.backend import ModelInfo
    from engine.model.loading import resolve_model_path

    if config.ray.router != "affinity":
        return None
    try:
        model = dict(ray.get(generator.serve_info.remote(), timeout=config.ray.call_timeout_s)["model"])
        model["eos_token_ids"] = tuple(model["eos_token_ids"])
        path = resolve_model_path(config.backend.model_id, config.backend.model_cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(path, token=config.backend.hf_token)
    except Exception as err:  # e.g. a driver on a machine without the model's files: load routing still works
        import logging

        logging.getLogger("raylens.replicas").warning("routing by load only: no tokenizer here (%s)", err)
        return None
    return PromptKeys(config, tokenizer, ModelInfo(**model))
