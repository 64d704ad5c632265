"""``verispec serve`` on a tiny random model, as a process of its own (tests/test_serve.py starts it on loopback to
send it SIGTERM and to read its memory): ``python tests/tiny_server.py [--max-batch N] [--max-queue N]``. It listens
on a free port of 127.0.0.1 and prints ``port N`` on stdout once it serves."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402 - after the path, for conftest
from conftest import tiny_text_model  # noqa: E402

from verispec import build_drafter, resolve  # noqa: E402
from verispec.serve import Service, bind, run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--drain", type=float, default=20.0)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds the engine sleeps before each step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = tiny_text_model()
    service = Service(target, build_drafter("ngram", target), resolve("fixed@chain:3"), max_batch=args.max_batch,
                      max_queue=args.max_queue, max_context=256)
    if args.step_delay:
        step = service.engine.step
        service.engine.step = lambda: (time.sleep(args.step_delay), step())[1]
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    run(service, "tiny", sockets=[sock], drain_s=args.drain, ready=lambda: print(f"port {port}", flush=True))


if __name__ == "__main__":
    main()
