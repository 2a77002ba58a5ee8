"""The raylens mod SDK (numpy only): events, actions, validation, ``@mod``, ModManager, loading.

This package is also what legacy mods import as ``quote_mod_sdk`` (see
:mod:`mods.legacy_names`), so its top-level names are the original SDK's public exports.
"""

from .actions import ActionBuilder, for_event
from .conversation import get_conversation, get_schemas, tool_call_pairs
from .decorator import ModCallable, create_mod, mod
from .self_prompt import self_prompt_mod
from .serialization import serialize_mod
from .tokenizer import tokenize
from .types import (
    Added,
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ForwardPass,
    ModAction,
    ModEvent,
    Noop,
    Prefilled,
    Sampled,
    ToolCalls,
)
from .validation import InvalidActionError, validate_action

__all__ = [
    "ActionBuilder",
    "InvalidActionError",
    "for_event",
    "Prefilled",
    "ForwardPass",
    "Sampled",
    "Added",
    "ModEvent",
    "AdjustedLogits",
    "AdjustedPrefill",
    "Backtrack",
    "EmitError",
    "ForceOutput",
    "ForceTokens",
    "ModAction",
    "Noop",
    "ToolCalls",
    "ModCallable",
    "create_mod",
    "mod",
    "validate_action",
    "serialize_mod",
    "tokenize",
    "self_prompt_mod",
    "get_conversation",
    "tool_call_pairs",
    "get_schemas",
]
