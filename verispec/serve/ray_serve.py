"""``verispec serve --ray``: N replicas of the served engine as a Ray Serve application, behind the same routes.

Each replica is a Ray actor (a process of its own) that builds its ``Service`` with ``make_service`` (a picklable
callable: the model is loaded in the replica, never shipped) and serves the very ASGI app ``verispec serve`` serves
(``api.create_app``), so routes, errors, the API key and streaming are the same; Ray Serve's HTTP proxy spreads
requests over the replicas and restarts a replica that dies. A request in flight on a replica that dies fails (the
proxy answers 500, or a stream is cut); the others go on. Inside a replica the engine steps on a thread of its own,
which costs speed on CPUs where torch's small matrix products are slower off the first thread (docs/design.md).

Needs the ``[ray]`` extra (``pip install 'verispec[ray]'``). ``application`` makes the Ray Serve application;
``deploy`` runs it on a running cluster (``address``) or a local Ray instance bound to 127.0.0.1, until SIGINT or
SIGTERM. docs/serving.md tells how to run it on a cluster and what was tested here.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
from typing import Callable

from ..errors import VerispecError
from .service import Service


def _ray():
    try:
        import ray  # noqa: PLC0415 - the optional extra, imported only when asked for
        from ray import serve  # noqa: PLC0415
    except ImportError:
        raise VerispecError("--ray needs Ray Serve: pip install 'verispec[ray]'") from None
    return ray, serve


def application(make_service: Callable[[], Service], model: str, *, replicas: int = 2, api_key: str | None = None,
                cpus_per_replica: float = 1.0, max_ongoing: int = 64, loopback: bool = False):
    """The Ray Serve application: ``replicas`` copies of ``verispec serve``'s app, each over
    ``make_service()`` (called in the replica), serving it as ``model``; a replica takes at most ``max_ongoing``
    requests at once (its batch and queue; the proxy holds the rest). ``loopback``: a one-machine instance, whose
    replicas open their inter-deployment gRPC server on 127.0.0.1 instead of every interface."""
    if replicas < 1:
        raise VerispecError(f"replicas must be >= 1, got {replicas}")
    _, serve = _ray()

    def build():
        from .api import create_app  # noqa: PLC0415 - in the replica

        if loopback:
            _replica_grpc_on_loopback()

        return create_app(make_service(), model, api_key=api_key, instance=f"{socket.gethostname()}:{os.getpid()}")

    deployment = serve.deployment(serve.ingress(build)(), name="verispec", num_replicas=replicas,
                                  max_ongoing_requests=max_ongoing,
                                  ray_actor_options={"num_cpus": cpus_per_replica})
    return deployment.bind()


def _within(seconds: float, fn, *args) -> bool:
    """``fn(*args)`` on a thread of its own; whether it returned within ``seconds``."""
    def call():
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - shutting down: what Ray says then changes nothing
            pass

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def _replica_grpc_on_loopback() -> None:
    """Ray Serve (2.60) opens each replica's inter-deployment gRPC server on ``[::]`` whatever the node's address;
    on a one-machine instance nothing but loopback needs it. Called while the replica builds its app, before Ray
    adds that port; a Ray without the hook is left as it is."""
    try:
        from ray.serve._private import replica  # noqa: PLC0415 - Ray's internals, guarded
    except ImportError:
        return
    add = getattr(replica, "add_port_to_grpc_server", None)
    if add is not None and not getattr(add, "loopback", False):
        def on_loopback(server, address):
            return add(server, address.replace("[::]", "127.0.0.1"))

        on_loopback.loopback = True
        replica.add_port_to_grpc_server = on_loopback


def deploy(make_service: Callable[[], Service], model: str, *, address: str | None = None, host: str = "127.0.0.1",
           port: int = 8000, ready=None, **kwargs) -> None:
    """Run ``application(...)`` with Ray Serve's proxy on ``host:port``, on the cluster at ``address`` (else a
    local Ray instance on 127.0.0.1), until SIGINT or SIGTERM; then delete it (and stop a local instance)."""
    local = address is None
    if local:  # a single-node instance on loopback: Ray's own servers bind 127.0.0.1, not every interface (Ray
        # reads this before it starts; it is the switch Ray itself uses for the one-machine clusters of macOS)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray, serve = _ray()
    app = application(make_service, model, loopback=local, **kwargs)
    try:
        if local:
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - Ray's own errors, told in one line
        raise VerispecError(f"cannot reach Ray at {address or 'a new local instance'}: {exc}") from None
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(app, name="verispec", route_prefix="/")
        except Exception as exc:  # noqa: BLE001 - Ray's own errors (a port in use, a replica that fails), one line
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # Ray colours its messages
            first = text.splitlines()[0] if text else type(exc).__name__
            raise VerispecError(f"Ray Serve could not start the application: {first}") from None
        if ready is not None:
            ready()
        while not stop.wait(0.5):  # woken by the signal handler
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # bounded: a Ray whose own processes got the signal too (Ctrl-C reaches the whole process group) may
        # never answer; the drain of the replicas (Ray Serve's graceful shutdown) is within the first bound
        if not _within(45, serve.delete, "verispec") or (local and not _within(15, serve.shutdown)):
            print("verispec serve: Ray did not stop its application in time; stopping Ray", file=sys.stderr)
        if local:
            _within(30, ray.shutdown)
