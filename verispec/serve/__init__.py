"""``verispec serve``: the batched engine behind an OpenAI-compatible HTTP server.

``service.Service`` steps the engine in one thread and takes requests from any thread; ``api.create_app`` is the
HTTP layer (FastAPI) over it; ``server`` puts it in a uvicorn server, and ``run`` serves until SIGINT or SIGTERM,
draining the requests in flight for at most ``drain_s`` seconds. ``run`` keeps the engine in the main thread and
the HTTP server on another: on this CPU torch's small matrix products ran about twice as slowly in a thread other
than the one that first used OpenMP (docs/design.md, Serving). docs/serving.md tells how to run and query it.
"""

from __future__ import annotations

import signal
import socket
import threading

from ..errors import VerispecError
from .service import Handle, QueueFull, Request, Service, ServiceRecipe, Starting

__all__ = ["Handle", "QueueFull", "Request", "Service", "ServiceRecipe", "Starting", "bind", "run", "server"]


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


def server(service: Service, model: str, *, api_key: str | None = None, drain_s: float = 30.0, ready=None,
           manage: bool = True, **app):
    """A uvicorn server of ``service`` as ``model`` (``.run(sockets=[bind(...)])`` serves until ``should_exit``
    is set, letting the requests in flight finish for at most ``drain_s`` seconds); with ``manage`` it starts and
    stops the service itself, on a thread of its own; ``ready()`` is called once it takes requests; ``app``:
    further options of ``api.create_app``."""
    import uvicorn  # noqa: PLC0415 - the server's own dependency, a 0.3 s import needed here only

    from .api import create_app  # noqa: PLC0415 - imports FastAPI (0.5 s), needed here only

    app = create_app(service, model, api_key=api_key, ready=ready, manage=manage, **app)
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                         timeout_graceful_shutdown=max(int(round(drain_s)), 1)))


def run(service: Service, model: str, *, sockets: list[socket.socket], **kwargs) -> None:
    """Serve ``service`` on bound ``sockets`` until SIGINT or SIGTERM (``server`` tells the options), then return
    once the requests in flight have drained (a second signal cuts the drain short). The engine runs in the
    calling thread, the HTTP server on a thread of its own; signals are caught when called in the main thread.
    The HTTP server listens while the service warms up (``/health`` answers 503 "starting"); ``ready()`` is called
    once the service takes requests."""
    ready = kwargs.pop("ready", None)
    srv = server(service, model, manage=False, **kwargs)

    def on_signal(sig, frame):
        if srv.should_exit:
            srv.force_exit = True
        srv.should_exit = True

    def serve_http():
        try:
            srv.run(sockets=sockets)
        finally:
            service.stop(timeout=0)  # the engine loop ends once the server has drained

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=serve_http, name="verispec-http", daemon=True)
    try:
        service.run(started=http.start, ready=ready)
    finally:
        srv.should_exit = True
        http.join(5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if service.failure is not None:
        raise VerispecError(f"the engine stopped: {service.failure}")
    if not srv.started:
        raise VerispecError("the HTTP server did not start (see the lines above)")
