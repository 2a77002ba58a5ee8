"""Joining the Ray cluster: probe an address first, then ``ray.init`` in raylens' namespace.

``ray.init`` retries an unreachable address for minutes; a user wants one line at once, so every
address — ``auto`` resolved first to the one it means — is probed (a GCS must answer an HTTP/2 greeting, a dashboard its
``/api/version``) within ``ray.connect_timeout_s`` and refused with the way out.
"""

from __future__ import annotations

import re

import ray

from engine.config import RaylensConfig
from engine.errors import ClusterUnreachableError
from pipelines.cluster.addresses import is_loopback_address

__all__ = ["connect", "probe_address", "resolve_auto"]


def connect(config: RaylensConfig, address: str | None = None) -> None:
    """Join the running cluster (``ray start --head`` or a Ray Job's own) in raylens' namespace.

    An explicit address is probed first with ``ray.connect_timeout_s``: ``ray.init`` retries an
    unreachable one for minutes, where a user wants one line at once.
    """
    if ray.is_initialized():
        return
    target = resolve_auto(address or config.ray.address)
    probe_address(target, config.ray.connect_timeout_s, what="Ray cluster (GCS)", key="ray.address")
    _probe_dialed(target, config.ray.connect_timeout_s)
    try:
        ray.init(address=target, namespace=config.ray.namespace, log_to_driver=False, configure_logging=False)
    except ConnectionError as err:
        raise ClusterUnreachableError(
            f"`ray.address` must reach a running Ray cluster, got {target!r} ({_last_error_line(err)}). Start one "
            "with `ray start --head --node-ip-address 127.0.0.1`, or pass --address HOST:PORT",
            parameter="ray.address", value=target) from None


def _probe_dialed(target: str, timeout: float) -> None:
    """Ray dials a loopback address at this machine's outward address unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` was set when it was imported; a head started on
    loopback does not answer there and ``ray.init`` retries for ever. The address Ray will really
    dial is probed too, so that case is one line within the time-out."""
    if not is_loopback_address(target):
        return
    from ray._private.services import canonicalize_bootstrap_address  # Ray's own rewrite

    dialed = canonicalize_bootstrap_address(target)
    if dialed is None or dialed == target:
        return
    try:
        probe_address(dialed, timeout, what="Ray cluster (GCS)", key="ray.address")
    except ClusterUnreachableError as err:
        raise ClusterUnreachableError(
            f"`ray.address` {target!r} answers on loopback, but Ray dials it as {dialed!r} (this machine's outward "
            f"address), where nothing answers within {timeout:g}s: Ray was imported without "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0. Export it (as for `ray start` on loopback), or start the head on "
            "the outward address", parameter="ray.address", value=target) from err


def resolve_auto(address: str) -> str:
    """``auto`` as the one address it means — ``RAY_ADDRESS`` (a Ray Job's own cluster), else the
    cluster this machine recorded last — so it is probed like an explicit one: a stale record is
    one line within ``ray.connect_timeout_s``, not minutes of ``ray.init`` retries. No cluster
    found is the same one line."""
    if address != "auto":
        return address
    from ray._private.services import get_ray_address_from_environment  # Ray's own lookup rule

    try:
        found = get_ray_address_from_environment("auto", None)
    except ConnectionError:
        found = None
    if not found or found == "auto":
        raise ClusterUnreachableError(
            "`ray.address` is auto, and no running Ray cluster was found on this machine (no RAY_ADDRESS, no "
            "recorded cluster). Start one with `ray start --head --node-ip-address 127.0.0.1`, pass "
            "--address HOST:PORT, or --address local for a Ray of this command's own", parameter="ray.address",
            value="auto")
    return found


def probe_address(address: str, timeout: float, *, what: str, key: str) -> None:
    """Raise :class:`ClusterUnreachableError` unless ``address`` answers within ``timeout`` seconds.

    ``host:port`` is a GCS, a gRPC server: it must answer an HTTP/2 greeting (a listener that
    accepts and stays silent would hold ``ray.init`` for minutes). An ``http(s)://`` URL is a
    dashboard: its ``/api/version`` must answer. ``local`` (a new Ray of this process's own) and
    ``ray://`` are left to Ray; ``auto`` is resolved by :func:`resolve_auto` before this.
    """
    from urllib.parse import urlsplit

    if address == "local" or address.startswith("ray://"):
        return
    try:
        if "://" in address:
            _answers_http(address, timeout)
        else:
            parts = urlsplit(f"tcp://{address}")
            if not parts.hostname or not parts.port:
                raise ClusterUnreachableError(f"`{key}` must be HOST:PORT, got {address!r}", parameter=key,
                                              value=address)
            _answers_grpc(parts.hostname, parts.port, timeout)
    except (OSError, ValueError) as err:
        reason = "no answer" if isinstance(err, TimeoutError) else (getattr(err, "strerror", None) or str(err))
        raise ClusterUnreachableError(
            f"`{key}` must reach a running {what}, got {address!r} ({reason}; waited at most {timeout:g}s). Start Ray "
            "(`ray start --head --node-ip-address 127.0.0.1`) or pass the right --address",
            parameter=key, value=address) from None


_HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def _answers_grpc(host: str, port: int, timeout: float) -> None:
    """A gRPC server answers the HTTP/2 client greeting with a SETTINGS frame (type 4) at once."""
    import os
    import socket

    with socket.create_connection((host, port), timeout=timeout) as sock:
        if os.environ.get("RAY_USE_TLS", "0") not in ("0", ""):
            return  # a TLS GCS does not speak cleartext HTTP/2; the connection is all we can check
        sock.settimeout(timeout)
        sock.sendall(_HTTP2_GREETING)
        header = sock.recv(9)
    if len(header) < 4 or header[3] != 0x04:
        raise ValueError("not a Ray GCS: no HTTP/2 answer")


def _answers_http(url: str, timeout: float) -> None:
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/api/version", timeout=timeout)  # any answer will do (auth may refuse it)
    except httpx.TimeoutException:
        raise TimeoutError from None
    except httpx.HTTPError as err:
        raise OSError(str(err) or type(err).__name__) from None


def _last_error_line(err: Exception) -> str:
    """The exception line that ends Ray's chained traceback of a failed ``__init__`` (the cause a
    user can act on), without terminal colour codes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
    return next((line for line in reversed(lines) if line), type(err).__name__)
