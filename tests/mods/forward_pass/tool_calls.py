"""ForwardPass + ToolCalls: the first step ends the request with a calculator tool call."""
from quote_mod_sdk import ForwardPass, mod


@mod
def forward_pass_tool_calls(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        return actions.tool_calls({"id": "call_calc", "type": "function",
                                   "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}})
