"""Prefilled + ToolCalls: the request ends at once with a get_weather tool call."""
from quote_mod_sdk import Prefilled, mod


@mod
def prefilled_tool_calls(event, actions, tokenizer):
    if isinstance(event, Prefilled):
        return actions.tool_calls({
            "id": "call_" + event.request_id.split("-")[0],
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"location": "New York"}'},
        })
