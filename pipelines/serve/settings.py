"""What one server allows: bind address, authentication, mod registration and request limits.

The defaults are safe on a laptop: loopback only, no code upload. Binding to another host needs an
API key (anyone who reaches the port could otherwise use the model): without one the server refuses
to start, unless ``insecure_no_auth`` (``--insecure-no-auth``) says so explicitly, and then it says
loudly at start-up that there is no authentication. Uploading mods (arbitrary code by design)
needs ``allow_mod_registration`` and, off loopback, an API key — always.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass, field

from engine.errors import ConfigError

__all__ = ["ServeSettings", "is_loopback", "API_KEY_ENV", "raylens_version"]

API_KEY_ENV = "RAYLENS_API_KEY"


@functools.lru_cache(maxsize=1)
def raylens_version() -> str:
    """The installed package's version (``GET /version``, ``system_fingerprint``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raylens")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServeSettings:
    """Server settings; every limit is enforced per request (or per connection) with a coded error.

    ``max_new_tokens``: the most tokens one request may ask for. ``max_message_bytes``: the largest
    HTTP body or WebSocket message. ``max_ws_connections``: open WebSocket connections at once.
    ``request_timeout_s``: a request still running after this is cancelled (error ``TIMEOUT``).
    ``shutdown_grace_s``: on SIGTERM (or Ctrl-C) requests in flight get this long to finish while
    nothing new is taken; what still runs then is cancelled, and the server exits.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    allow_mod_registration: bool = False
    insecure_no_auth: bool = False  # off loopback without a key: only when the operator says so
    max_new_tokens: int = 2048
    max_message_bytes: int = 4 * 2**20
    max_ws_connections: int = 32
    request_timeout_s: float = 600.0
    max_top_logprobs: int = 20
    mod_load_timeout_s: float = 20.0  # a registered mod's top-level code must return within this
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        checks = [
            ("port", 0 <= self.port <= 65535, "in [0, 65535]", self.port),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1", self.max_new_tokens),
            ("max_message_bytes", self.max_message_bytes >= 1024, ">= 1024", self.max_message_bytes),
            ("max_ws_connections", self.max_ws_connections >= 1, ">= 1", self.max_ws_connections),
            ("request_timeout_s", self.request_timeout_s > 0, "> 0", self.request_timeout_s),
            ("mod_load_timeout_s", self.mod_load_timeout_s > 0, "> 0", self.mod_load_timeout_s),
            ("shutdown_grace_s", self.shutdown_grace_s > 0, "> 0", self.shutdown_grace_s),
            ("max_top_logprobs", 0 <= self.max_top_logprobs <= 20, "in [0, 20]", self.max_top_logprobs),
            ("api_key", self.api_key is None or len(self.api_key) >= 8, "at least 8 characters", "<hidden>"),
        ]
        for name, ok, constraint, value in checks:
            if not ok:
                raise ConfigError(f"`{name}` must be {constraint}, got {value}.", parameter=name, value=value)
        if not self.loopback and not self.api_key and not self.insecure_no_auth:
            raise ConfigError(
                f"`--host {self.host}` must come with an API key: off loopback anyone who can reach "
                f"{self.host}:{self.port} could use the model, got no key. Set --api-key (or {API_KEY_ENV}), bind "
                f"to 127.0.0.1, or pass --insecure-no-auth to serve without authentication on purpose.",
                parameter="host", value=self.host)
        if self.allow_mod_registration and not self.loopback and not self.api_key:
            raise ConfigError(
                f"`--allow-mod-registration` must not be used on the non-loopback host {self.host} without an API "
                f"key, got no key. Set --api-key (or {API_KEY_ENV}), or bind to 127.0.0.1.",
                parameter="allow_mod_registration", value=True)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def startup_warnings(self) -> list[str]:
        """What an operator must read before exposing the server."""
        notes = []
        if not self.loopback and not self.api_key:
            notes.append(f"--insecure-no-auth: listening on {self.host} with NO authentication; anyone who can "
                         f"reach {self.host}:{self.port} can use the model. Set --api-key or {API_KEY_ENV} to "
                         f"require a key.")
        if self.allow_mod_registration:
            notes.append("POST /v1/mods is on: clients can upload Python mods, which run arbitrary code here.")
        return notes
