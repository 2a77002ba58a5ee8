"""The one place a :class:`~engine.core.inputs.GenerationRequest` becomes the step loop's
:class:`~engine.core.request.EngineRequest`: the prompt's token ids (chat template applied), the
token-id checks against the vocabulary, the context rule, the stop set and every default from the
config's ``generation`` section, and a structured request's grammar compiled (a schema it cannot
enforce is refused here, before anything runs). Those rules live here and nowhere else; nothing
downstream re-validates."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Callable, Sequence

from engine.config import GenerationConfig, StructuredConfig
from engine.core.inputs import GENERATION_FIELDS, GenerationRequest
from engine.core.request import EngineRequest, RequestContext
from engine.core.structured import GrammarCompiler, grammar_spec
from engine.errors import ContextOverflowError, InvalidRequestError, TokenOutOfVocabularyError, check_request_token_ids
from engine.model.sampling import SamplingParams

__all__ = ["InputProcessor"]


class InputProcessor:
    """Turns a :class:`GenerationRequest` into the step loop's :class:`EngineRequest`: the one home
    of tokenization, vocabulary checks, the context rule, the stop set and the defaults."""

    def __init__(self, *, tokenizer: Any, vocab_size: int, max_context: int, max_sequence: int,
                 eos_token_ids: Sequence[int], defaults: GenerationConfig,
                 load_mods: Callable[[Sequence[Any], Sequence[str]], list[Callable[..., Any]]],
                 prefix_caching: bool = True, structured: StructuredConfig | None = None,
                 kv_capacity_tokens: int | None = None, sends_payloads: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # the context rule: a prompt must be shorter than the model's context and the KV slot's
        # length (backend.max_sequence), so at least one token can be generated
        self.limit = min(max_context, max_sequence)
        # the KV pool's size in tokens (None: the backend has no pool): a prompt it cannot hold
        # with one generated token would never run, so it is refused here, on arrival
        self.kv_capacity_tokens = kv_capacity_tokens
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.defaults = defaults
        self.prefix_caching = prefix_caching  # a request's default for its `prefix_cache` flag
        # payloads leave the engine (an ingest URL): a request's default for its payload's top tokens
        self.sends_payloads = sends_payloads
        self._load_mods = load_mods
        self.grammars = GrammarCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=sorted(self.eos_token_ids),
                                        limits=structured)

    def close(self) -> None:
        """Stop the grammar compiler's child processes."""
        self.grammars.close()

    def encode(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids: ``input_ids`` as given, else the chat template applied."""
        if request.input_ids is not None:
            return check_request_token_ids(list(request.input_ids), self.vocab_size, "input_ids")
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(request.conversation, tools=list(request.tools) if request.tools
                                                 else None, add_generation_prompt=True, tokenize=False)
            return list(tokenizer.encode(text, add_special_tokens=False))
        if request.prompt is not None:
            return list(tokenizer.encode(request.prompt))
        raise InvalidRequestError("this model's tokenizer has no chat template; pass `prompt` or `input_ids`",
                                  parameter="messages")

    def generation(self, request: GenerationRequest) -> GenerationConfig:
        """The request's values over the config's defaults (``max_tokens`` capped by a server's limit)."""
        given = {name: getattr(request, name) for name in GENERATION_FIELDS if getattr(request, name) is not None}
        if "max_tokens" not in given and request.max_tokens_cap is not None:
            given["max_tokens"] = min(self.defaults.max_tokens, request.max_tokens_cap)
        return dataclasses.replace(self.defaults, **given)  # values were checked when the request was built

    def stop_ids(self, gen: GenerationConfig) -> frozenset[int]:
        """The stop set: the request's stop tokens, and the model's EOS ids unless ``ignore_eos``."""
        return frozenset(gen.stop_tokens or ()) | (frozenset() if gen.ignore_eos else self.eos_token_ids)

    def process(self, request: GenerationRequest) -> EngineRequest:
        gen = self.generation(request)
        if gen.stop_tokens:
            check_request_token_ids(list(gen.stop_tokens), self.vocab_size, "stop_tokens")
        banned = tuple(check_request_token_ids(list(request.banned_tokens), self.vocab_size, "banned_tokens"))
        if len(set(banned)) >= self.vocab_size:
            raise InvalidRequestError(f"`banned_tokens` must leave at least one token to sample, got all "
                                      f"{self.vocab_size} of the vocabulary", parameter="banned_tokens",
                                      value=len(banned))
        bias = request.logit_bias or {}
        outside = [t for t in bias if t >= self.vocab_size]
        if outside:
            raise TokenOutOfVocabularyError(f"`logit_bias` keys must be token ids < {self.vocab_size} (the "
                                            f"vocabulary), got {outside[0]}", parameter="logit_bias",
                                            value=outside[0])
        if request.min_tokens and request.min_tokens > gen.max_tokens:
            raise InvalidRequestError(f"`min_tokens` must be <= max_tokens ({gen.max_tokens}), got "
                                      f"{request.min_tokens}", parameter="min_tokens", value=request.min_tokens)
        spec = grammar_spec(request.response_format, request.tool_choice, request.tools)
        grammar = self.grammars.compile(spec) if spec is not None else None
        ids = self.encode(request)
        if len(ids) >= self.limit:
            raise ContextOverflowError(f"the prompt must be shorter than {self.limit} tokens (the model's context "
                                       f"and backend.max_sequence), got {len(ids)}; shorten it",
                                       parameter="input_ids", value=len(ids))
        pool = self.kv_capacity_tokens
        if pool is not None and len(ids) + 1 > pool:
            raise ContextOverflowError(f"the prompt must fit the KV pool with one generated token, at most {pool - 1} "
                                       f"tokens (backend.kv_cache_tokens = {pool}), got {len(ids)}; shorten it, or "
                                       "raise backend.kv_cache_tokens", parameter="backend.kv_cache_tokens",
                                       value=len(ids))
        mods = tuple(self._load_mods(request.mods, gen.mod_dirs))
        penalty = float(request.repetition_penalty) if request.repetition_penalty is not None else 1.0
        return EngineRequest(
            request_id=request.request_id if request.request_id is not None else str(uuid.uuid4()),
            input_ids=tuple(ids), max_tokens=gen.max_tokens,
            sampling=SamplingParams(gen.temperature, gen.top_p, gen.top_k, banned, penalty,
                                    tuple(sorted(bias.items())), float(request.presence_penalty or 0.0),
                                    float(request.frequency_penalty or 0.0)),
            stop_ids=self.stop_ids(gen), step_limit=gen.effective_step_limit, seed=gen.seed,
            logprobs=request.logprobs, attention_all_layers=request.attention == "all",
            mods=mods, mod_call_timeout_s=gen.mod_call_timeout_s or None,
            min_tokens=request.min_tokens or 0, grammar=grammar, caller_request_id=request.request_id,
            prefix_cache=self.prefix_caching if request.prefix_cache is None else request.prefix_cache,
            keep_logits=gen.keep_logits,
            payload_top_tokens=self.sends_payloads if gen.payload_top_tokens is None else gen.payload_top_tokens,
            context=RequestContext(request.user_prompt, tuple(request.conversation),
                                   dict(request.response_format) if request.response_format is not None else None,
                                   tuple(request.tools) if request.tools is not None else None),
        )
