"""The state one server shares across routes: the engine, its settings, registered mods, counters."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from engine.errors import RaylensError, check_request_token_ids

from .errors import ApiError, ErrorCode, api_error_from
from .settings import ServeSettings

__all__ = ["Service", "ModRegistry"]


_PROBE = (
    "import json, sys\n"
    "from mods.legacy_names import install_legacy_names\n"
    "from mods.loading import load_mod_from_payload\n"
    "install_legacy_names()\n"
    "load_mod_from_payload(json.load(sys.stdin))\n"
)


def probe_payload(payload: Mapping[str, Any], timeout_s: float) -> None:
    """Load ``payload`` in a child process that is stopped after ``timeout_s``: a mod whose
    top-level code never returns is refused with a coded error, and nothing of it stays running.
    A payload that fails there fails here too, with its own error, when it is loaded for real."""
    import json
    import subprocess
    import sys

    try:
        subprocess.run([sys.executable, "-c", _PROBE], input=json.dumps(dict(payload)), text=True,
                       capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:  # the child is killed by subprocess.run
        raise ApiError(ErrorCode.INVALID_REQUEST, f"a mod's top-level code must return within {timeout_s:g} s "
                                                  "when it is loaded, got code still running (it was stopped). "
                                                  "Move long work into the mod function.", "source") from None


class ModRegistry:
    """Mods registered through ``POST /v1/mods``, by name; selected by a ``<model>/<name>`` suffix.

    A name may be registered again (the new payload replaces the old one, as in the original
    server). Thread safe: routes run on several threads.
    """

    def __init__(self) -> None:
        self._mods: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def register(self, name: str, payload: Mapping[str, Any], *, load_timeout_s: float) -> bool:
        """Load the payload now (a broken mod fails the registration, not a later request).

        Its top-level code runs first in a child process stopped after ``load_timeout_s`` (the
        server's ``mod_load_timeout_s``; :func:`probe_payload`):
        code that never returns would otherwise hold a server thread, and the CPU, for ever. Only
        a payload that loaded there is loaded here (its top level runs twice)."""
        from engine.engine import load_mods

        probe_payload(payload, load_timeout_s)
        (loaded,) = load_mods([dict(payload)])
        with self._lock:
            replaced = name in self._mods
            self._mods[name] = (loaded, dict(payload))
        return replaced

    def get(self, name: str) -> Callable[..., Any]:
        """The loaded mod (for an engine in this process)."""
        return self._entry(name)[0]

    def payload(self, name: str) -> dict[str, Any]:
        """The registered payload (for an engine in another process, which loads its own copy)."""
        return dict(self._entry(name)[1])

    def _entry(self, name: str) -> tuple[Callable[..., Any], dict[str, Any]]:
        with self._lock:
            entry = self._mods.get(name)
            known = sorted(self._mods)
        if entry is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"`model` must name a registered mod after the model id, got mod "
                                                f"{name!r}; registered: {known[:10] or 'none'}. Register it with "
                                                f"POST /v1/mods.", "model")
        return entry

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._mods)


@dataclass
class Service:
    engine: Any
    settings: ServeSettings
    mods: ModRegistry = field(default_factory=ModRegistry)
    _ws_lock: threading.Lock = field(default_factory=threading.Lock)
    ws_open: int = 0

    @property
    def info(self) -> Any:
        return self.engine.backend.info

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_id(self) -> str:
        return self.info.model_id

    def claim_ws(self) -> bool:
        with self._ws_lock:
            if self.ws_open >= self.settings.max_ws_connections:
                return False
            self.ws_open += 1
            return True

    def release_ws(self) -> None:
        with self._ws_lock:
            self.ws_open -= 1

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def check_token_ids(self, ids: list[int], parameter: str) -> None:
        """The engine's rule for a request's token ids, as the API's coded error (INVALID_TOKEN)."""
        try:
            check_request_token_ids(ids, self.info.vocab_size, parameter)
        except RaylensError as err:
            raise api_error_from(err) from None

    def mod(self, name: str) -> Any:
        """A registered mod as the engine takes it: the loaded callable for an engine in this
        process, the payload dict for one that declares ``mods_as_payloads`` (the GeneratorActor
        behind :class:`~pipelines.serve.remote_engine.RemoteEngine` cannot run this process's objects)."""
        if getattr(self.engine, "mods_as_payloads", False):
            return self.mods.payload(name)
        return self.mods.get(name)

    def sae_features_available(self) -> bool:
        """Whether token events carry SAE features: the engine (in this process, or the
        GeneratorActor behind a RemoteEngine) encodes inline, ``sae.enabled`` with ``sae.mode: inline``."""
        return bool(self.engine.sae_features_inline)
