"""``verispec serve`` on a tiny random model, as a process of its own (tests/test_serve.py starts it on loopback to
send it SIGTERM and to read its memory): ``python tests/tiny_server.py [--max-batch N] [--max-queue N]``. It listens
on a free port of 127.0.0.1 and prints ``port N`` on stdout once it serves. With ``--ray --port P`` it serves
``--replicas`` copies through Ray Serve on a local Ray instance instead (tests/test_ray_serve.py)."""

import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402 - after the path, for conftest
from conftest import tiny_text_model  # noqa: E402

from verispec import build_drafter, resolve  # noqa: E402
from verispec.serve import Service, bind, run  # noqa: E402


def tiny_service(max_batch: int, max_queue: int, step_delay: float) -> Service:
    torch.set_num_threads(1)
    target = tiny_text_model()
    service = Service(target, build_drafter("ngram", target), resolve("fixed@chain:3"), max_batch=max_batch,
                      max_queue=max_queue, max_context=256)
    if step_delay:
        step = service.engine.step
        service.engine.step = lambda: (time.sleep(step_delay), step())[1]
    return service


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--drain", type=float, default=20.0)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds the engine sleeps before each step")
    parser.add_argument("--ray", action="store_true")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    make = functools.partial(tiny_service, args.max_batch, args.max_queue, args.step_delay)
    if args.ray:
        from verispec.serve.ray_serve import deploy

        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        deploy(make, "tiny", port=args.port, replicas=args.replicas, cpus_per_replica=0.5,
               max_ongoing=args.max_batch + args.max_queue, ready=lambda: print(f"port {args.port}", flush=True))
        return
    service = make()
    sock = bind("127.0.0.1", args.port)
    port = sock.getsockname()[1]
    run(service, "tiny", sockets=[sock], drain_s=args.drain, ready=lambda: print(f"port {port}", flush=True))


if __name__ == "__main__":
    main()
