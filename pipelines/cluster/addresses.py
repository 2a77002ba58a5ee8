"""Cluster addresses, read without importing Ray (the CLI decides Ray's environment before Ray
is imported)."""

from __future__ import annotations

__all__ = ["is_loopback_address"]


def is_loopback_address(address: str) -> bool:
    """``address`` (``host:port``) names this machine's loopback (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    import ipaddress
    from urllib.parse import urlsplit

    if not address or address in ("auto", "local") or "://" in address:
        return False
    try:
        host = urlsplit(f"tcp://{address}").hostname or ""
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
