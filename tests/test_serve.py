"""verispec serve: the OpenAI routes through the official client, streaming, bad input, faults, load, shutdown.

Every server here listens on 127.0.0.1 (a free port), takes a bounded number of requests, and is stopped by the
test: in-process ones through uvicorn's ``should_exit``, processes by their pid."""

import concurrent.futures as cf
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest
import torch
from conftest import tiny_text_model

from verispec import build_drafter, generate, resolve
from verispec.backends.base import ForwardOutput
from verispec.drafters import NgramDrafter
from verispec.probs import Sampling
from verispec.serve import QueueFull, Request, Service, bind, run, server

pytestmark = pytest.mark.xdist_group("serve")
HERE = Path(__file__).parent
METHOD = "fixed@chain:3"


def make_service(target=None, drafter=None, **kw) -> Service:
    target = target or tiny_text_model()
    kw.setdefault("max_context", 256)
    kw.setdefault("warm", False)  # the warm-up has its test (below); others gate the engine's steps themselves
    return Service(target, drafter or build_drafter("ngram", target), resolve(METHOD), **kw)


@contextlib.contextmanager
def serving(service: Service, api_key=None):
    """The service behind a uvicorn server on a thread of this process; yields its base URL."""
    sock = bind("127.0.0.1", 0)
    srv = server(service, "tiny", api_key=api_key, drain_s=5)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive()


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def alone(prompt, max_tokens: int, chat: bool = True, **sampling):
    """The same request decoded alone by ``verispec.generate`` (a model of its own, the same weights)."""
    target = tiny_text_model()
    sampling.setdefault("temperature", 0.0)
    return generate(target, build_drafter("ngram", target), "chain", target.encode_prompt(prompt, chat=chat),
                    tree="chain:3", policy="fixed", max_new_tokens=max_tokens, **sampling)


def chat_of(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------- the routes through the official client

def test_openai_client_gets_what_decoding_alone_gives():
    service = make_service()
    with serving(service) as url:
        c = client(url)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        out = c.chat.completions.create(model="tiny", messages=chat_of("hello there"), max_tokens=12, temperature=0)
        ref = alone(chat_of("hello there"), 12)
        assert out.choices[0].message.content == ref.text and out.choices[0].finish_reason == "length"
        u = out.usage
        assert (u.prompt_tokens, u.completion_tokens) == (len(ref.prompt_ids), 12)
        extra = u.model_extra
        assert extra["steps"] == len(ref.steps) and extra["drafted_tokens"] == sum(s.drafted for s in ref.steps)
        assert extra["accepted_tokens"] == sum(s.accepted_length - 1 for s in ref.steps)
        assert extra["mean_accepted_length"] == pytest.approx(ref.mean_accepted_length)
        done = c.completions.create(model="tiny", prompt="once upon", max_tokens=9, temperature=0)
        assert done.choices[0].text == alone("once upon", 9, chat=False).text
        # sampled with a seed: the same law, the same draws as alone
        s = c.chat.completions.create(model="tiny", messages=chat_of("seeded"), max_tokens=10, temperature=0.8,
                                      seed=7, top_p=0.9)
        assert s.choices[0].message.content == alone(chat_of("seeded"), 10, temperature=0.8, top_p=0.9, seed=7).text


def test_stream_equals_the_whole_answer_and_ends_with_done():
    service = make_service()
    body = {"model": "tiny", "messages": chat_of("stream me"), "max_tokens": 20, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with serving(service) as url:
        with httpx2.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
        whole = httpx2.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


class Scripted:
    """A target that writes a fixed text whatever it is asked (greedy): the tiny model's forward with its logits
    replaced so that position p predicts the script's token p + 1 (the prompt has ``prompt_len`` tokens)."""

    def __init__(self, text: str, prompt_len: int):
        self.inner = tiny_text_model()
        self.script = [3 + b for b in text.encode()] + [2] * 64  # then EOS
        self.prompt_len = prompt_len

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_batch(self, states, tokens, positions, attends, features=(-1,), logits_from=None):
        outs = self.inner.forward_batch(states, tokens, positions, attends, features=features, logits_from=logits_from)
        fixed = []
        for out, pos in zip(outs, positions):
            pos = pos[-len(out.logits):]  # the rows that have logits (from logits_from on, where asked)
            logits = torch.full_like(out.logits, -20.0)
            nxt = [self.script[min(int(p) + 1 - self.prompt_len, len(self.script) - 1)] for p in pos]
            logits[torch.arange(len(nxt)), torch.tensor(nxt)] = 20.0
            fixed.append(ForwardOutput(logits, out.hidden))
        return fixed


def test_stream_never_shows_half_a_character_and_stops_across_tokens():
    """Every byte is a token here, so each of these characters spans 2 to 4 tokens, and the stop string 3."""
    text = "Grüße, 東京 😀 EN? ok END tail"
    target = Scripted(text, prompt_len=2)
    service = Service(target, NgramDrafter(target.vocab_size), resolve(METHOD), max_batch=2, max_context=256)
    with serving(service) as url:
        c = client(url)
        deltas = [ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt="hi", max_tokens=100, temperature=0, stop=["END"], stream=True) if ch.choices]
        whole = c.completions.create(model="tiny", prompt="hi", max_tokens=100, temperature=0, stop=["END"])
        full = c.completions.create(model="tiny", prompt="hi", max_tokens=100, temperature=0)
    assert all("\ufffd" not in d for d in deltas) and len([d for d in deltas if d]) > 5
    assert "".join(deltas) == whole.choices[0].text == "Grüße, 東京 😀 EN? ok "
    assert whole.choices[0].finish_reason == "stop"
    assert full.choices[0].text == text and full.choices[0].finish_reason == "stop"  # EOS after the script


# ---------------------------------------------------------------------- bad input

GOOD = {"model": "tiny", "messages": chat_of("hi"), "max_tokens": 4, "temperature": 0}  # T = 0: no early end token
BAD = [  # (body, status, what the message says)
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN"),
    (b"[" * 100_000, 400, "not valid JSON"),
    ({"model": "tiny"}, 400, "missing field 'messages'"),
    ({**GOOD, "messages": "hi"}, 400, "messages"),
    ({**GOOD, "messages": []}, 400, "messages"),
    ({**GOOD, "messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature"),
    ({**GOOD, "temperature": -1}, 400, "temperature"),
    ({**GOOD, "top_p": 0}, 400, "top_p"),
    ({**GOOD, "top_k": "3"}, 400, "top_k"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": True}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": 1_000_000}, 400, "context of 256 tokens"),
    ({**GOOD, "seed": 2 ** 70}, 400, "seed"),
    ({**GOOD, "stop": [""]}, 400, "stop"),
    ({**GOOD, "stream": "yes"}, 400, "stream"),
    ({**GOOD, "foo": 1}, 400, "unknown field 'foo'"),
    ({**GOOD, "n": 2}, 400, "n is not supported"),
    ({**GOOD, "logprobs": True}, 400, "logprobs is not supported"),
    ({**GOOD, "tools": [{"type": "function"}]}, 400, "tools is not supported"),
    ({**GOOD, "model": "gpt-4"}, 404, "does not exist"),
    ({**GOOD, "messages": [{"role": "user", "content": "x" * 400}]}, 400, "context of 256 tokens"),
    ({**GOOD, "max_tokens": 1_000_000}, 400, "+ max_tokens (1000000)"),  # the request's own field, named
    # a lone surrogate, escaped in the JSON (json.dumps' ASCII escapes): valid JSON, not valid Unicode text
    (json.dumps({**GOOD, "messages": [{"role": "user", "content": "a\ud800b"}]}).encode(), 400, "lone surrogate"),
    (json.dumps({**GOOD, "messages": [{"role": "system", "content": "\udfff"}, *chat_of("hi")]}).encode(), 400,
     "lone surrogate"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "lone surrogate"),
    (b"x" * (2 << 20), 413, "larger than"),
]
BAD_COMPLETIONS = [
    ({"model": "tiny", "prompt": [999]}, 400, "token ids"),
    ({"model": "tiny", "prompt": []}, 400, "empty"),
    ({"model": "tiny", "prompt": ["a", "b"]}, 400, "one prompt"),
    ({"model": "tiny", "prompt": "   "}, 400, "empty"),
    ({"model": "tiny", "prompt": "hi", "echo": True}, 400, "echo is not supported"),
    (json.dumps({"model": "tiny", "prompt": "x\ud800"}).encode(), 400, "lone surrogate"),
]


def test_bad_requests_get_a_4xx_json_error_and_the_server_keeps_serving(capfd):
    service = make_service()
    with serving(service) as url:
        for route, cases in (("/v1/chat/completions", BAD), ("/v1/completions", BAD_COMPLETIONS)):
            for body, status, says in cases:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = httpx2.post(url + route, timeout=30, **kw)
                assert r.status_code == status, (body if len(str(body)) < 200 else str(body)[:200], r.text[:300])
                err = r.json()["error"]
                assert says in err["message"] and "Traceback" not in r.text, (says, err)
        assert httpx2.get(url + "/v1/chat/completions").status_code == 405
        assert httpx2.get(url + "/nowhere").json()["error"]["type"] == "not_found_error"
        assert httpx2.post(url + "/v1/chat/completions", json=GOOD, timeout=30).status_code == 200
        assert httpx2.get(url + "/health").json() == {"status": "ok"}
    assert service.running() == 0 and service.queue_depth() == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err  # each refusal is one line in the log, never a traceback
    assert sum(line.startswith("verispec serve: 4") for line in err.splitlines()) >= len(BAD) + len(BAD_COMPLETIONS)


def test_a_half_sent_body_is_answered_408_and_a_client_leaving_mid_upload_leaves_no_traceback(capfd):
    import socket

    service = make_service()
    sock = bind("127.0.0.1", 0)
    srv = server(service, "tiny", drain_s=5, body_timeout=0.5)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    port = sock.getsockname()[1]
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n{\"model\": ")
    try:
        deadline = time.monotonic() + 20
        while not srv.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:  # 20 of 200 bytes, then silence
            c.sendall(head)
            t = time.monotonic()
            answer = b""
            while b"did not arrive whole" not in answer and time.monotonic() - t < 5:
                answer += c.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive whole" in answer
            assert time.monotonic() - t < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:  # part of the body, then gone
            c.sendall(head)
        time.sleep(0.3)
        assert httpx2.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=GOOD, timeout=30).status_code == 200
    finally:
        srv.should_exit = True
        thread.join(15)
        sock.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "408 POST /v1/chat/completions" in err, err


def test_a_fresh_server_says_starting_until_it_has_warmed_up_and_then_serves():
    """``/health`` is 503 "starting" and a request is refused 503 with ``Retry-After`` while the service measures
    and warms up (``Service.warm``); then both are served, and the warm-up left no answer in the answer cache."""
    from verispec.drafters import SuffixCache, with_answer_cache
    from verispec.serve.api import create_app

    target = tiny_text_model()
    cache = SuffixCache(target.vocab_size)
    drafter, _ = with_answer_cache(build_drafter("ngram", target), cache)
    service = make_service(target, drafter, answer_cache=cache, warm=True)
    release, warming = threading.Event(), threading.Event()
    warm = service.warm
    service.warm = lambda: (warming.set(), release.wait(20), warm())[2]
    sock = bind("127.0.0.1", 0)
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(create_app(service, "tiny", manage=False), log_level="warning"))
    http = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    engine = threading.Thread(target=service.run, kwargs={"started": http.start}, daemon=True)
    engine.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert warming.wait(20)
        deadline = time.monotonic() + 20
        while not srv.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        health = httpx2.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "starting"
        early = httpx2.post(url + "/v1/chat/completions", json=GOOD, timeout=5)
        assert early.status_code == 503 and early.headers["Retry-After"] == "5"
        release.set()
        deadline = time.monotonic() + 30
        while httpx2.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the service never became ready"
            time.sleep(0.05)
        assert len(cache) == 0  # the warm-up's answers are not served text
        assert httpx2.post(url + "/v1/chat/completions", json=GOOD, timeout=30).status_code == 200
    finally:
        release.set()
        srv.should_exit = True
        service.stop()
        engine.join(15)
        http.join(15)
        sock.close()


def test_an_api_key_guards_every_route_but_health():
    service = make_service()
    with serving(service, api_key="sekret") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                        {"Authorization": "Basic sekret"}):
            r = httpx2.post(url + "/v1/chat/completions", json=GOOD, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx2.get(url + "/metrics", headers=headers).status_code == 401
        assert service.metrics.received == 0  # refused before the engine
        assert httpx2.get(url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        out = client(url, "sekret").chat.completions.create(model="tiny", messages=chat_of("hi"), max_tokens=3,
                                                             temperature=0)  # T = 1 may draw the end token early
        assert out.choices[0].message.content == alone(chat_of("hi"), 3).text
        assert out.usage.completion_tokens == 3 and service.metrics.received == 1


# ---------------------------------------------------------------------- load and faults

@contextlib.contextmanager
def paused(service: Service):
    """The engine thread waits before each step until the block ends."""
    gate, step = threading.Event(), service.engine.step

    def held():
        gate.wait(30)
        return step()

    service.engine.step = held
    try:
        yield
    finally:
        gate.set()


def test_a_full_queue_answers_429_at_once():
    service = make_service(max_batch=1, max_queue=1)
    with serving(service) as url:
        with cf.ThreadPoolExecutor(2) as pool, paused(service):
            held = [pool.submit(httpx2.post, url + "/v1/chat/completions", json={**GOOD, "max_tokens": 5},
                                timeout=60) for _ in range(2)]
            deadline = time.monotonic() + 10
            while service.queue_depth() < 2:  # one for the free slot, one for the queue
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t = time.monotonic()
            r = httpx2.post(url + "/v1/chat/completions", json=GOOD, timeout=30)
            assert r.status_code == 429 and time.monotonic() - t < 2
            assert r.headers.get("retry-after") == "1"
            assert r.json()["error"]["code"] == "queue_full"
        assert [f.result().status_code for f in held] == [200, 200]


def test_a_prompt_prefilled_by_chunks_holds_one_place_not_two():
    """A request whose prompt is still being prefilled (by chunks, over several steps) is running: it must not count
    against the queue as well (a bug once refused requests there was room for)."""
    service = make_service(max_batch=2, max_queue=1)
    steps, step = threading.Semaphore(1), service.engine.step
    service.engine.step = lambda: (steps.acquire(timeout=30), step())[1]  # one step, then each one let through
    ends = []
    service.start()
    try:
        ids = service.target.encode_prompt("a long prompt " * 15, chat=False)  # 210 tokens: two prefill chunks
        for _ in range(2):
            service.submit(Request(ids, 4, Sampling(0.0), 0), ends.append)
        deadline = time.monotonic() + 10
        while len(service.engine.running) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert all(s.started is None for s in service.engine.running)  # still prefilling
        assert service.queue_depth() == 0
        service.submit(Request(ids, 4, Sampling(0.0), 0), ends.append)  # the one place in the queue
        with pytest.raises(QueueFull):
            service.submit(Request(ids, 4, Sampling(0.0), 0), ends.append)
        for _ in range(200):
            steps.release()
        deadline = time.monotonic() + 30
        while sum(e[0] == "done" for e in ends) < 3:
            assert time.monotonic() < deadline, ends
            time.sleep(0.01)
    finally:
        steps.release(1000)
        service.stop()


class Faulty(NgramDrafter):
    """Prompt lookup that raises inside its step for a prompt with a '!' in it."""

    def reset(self, prompt):
        super().reset(prompt)
        self.doomed = 3 + ord("!") in prompt

    def commit(self, draft, path):
        if getattr(self, "doomed", False):
            raise RuntimeError("injected fault\nsecond line")
        super().commit(draft, path)


def test_a_request_that_fails_inside_its_step_gets_500_and_the_others_finish():
    target = tiny_text_model()
    service = make_service(target, Faulty(target.vocab_size), max_batch=4)
    prompts = ["first", "boom!", "third", "fourth"]
    with serving(service) as url:
        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: httpx2.post(url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": chat_of(p), "max_tokens": 16, "temperature": 0}), prompts))
        assert got[1].status_code == 500 and got[1].json()["error"]["message"] == "injected fault"
        for p, r in zip(prompts, got):
            if p != "boom!":
                assert r.status_code == 200
                assert r.json()["choices"][0]["message"]["content"] == alone(chat_of(p), 16).text
        assert httpx2.post(url + "/v1/chat/completions", json=GOOD, timeout=30).status_code == 200
    assert service.metrics.finished["error"] == 1


def test_a_client_that_goes_away_mid_stream_frees_its_slot():
    service = make_service(max_batch=2)
    step = service.engine.step
    service.engine.step = lambda: (time.sleep(0.01), step())[1]  # slow enough to leave mid-stream
    with serving(service) as url:
        with cf.ThreadPoolExecutor(1) as pool:
            other = pool.submit(httpx2.post, url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": chat_of("stay"), "max_tokens": 60, "temperature": 0})
            with httpx2.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                    **GOOD, "max_tokens": 200, "stream": True}) as r:
                next(r.iter_lines())
            deadline = time.monotonic() + 10
            while service.metrics.finished["abort"] < 1:
                assert time.monotonic() < deadline, "the slot was not freed"
                time.sleep(0.01)
            assert other.result().json()["choices"][0]["message"]["content"] == alone(chat_of("stay"), 60).text
    assert service.running() == 0 and service.metrics.finished["abort"] == 1


def test_a_cancelled_request_leaves_before_the_next_step():
    service = make_service(max_batch=2).start()
    events = []
    try:
        h = service.submit(service_request(service, 200), events.append)
        deadline = time.monotonic() + 10
        while not any(e[0] == "text" for e in list(events)):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with paused(service):
            time.sleep(0.05)  # the engine thread now waits before its next step
            at = service.engine.steps
            h.cancel()
        deadline = time.monotonic() + 10
        while not h.finished:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert service.engine.steps <= at + 1 and service.running() == 0
        assert not any(e[0] == "done" for e in events)  # a cancelled request gets no last event
    finally:
        service.stop()


def test_a_finished_request_lets_go_of_its_sequence():
    """A handle may outlive its request in a reference cycle of the HTTP layer's until the garbage collector's next
    full pass: once ended it holds no sequence, so the sequence's draft state and caches are freed with it (a
    server's memory grew by about 35 MiB every 64 requests while handles held them)."""
    service = make_service().start()
    events, handles = [], []
    try:
        for n in (6, 200):
            handles.append(service.submit(service_request(service, n), events.append))
        deadline = time.monotonic() + 60
        while not handles[0].finished:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert handles[0].seq is None
        handles[1].cancel()
        while not handles[1].finished:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert handles[1].seq is None  # a cancelled one too
    finally:
        service.stop()


def service_request(service, max_tokens):
    from verispec.probs import Sampling
    from verispec.serve import Request

    return Request(service.target.encode_prompt(chat_of("long one")), max_tokens, Sampling(1.0), seed=1)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def server_process(*args):
    """tests/tiny_server.py as a process of its own; yields (process, base URL); stopped by pid at the end."""
    proc = subprocess.Popen([sys.executable, str(HERE / "tiny_server.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "the server did not start in 2 minutes"
        line = proc.stdout.readline()
        assert line.startswith("port "), (line, proc.stderr.read() if proc.poll() is not None else "")
        yield proc, f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_load_64_requests_at_concurrency_8_no_errors_same_text_bounded_memory():
    prompts = [(f"prompt number {i} " * (1 + i % 3), 8 + (7 * i) % 33) for i in range(16)]
    expected = {p: alone(chat_of(p), n).text for p, n in prompts}
    with server_process("--max-batch", "8", "--max-queue", "64") as (proc, url):
        c = client(url)

        def ask(k):
            p, n = prompts[k % len(prompts)]
            out = c.chat.completions.create(model="tiny", messages=chat_of(p), max_tokens=n, temperature=0)
            return p, out.choices[0].message.content

        with cf.ThreadPoolExecutor(8) as pool:
            list(pool.map(ask, range(16)))  # warm up: the caches and the allocator settle
            before = rss_kib(proc.pid)
            t = time.monotonic()
            futures = [pool.submit(ask, k) for k in range(64)]
            results = [f.result(timeout=max(1, 180 - (time.monotonic() - t))) for f in futures]
        after = rss_kib(proc.pid)
        values = metric_values(httpx2.get(url + "/metrics").text)
    assert all(text == expected[p] for p, text in results)
    assert after - before < 64 * 1024, (before, after)  # KiB
    done = 'verispec:request_success_total{finished_reason="%s"}'
    assert values[done % "length"] + values[done % "stop"] == 80 and values[done % "error"] == 0
    assert values["verispec:num_requests_running"] == 0 and values["verispec:num_requests_waiting"] == 0


def test_sigterm_lets_the_requests_in_flight_finish_then_exits(drain="20"):
    with server_process("--max-batch", "2", "--step-delay", "0.05", "--drain", drain) as (proc, url):
        lines = []
        with httpx2.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "drain me", "max_tokens": 150, "temperature": 0, "stream": True}) as r:
            it = r.iter_lines()
            lines.append(next(it))
            proc.send_signal(signal.SIGTERM)
            lines.extend(it)
        assert proc.wait(30) == 0
    lines = [line for line in lines if line]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and data[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(d["choices"][0]["text"] for d in data) == alone("drain me", 150, chat=False).text
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(url + "/health", timeout=5)


def metric_values(text: str) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


def test_metrics_count_what_the_responses_say():
    service = make_service()
    with serving(service) as url:
        c = client(url)
        outs = [c.chat.completions.create(model="tiny", messages=chat_of(p), max_tokens=n, temperature=0)
                for p, n in (("one", 5), ("two", 9), ("three three three", 14))]
        values = metric_values(httpx2.get(url + "/metrics").text)
    assert values["verispec:generation_tokens_total"] == sum(o.usage.completion_tokens for o in outs)
    assert values["verispec:prompt_tokens_total"] == sum(o.usage.prompt_tokens for o in outs)
    assert values["verispec:spec_decode_num_draft_tokens_total"] == sum(o.usage.model_extra["drafted_tokens"]
                                                                        for o in outs)
    assert values["verispec:spec_decode_num_accepted_tokens_total"] == sum(o.usage.model_extra["accepted_tokens"]
                                                                           for o in outs)
    assert values["verispec:time_to_first_token_seconds_count"] == 3
    assert values['verispec:request_success_total{finished_reason="length"}'] == 3


def test_serve_run_steps_the_engine_in_the_calling_thread_and_http_on_another():
    service, seen = make_service(), set()
    step = service.engine.step
    service.engine.step = lambda: (seen.add(threading.current_thread().name), step())[1]
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    caller = threading.Thread(target=run, args=(service, "tiny"), kwargs={"sockets": [sock], "drain_s": 1},
                              name="caller", daemon=True)
    caller.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx2.HTTPError):
                if httpx2.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        out = client(url).completions.create(model="tiny", prompt="where", max_tokens=6, temperature=0)
        assert out.choices[0].text == alone("where", 6, chat=False).text
    finally:
        service.stop()
        caller.join(15)
        sock.close()
    assert not caller.is_alive() and seen == {"caller"}


def test_the_benchmark_client_records_what_the_server_decoded():
    from verispec.bench.serving import chat_body, chat_loop

    prompts = ["one two", "three", "four four four", "five", "six six"]
    target = tiny_text_model()
    with serving(make_service(max_batch=2)) as url:
        port = int(url.rsplit(":", 1)[1])
        out = chat_loop(port, lambda i: chat_body(prompts[i], "tiny", 12, 0.0, 0, return_token_ids=True),
                        prompts, 2, lambda text: target.encode_prompt(text, chat=False))
    assert [r.problem for r in out] == prompts and all(r.error is None for r in out)
    assert all(r.token_source == "server" and r.submitted <= r.first_token <= r.finished for r in out)
    assert [r.token_ids for r in out] == [alone(chat_of(p), 12).token_ids for p in prompts]


def test_verispec_serve_refuses_bad_options_before_loading_a_model(capsys, monkeypatch):
    from verispec import cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    taken = bind("127.0.0.1", 0)
    try:
        for args, says in ((["--port", "70000"], "--port"), (["--max-batch", "0"], "--max-batch"),
                           (["--max-queue", "-1"], "--max-queue"), (["--backend", "llama", "--max-batch", "2"],
                                                                     "one sequence at a time"),
                           (["--drain-timeout", "nan"], "--drain-timeout"), (["--api-key", " "], "empty"),
                           (["--method", "nope"], "unknown method"), (["--ray", "--replicas", "0"], "--replicas"),
                           (["--replicas", "3"], "go with --ray"), (["--ray", "--port", "0"], "fixed --port"),
                           (["--port", str(taken.getsockname()[1])], "cannot listen"),
                           (["--ray", "--port", str(taken.getsockname()[1])], "cannot listen")):
            assert cli.main(["serve", *args]) == 2
            err = capsys.readouterr().err
            assert says in err and len(err.strip().splitlines()) == 1, (args, err)
    finally:
        taken.close()


@pytest.mark.slow
def test_verispec_serve_runs_the_default_model_and_the_readme_client_example(capsys):
    proc = subprocess.Popen([sys.executable, "-m", "verispec", "serve", "--port", "0", "--threads", "1"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = None
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the server ended before it served"
            if line.startswith("serving "):
                url = line.split(" on ")[1].split()[0]
        out = openai.OpenAI(base_url=url, api_key="none", max_retries=0).chat.completions.create(
            model="smollm2-135m", messages=chat_of("Name a colour."), max_tokens=8, temperature=0)
        assert out.choices[0].message.content.strip() and out.usage.completion_tokens <= 8
        # the README's client example, against this server
        readme = (HERE.parent / "README.md").read_text()
        example = re.search(r"### As a server\n.*?```python\n(.*?)```", readme, re.S).group(1)
        assert example.count("\n") <= 6 and "http://127.0.0.1:8000/v1" in example
        exec(compile(example.replace("http://127.0.0.1:8000/v1", url), "README.md", "exec"), {})  # noqa: S102
        assert "drafted_tokens" in capsys.readouterr().out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
