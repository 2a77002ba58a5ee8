"""Run the app under uvicorn on a thread of this process (tests, the benchmark, no Ray).

The listening socket is bound and listening before the server thread starts, so a client may
connect as soon as this returns: the kernel queues the connection until uvicorn accepts it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Iterator

__all__ = ["serve_in_thread"]


@contextlib.contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` on ``host`` (a free port by default); yields ``http://host:port``; stops on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    config = uvicorn.Config(app, log_level="warning", ws_max_size=64 * 2**20, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="raylens-uvicorn", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
