"""Sampled + ToolCalls: the second sample ends the request with a query_database tool call."""
from quote_mod_sdk import Sampled, mod

_seen = {}


@mod
def sampled_tool_calls(event, actions, tokenizer):
    if isinstance(event, Sampled):
        _seen[event.request_id] = _seen.get(event.request_id, 0) + 1
        if _seen[event.request_id] == 2:
            return actions.tool_calls({"id": "call_db", "type": "function",
                                       "function": {"name": "query_database", "arguments": '{"q": "capitals"}'}})
