"""Servers measured the same way: each started on 127.0.0.1 for one closed loop and stopped by its pid after it,
and driven by the same client through the same OpenAI route (``POST /v1/chat/completions``, streamed) with the
same prompts as messages, so each server applies the model's chat template itself.

The client keeps N requests in flight (``concurrency.Request`` per request: submitted, first text, finished, in
seconds since the loop started). A request's tokens are the ids the server returns where it returns them
(verispec's ``return_token_ids``), else its text encoded again with the target's tokenizer (``Request.token_source``
says which; an EOS token is never in a text, so such a count has one token fewer where the reply ended on one).
Sampling is pinned on every server: the given temperature, top-k and min-p off, top-p 1, and the seed.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from .. import cache
from ..errors import VerispecError
from .concurrency import Request

READY_S = 300  # a server that has not answered its health route by then is reported, not waited for


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(name: str, command: list[str], port: int, ready: str = "/health", env: dict | None = None):
    """``command`` running with its output in a log file of the cache, once ``GET ready`` answers 200 on ``port``;
    stopped by its pid (SIGTERM, then SIGKILL after 20 s) when the block ends."""
    path = cache.path("servers", f"{name}-{port}.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.perf_counter() + READY_S
        while True:
            if proc.poll() is not None:
                raise VerispecError(f"{name} exited with status {proc.returncode} before it served (log: {log.name})")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", ready)
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() > deadline:
                raise VerispecError(f"{name} did not come up within {READY_S} s (log: {log.name})")
            time.sleep(0.25)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@dataclass
class Reply:
    text: str
    token_ids: list[int] | None  # as the server gave them, if it did
    first_s: float | None  # seconds from sending to the first text
    end_s: float
    error: str | None = None


def stream_chat(port: int, body: dict, timeout: float = 600) -> Reply:
    """One streamed chat completion: its text, the server's token ids if any, and when the first text came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t = time.perf_counter()
    text, ids, first, got_ids = [], [], None, False
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise VerispecError(f"answered {resp.status}: {resp.read()[:200]!r}")
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise VerispecError(f"error in the stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if "token_ids" in choice:
                    got_ids = True
                    ids += choice["token_ids"] or []
                if piece or choice.get("token_ids"):
                    if first is None:
                        first = time.perf_counter() - t
                    text.append(piece)
        return Reply("".join(text), ids if got_ids else None, first, time.perf_counter() - t)
    except (OSError, ValueError, VerispecError) as exc:
        return Reply("".join(text), None, first, time.perf_counter() - t, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def closed_loop(n: int, concurrency: int, send: Callable[[int], object], limit_s: float = 3600) -> list[tuple]:
    """``send(0)`` ... ``send(n - 1)`` from ``concurrency`` client threads, a new one starting as one finishes; in
    order, ``(submitted, result, ended)`` with the times in seconds since the loop started."""
    t0 = time.perf_counter()
    queue, lock, done = list(range(n)), threading.Lock(), {}

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            submitted = time.perf_counter() - t0
            result = send(i)
            done[i] = (submitted, result, time.perf_counter() - t0)

    workers = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for w in workers:
        w.start()
    deadline = time.perf_counter() + limit_s
    for w in workers:
        w.join(timeout=max(deadline - time.perf_counter(), 0))
    if len(done) != n or any(w.is_alive() for w in workers):
        raise VerispecError(f"the closed loop did not finish within {limit_s:.0f} s")
    return [done[i] for i in range(n)]


def chat_loop(port: int, body: Callable[[int], dict], problems: list, concurrency: int,
              encode: Callable[[str], list[int]], limit_s: float = 3600) -> list[Request]:
    """A closed loop (``closed_loop``) of ``len(problems)`` streamed chat requests, ``body(i)`` the i-th."""
    stream_chat(port, {**body(0), "max_tokens": 4})  # warm-up: the first request of a process pays for its set-up
    out = []
    for problem, (submitted, r, _) in zip(problems, closed_loop(len(problems), concurrency,
                                                                 lambda i: stream_chat(port, body(i)), limit_s)):
        if r.error is None and not r.text and not r.token_ids:
            r.error = "the server sent no text"  # a stream cut short without an error says so here
        ids, source = (r.token_ids, "server") if r.token_ids is not None else (encode(r.text), "re-encoded")
        out.append(Request(problem, ids, submitted, None if r.first_s is None else submitted + r.first_s,
                           submitted + r.end_s, error=r.error, token_source=source))
    return out


def chat_body(prompt: str | list[dict], model: str, max_tokens: int, temperature: float, seed: int, **extra) -> dict:
    """The request every server gets: pinned sampling (top-k and min-p off where a server has them by default); a
    prompt is a user message, or a whole conversation."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": float(temperature), "top_p": 1.0, "seed": seed, "stream": True, **extra}


# ---------------------------------------------------------------------- the servers

def verispec_command(target_spec: str, port: int, concurrency: int, threads: int, dtype: str) -> list[str]:
    return [sys.executable, "-m", "verispec", "serve", "--target", target_spec, "--port", str(port),
            "--max-batch", str(concurrency), "--threads", str(threads), "--dtype", dtype]


def transformers_command(folder: str, port: int, dtype: str, continuous: bool) -> list[str]:
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or "transformers"
    return [exe, "serve", folder, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype",
            dtype, "--continuous-batching" if continuous else "--no-continuous-batching"]


def llama_cpp_server_command(gguf: str, port: int, threads: int, context: int) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(context),
            "--flash_attn", "true", "--interrupt_requests", "false"]  # by default a new request cuts the one running


def llama_server_command(binary: str, gguf: str, port: int, concurrency: int, threads: int,
                         per_slot: int) -> list[str]:
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(concurrency),
            "-c", str(per_slot * concurrency), "-t", str(threads), "-tb", str(threads), "-fa", "on", "--no-webui"]
