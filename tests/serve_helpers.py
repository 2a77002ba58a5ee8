"""The in-process OpenAI server the serve tests talk to, and the small mods they register.

Each serve test module wants the same thing with its own limits: the session's engine behind
``build_app`` on a loopback port for the module's lifetime, an ``openai`` client pointed at it,
and some of the same three mods registered by name.
"""

from __future__ import annotations

import textwrap
from contextlib import contextmanager
from typing import Any, Iterator

#: name → source of the mods the serve tests register (each mod's entrypoint is its name).
SERVE_MODS = {
    "lookup": textwrap.dedent('''
        from quote_mod_sdk import Sampled, mod

        @mod
        def lookup(event, actions, tokenizer):
            if isinstance(event, Sampled) and event.step == 1:
                return actions.tool_calls({"id": "call_db", "type": "function",
                                           "function": {"name": "query_database", "arguments": '{"q": "colours"}'}})
    '''),
    "shout": textwrap.dedent('''
        from quote_mod_sdk import Sampled, mod

        @mod
        def shout(event, actions, tokenizer):
            if isinstance(event, Sampled) and event.step == 2:
                return actions.force_output(tokens=tokenizer.encode(" [FORCED]", add_special_tokens=False))
    '''),
    "refuse": textwrap.dedent('''
        from quote_mod_sdk import Sampled, mod

        @mod
        def refuse(event, actions, tokenizer):
            if isinstance(event, Sampled):
                return actions.emit_error("refused by policy")
    '''),
}


def mod_payload(name: str) -> dict[str, Any]:
    """The ``POST /v1/mods`` body registering :data:`SERVE_MODS` ``[name]``."""
    return {"name": name, "language": "python", "entrypoint": name, "source": SERVE_MODS[name]}


@contextmanager
def openai_server(engine: Any, *, mods: tuple[str, ...] = (), **settings: Any) -> Iterator[str]:
    """``engine`` served on loopback with ``ServeSettings(**settings)``; yields the base URL.
    ``mods``: names from :data:`SERVE_MODS` registered before the URL is handed out."""
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    if mods:
        settings.setdefault("allow_mod_registration", True)
    with serve_in_thread(build_app(engine, ServeSettings(**settings))) as url:
        for name in mods:
            response = httpx.post(f"{url}/v1/mods", json=mod_payload(name), timeout=60)
            assert response.status_code == 200, response.text
        yield url


@contextmanager
def openai_client(url: str, timeout: float) -> Iterator[Any]:
    """The ``openai`` SDK's client for the server at ``url`` (no retries: a failure shows as one)."""
    from openai import OpenAI

    with OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout) as client:
        yield client
