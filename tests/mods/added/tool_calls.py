"""Added + ToolCalls: " capital" triggers a search tool call."""
from quote_mod_sdk import Added, mod


@mod
def added_tool_calls(event, actions, tokenizer):
    if isinstance(event, Added) and tokenizer.decode(event.added_tokens) == " capital":
        return actions.tool_calls({"id": "call_search", "type": "function",
                                   "function": {"name": "search", "arguments": '{"query": "capital"}'}})
