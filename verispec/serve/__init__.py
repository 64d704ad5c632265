"""``verispec serve``: the batched engine behind an OpenAI-compatible HTTP server.

``service.Service`` runs the engine on a thread of its own and takes requests from any thread; ``api.create_app``
is the HTTP layer (FastAPI) over it; ``server`` puts it in a uvicorn server, and ``run`` serves until SIGINT or
SIGTERM, draining the requests in flight for at most ``drain_s`` seconds. docs/serving.md tells how to run and query it.
"""

from __future__ import annotations

import signal
import socket
import threading

from ..errors import VerispecError
from .service import Handle, QueueFull, Request, Service

__all__ = ["Handle", "QueueFull", "Request", "Service", "bind", "run", "server"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port; ``getsockname`` says which), or one sentence why not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise VerispecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def server(service: Service, model: str, *, api_key: str | None = None, drain_s: float = 30.0, ready=None):
    """A uvicorn server of ``service`` as ``model`` (``.run(sockets=[bind(...)])`` serves until SIGINT or SIGTERM,
    letting the requests in flight finish for at most ``drain_s`` seconds; ``should_exit = True`` stops it from
    another thread); ``ready()`` is called once the engine runs."""
    import uvicorn  # noqa: PLC0415 - the server's own dependency, a 0.3 s import needed here only

    from .api import create_app  # noqa: PLC0415 - imports FastAPI (0.5 s), needed here only

    app = create_app(service, model, api_key=api_key, ready=ready)
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                         timeout_graceful_shutdown=max(int(round(drain_s)), 1)))


def run(service: Service, model: str, *, sockets: list[socket.socket], **kwargs) -> None:
    """Serve ``service`` on bound ``sockets`` until SIGINT or SIGTERM (``server`` tells the options). After a
    SIGTERM the drained server returns normally (uvicorn raises the signal again once it has shut down: here it
    finds a handler that lets the process exit with status 0); after a SIGINT, ``KeyboardInterrupt``."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: None)
    server(service, model, **kwargs).run(sockets=sockets)
