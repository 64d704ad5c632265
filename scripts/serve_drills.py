"""Fault drills against ``verispec serve`` on a real model: what docs/results.md's fault table shows.

    .venv/bin/python scripts/serve_drills.py [--target smollm2-135m] [--out results/serve_drills.json]

Starts ``verispec serve`` on 127.0.0.1 (a free port, an API key, 4 slots and a queue of 4) and stops it by its pid;
every request goes to loopback, every loop is bounded in count and time. The drills, in order:

- **bad input**: malformed, mistyped and out-of-range bodies, unserved features, a prompt past the context, a body
  past the cap, unknown routes and models: each must get a 4xx JSON error; then a good request must still succeed;
- **API key**: missing, wrong and malformed keys get 401 and never reach the engine (its received counter stays);
- **full queue**: 16 requests at once against 4 slots and 4 places in the queue: 8 must be served, 8 refused with
  429 at once;
- **disconnects**: 8 streams, 4 of them closed after their first chunk: the other 4 must equal their text decoded
  alone, and no slot may stay taken (``/metrics``: nothing running or waiting once they are done);
- **load**: 64 greedy requests (16 prompts, 4 times each) at concurrency 8: no error, every text equal to the same
  request sent alone, and the server's resident memory after the run against before it (after a warm-up);
- **SIGTERM**: a stream in flight when the signal comes must end whole (``[DONE]``), the process with status 0, and
  a new connection must then be refused;
- **cold start** (a server of its own, default options but no answer cache, a cache of its own as on a new
  machine): ``/health`` must
  answer 503 "starting" until the server has measured its costs and warmed up, and then 16 concurrent requests must
  each be answered within 2x the time the same 16 take once warm.

A failure inside one request's step cannot be provoked from outside a real server: tests/test_serve.py tests it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verispec.bench.records import git_revision, machine  # noqa: E402
from verispec.bench.serving import free_port, server_process  # noqa: E402

KEY = "drill-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["Name three colours.", "What is 12 times 7?", "Write a haiku about rain.", "Who wrote Hamlet?",
           "Give a synonym for happy.", "Explain what a prime number is.", "List four fruits.",
           "What is the capital of France?", "Describe a cat in one sentence.", "Count from one to ten.",
           "What does a thermometer measure?", "Suggest a name for a dog.", "Why is the sky blue?",
           "Translate 'good morning' into Spanish.", "What is the boiling point of water?", "Say hello politely."]
TIME_CAP_S = 600  # no drill loop waits longer than this


def request(port: int, method: str, path: str, body=None, headers=None, timeout: float = 120):
    """One request: (status, parsed JSON or None, seconds)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    t = time.perf_counter()
    try:
        conn.request(method, path, raw, {"Content-Type": "application/json", **AUTH, **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = None
        return resp.status, parsed, time.perf_counter() - t
    finally:
        conn.close()


def chat(prompt: str, max_tokens: int = 32, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def stream(port: int, body: dict, close_after_first: bool = False, on_first=None, timeout: float = 300):
    """A streamed chat completion: (status, text, finish_reason, saw [DONE]); closed after the first chunk if
    asked (the client going away)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json", **AUTH})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return resp.status, "", None, False
        text, reason, done, first = [], None, False, True
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["delta"].get("content") or "")
            reason = choice.get("finish_reason") or reason
            if first:
                first = False
                if on_first is not None:
                    on_first()
                if close_after_first:
                    break
        return 200, "".join(text), reason, done
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}", None, False
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers=AUTH)
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def row(drill: str, sent: int, expected: str, seen: str, ok: bool, **more) -> dict:
    print(f"{'ok ' if ok else 'FAIL'} {drill}: sent {sent}; expected {expected}; seen {seen}", flush=True)
    return {"drill": drill, "sent": sent, "expected": expected, "seen": seen, "ok": bool(ok), **more}


def bad_input(port: int, context: int) -> dict:
    good = chat("hi", 4)
    cases = {
        "malformed JSON": b'{"model": "m", "messages": [',
        "not an object": b"[1, 2, 3]",
        "max_tokens as a string": {**good, "max_tokens": "8"},
        "max_tokens negative": {**good, "max_tokens": -1},
        "max_tokens zero": {**good, "max_tokens": 0},
        "temperature NaN": b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        "temperature negative": {**good, "temperature": -0.5},
        "top_p past 1": {**good, "top_p": 1.5},
        "top_k negative": {**good, "top_k": -3},
        "seed as a string": {**good, "seed": "x"},
        "stream as a string": {**good, "stream": "yes"},
        "stop as a number": {**good, "stop": 7},
        "unknown field": {**good, "colour": "blue"},
        "n = 2": {**good, "n": 2},
        "logprobs": {**good, "logprobs": True},
        "tools": {**good, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "no messages": {**good, "messages": []},
        "unknown role": {**good, "messages": [{"role": "wizard", "content": "hi"}]},
        "content a number": {**good, "messages": [{"role": "user", "content": 5}]},
        "missing messages": {"model": "m", "max_tokens": 4},
        "unknown model": {**good, "model": "gpt-9"},
        "prompt past the context": {**good, "messages": [{"role": "user", "content": "word " * (2 * context)}]},
        "max_tokens past the context": {**good, "max_tokens": 10 * context},
        "body past the cap (2 MiB)": {**good, "messages": [{"role": "user", "content": "x" * (2 << 20)}]},
    }
    seen, bad = {}, []
    for name, body in cases.items():
        status, data, _ = request(port, "POST", "/v1/chat/completions", body)
        is_json_error = isinstance(data, dict) and isinstance(data.get("error"), dict) and data["error"].get("message")
        seen[name] = status
        if not (400 <= status < 500 and is_json_error):
            bad.append(f"{name}: {status}")
    for name, (method, route) in {"unknown route": ("POST", "/v1/nothing"),
                                  "GET on a POST route": ("GET", "/v1/chat/completions"),
                                  "completion without a prompt": ("POST", "/v1/completions")}.items():
        status, data, _ = request(port, method, route, {"model": "m"} if method == "POST" else None)
        seen[name] = status
        if not (400 <= status < 500 and isinstance(data, dict) and "error" in data):
            bad.append(f"{name}: {status}")
    status, data, _ = request(port, "POST", "/v1/chat/completions", good)
    served = status == 200 and data["choices"][0]["message"]["content"] is not None
    n = len(seen)
    return row("bad input", n + 1, f"{n} answered 4xx with a JSON error, then 1 good request served",
               f"{n - len(bad)} 4xx JSON errors" + (f" (not: {', '.join(bad)})" if bad else "")
               + f"; good request {'served' if served else f'answered {status}'}", not bad and served,
               statuses=seen)


def api_key(port: int) -> dict:
    before = metrics(port)["verispec:request_received_total"]
    wrong = [{"Authorization": ""}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"},
             {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer{KEY}"}]
    statuses = [request(port, "POST", "/v1/chat/completions", chat("hi", 4), h)[0] for h in wrong]
    statuses += [request(port, "GET", "/v1/models", None, {"Authorization": "Bearer nope"})[0]]
    health = request(port, "GET", "/health", None, {"Authorization": ""})[0]
    after = metrics(port)["verispec:request_received_total"]
    right = request(port, "POST", "/v1/chat/completions", chat("hi", 4))[0]
    n401 = statuses.count(401)
    return row("API key", len(statuses) + 2, f"{len(statuses)} answered 401, none reaching the engine; /health "
               "open; the right key served", f"{n401} x 401, {after - before:g} reached the engine; /health "
               f"{health}; right key {right}", n401 == len(statuses) and after == before and health == 200
               and right == 200)


def full_queue(port: int) -> dict:
    n, gate = 16, threading.Barrier(16)

    def one(i):
        gate.wait(30)
        t = time.perf_counter()
        status, *_ = stream(port, chat(PROMPTS[i], 48))
        return status, time.perf_counter() - t

    with ThreadPoolExecutor(n) as pool:
        out = list(pool.map(one, range(n), timeout=TIME_CAP_S))
    refused = [s for st, s in out if st == 429]
    served = sum(st == 200 for st, _ in out)
    return row("full queue", n, "8 served, 8 answered 429 at once", f"{served} served, {len(refused)} x 429 "
               f"(slowest refusal {1000 * max(refused, default=0):.0f} ms), {n - served - len(refused)} other",
               served == 8 and len(refused) == 8 and max(refused, default=0) < 1.0)


def disconnects(port: int, alone: dict[str, str]) -> dict:
    before = metrics(port)
    prompts = PROMPTS[:8]

    def one(i):
        return stream(port, chat(prompts[i], 48), close_after_first=i % 2 == 0)

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(one, range(8), timeout=TIME_CAP_S))
    deadline = time.monotonic() + 30
    while True:  # a cancellation takes effect before the engine's next step; its count follows
        m = metrics(port)
        if m["verispec:num_requests_running"] == 0 and m["verispec:num_requests_waiting"] == 0 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    leaked = int(m["verispec:num_requests_running"] + m["verispec:num_requests_waiting"])
    key = 'verispec:request_success_total{finished_reason="abort"}'
    aborted = m.get(key, 0) - before.get(key, 0)
    kept = [(prompts[i], r) for i, r in enumerate(out) if i % 2]
    same = sum(r[0] == 200 and r[3] and r[1] == alone[(p, 48)] for p, r in kept)
    differed = [{"prompt": p, "status": r[0], "done": r[3], "text": r[1], "alone": alone[(p, 48)]} for p, r in kept
                if not (r[0] == 200 and r[3] and r[1] == alone[(p, 48)])]
    return row("disconnects", 8, "4 closed mid-stream and counted as aborted, 4 finished as if alone, 0 slots "
               "left taken", f"{aborted:g} aborted, {same} of 4 finished identical to alone, {leaked} slots left "
               "taken", aborted == 4 and same == 4 and leaked == 0, slots_leaked=leaked, differed=differed)


def load(port: int, pid: int, alone: dict[str, str]) -> dict:
    jobs = [PROMPTS[i % 16] for i in range(64)]

    def one(p):
        status, data, _ = request(port, "POST", "/v1/chat/completions", chat(p, 32), timeout=TIME_CAP_S)
        return p, status, data["choices"][0]["message"]["content"] if status == 200 else None

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, PROMPTS, timeout=TIME_CAP_S))  # warm-up: caches and the allocator settle
        before = rss_kib(pid)
        t = time.perf_counter()
        out = list(pool.map(one, jobs, timeout=TIME_CAP_S))
        wall = time.perf_counter() - t
    after = rss_kib(pid)
    errors = sum(s != 200 for _, s, _ in out)
    same = sum(s == 200 and text == alone[(p, 32)] for p, s, text in out)
    differed = [{"prompt": p, "status": s, "text": text, "alone": alone[(p, 32)]} for p, s, text in out
                if not (s == 200 and text == alone[(p, 32)])][:8]
    growth = (after - before) / 1024
    return row("load: 64 requests at concurrency 8", 64, "0 errors, 64 identical to alone, memory growth < 64 MiB",
               f"{errors} errors, {same} identical to alone, RSS {before / 1024:.0f} -> {after / 1024:.0f} MiB "
               f"({growth:+.1f} MiB), {wall:.0f} s", errors == 0 and same == 64 and growth < 64,
               rss_mib_before=round(before / 1024, 1), rss_mib_after=round(after / 1024, 1), wall_s=round(wall, 1),
               differed=differed)


def sigterm(port: int, proc, alone: dict[str, str]) -> dict:
    prompt = PROMPTS[0]
    first = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(stream, port, chat(prompt, 96), False, first.set)
        first.wait(120)
        t = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        status, text, reason, done = fut.result(TIME_CAP_S)
    code = proc.wait(60)
    exit_s = time.perf_counter() - t
    try:
        request(port, "GET", "/health", timeout=5)
        refused = False
    except OSError:
        refused = True
    whole = status == 200 and done and reason == alone[(prompt, 96, "reason")] and text == alone[(prompt, 96)]
    return row("SIGTERM with a stream in flight", 1, "the stream ends whole ([DONE], the text and finish reason as "
               "alone), exit status 0, new connections refused", f"stream {'whole' if whole else 'cut'}, exit "
               f"status {code} after {exit_s:.1f} s, new connection {'refused' if refused else 'accepted'}",
               whole and code == 0 and refused)


def cold_start(args) -> dict:
    """A fresh server, with a cache of its own (nothing measured on this machine yet): /health until it is 200 (503
    "starting" before), then the 16 prompts at once, twice: each request's seconds cold against warm."""
    import tempfile

    port = free_port()
    # no answer cache: the second pass repeats the first's requests, and drafting from their answers would make it
    # faster for a reason other than warmth
    command = [sys.executable, "-m", "verispec", "serve", "--target", args.target, "--port", str(port),
               "--threads", str(args.threads), "--answer-cache", "0"]
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {"OMP_NUM_THREADS": str(args.threads), "VERISPEC_CACHE": cache_dir}
        t0, seen = time.perf_counter(), []
        # ``server_process`` waits for the 200; a thread watches /health meanwhile and keeps what it answered
        done = threading.Event()

        def watch():
            while not done.is_set():
                try:
                    status, data, _ = request(port, "GET", "/health", timeout=2)
                    seen.append((status, (data.get("error") or {}).get("code") if isinstance(data, dict) else None))
                except OSError:
                    pass
                time.sleep(0.25)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with server_process("verispec-serve-cold", command, port, env=env):
            ready_s = time.perf_counter() - t0
            done.set()
            watcher.join(5)

            def timed(p: str) -> float:
                t = time.perf_counter()
                status, _, _ = request(port, "POST", "/v1/chat/completions", {**chat(p, 48), "model": args.target},
                                       timeout=TIME_CAP_S)
                assert status == 200, status
                return time.perf_counter() - t

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                cold = list(pool.map(timed, PROMPTS))
                warm = list(pool.map(timed, PROMPTS))
    starting = sum(1 for s, code in seen if s == 503 and code == "starting")
    worst = max(c / w for c, w in zip(cold, warm))
    return row("cold start", 2 * len(PROMPTS), "/health 503 'starting' until warm; then 16 concurrent requests each "
               "within 2x their time once warm", f"ready after {ready_s:.0f} s ({starting} x 503 'starting', "
               f"{sum(s == 200 for s, _ in seen)} x 200 seen); cold / warm per request at most {worst:.2f}x "
               f"(cold {max(cold):.1f} s, warm {max(warm):.1f} s at the longest)",
               starting > 0 and worst <= 2.0, ready_s=round(ready_s, 1), cold_s=[round(c, 2) for c in cold],
               warm_s=[round(w, 2) for w in warm])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "serve_drills.json")
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "verispec", "serve", "--target", args.target, "--port", str(port),
               "--api-key", KEY, "--max-batch", "4", "--max-queue", "4", "--max-context", str(args.max_context),
               "--threads", str(args.threads), "--drain-timeout", "60", "--served-model-name", "m"]
    t0 = time.perf_counter()
    rows = [cold_start(args)]
    with server_process("verispec-serve-drills", command, port, env={"OMP_NUM_THREADS": str(args.threads)}) as proc:
        alone = {}
        for p in PROMPTS:  # each request sent alone, the reference for what batching must not change
            for n in (32, 48, 96) if p == PROMPTS[0] else (32, 48):
                status, data, _ = request(port, "POST", "/v1/chat/completions", chat(p, n))
                assert status == 200, (status, data)
                alone[(p, n)] = data["choices"][0]["message"]["content"]
                alone[(p, n, "reason")] = data["choices"][0]["finish_reason"]
        rows.append(bad_input(port, args.max_context))
        rows.append(api_key(port))
        rows.append(full_queue(port))
        rows.append(disconnects(port, alone))
        rows.append(load(port, proc.pid, alone))
        rows.append(sigterm(port, proc, alone))
    report = {"command": "python scripts/serve_drills.py" + (f" --target {args.target}"
                                                           if args.target != "smollm2-135m" else ""),
              "git": git_revision(), "machine": machine(), "server": " ".join(["verispec", *command[3:]]),
              "wall_s": round(time.perf_counter() - t0, 1), "drills": rows}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} drills as expected; {args.out}", flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
