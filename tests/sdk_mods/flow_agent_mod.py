"""A flow-based support agent written against the original SDK's names (FlowEngine + the
conversation API), in the manner of the airline agent.

It reads the chat (``get_conversation``); if an earlier cancellation tool call already has a
result (``tool_call_pairs``), it reports it with ForceOutput. Otherwise it asks itself whether the
user wants to cancel a reservation (yes/no); on "yes" it takes the reservation code from the user's
message (an auto-answer) or asks for it (six letters or digits), then ends with a ToolCalls action
that calls ``cancel_reservation``; on "no" it answers with ForceOutput.
"""

import json
import re

from quote_mod_sdk import Prefilled, get_conversation, mod, tool_call_pairs
from quote_mod_sdk.flow import FlowEngine, FlowQuestion, route_output, route_tool
from quote_mod_sdk.self_prompt import EraseMode
from quote_mod_sdk.strategies.strategy_constructor import CharsMode, CharsStrat, ChoicesStrat

_CODE = re.compile(r"\b([A-Z0-9]{6})\b")


def _last_user_text():
    users = [m.get("content") for m in get_conversation() if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else ""


def _cancel(actions, state, tokenizer):
    code = state.answers.get("reservation", "").strip().upper()
    return actions.tool_calls({
        "id": "call_" + state.request_id.split("-")[0],
        "type": "function",
        "function": {"name": "cancel_reservation", "arguments": json.dumps({"reservation_id": code})},
    })


def _build_engine():
    reservation = FlowQuestion(
        name="reservation",
        prompt="\nThe six-character reservation code is: ",
        strategy=CharsStrat(CharsMode.ALPHANUMERIC, stop=6),
        erase_mode=EraseMode.ALL,
    ).then(route_tool(_cancel))
    reservation.with_auto_answer(lambda state: (m.group(1) if (m := _CODE.search(state.data.get("user", ""))) else None))
    intent = FlowQuestion(
        name="intent",
        prompt="\nQuestion: does the user want to cancel a reservation? Answer yes or no.\nAnswer: ",
        strategy=ChoicesStrat(["yes", "no"]),
        erase_mode=EraseMode.ALL,
    ).on("yes", reservation).on("no", route_output("I can help with cancellations. What would you like to do?"))
    return FlowEngine(entry_question=intent)


_engines = {}


@mod
def support_agent(event, actions, tokenizer):
    rid = event.request_id
    if isinstance(event, Prefilled):
        done = [(call, result) for call, result in tool_call_pairs()
                if call.get("function", {}).get("name") == "cancel_reservation" and result is not None]
        if done:
            return actions.force_output(tokenizer.encode(f"Your reservation is cancelled: {done[-1][1]}",
                                                         add_special_tokens=False))
        engine = _engines[rid] = _build_engine()
        engine._get_state(rid).data["user"] = _last_user_text()
    engine = _engines.get(rid)
    return engine.handle_event(event, actions, tokenizer) if engine is not None else actions.noop()
