"""The OpenAI-compatible HTTP layer over a ``Service``: module-level routes (``ROUTES``), request checking,
errors, streaming, metrics; the shapes they take and give are ``serve.protocol``'s.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models``, ``GET /health`` (open even with an API key), ``GET /metrics`` (Prometheus text). Every refusal is
a JSON error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status: 400 for a bad
body (malformed JSON, a wrong type, an unknown field, a number out of range, NaN, a prompt past the context, a feature
verispec does not serve), 401 for a missing or wrong key (compared in constant time; such a request never reaches
the engine), 404 for an unknown model or route, 408 for a body not whole in time, 413 for a body past the cap, 429
when the queue is full (with ``Retry-After``), 503 while the service warms up; a request that fails inside the
engine gets a 500 JSON error, and the server goes on. Every refusal is one line on stderr.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import VerispecError
from ..probs import Sampling
from .protocol import (
    BODY_TIMEOUT_S,
    MAX_BODY,
    SEED_RANGE,
    ApiError,
    ChatBody,
    CompletionBody,
    Sampled,
    chunk,
    error,
    no_constant,
    refuse_unserved,
    validation_message,
)
from .service import Handle, QueueFull, Starting, one_line
from .service import Request as EngineRequest

# ---------------------------------------------------------------------- the app

@dataclass(frozen=True)
class Served:
    """What the routes serve (``app.state.served``): the service, its model's name, the limits on a body, and the
    replica's name (``/health`` tells it)."""

    service: object
    model: str
    max_body: int = MAX_BODY
    body_timeout: float = BODY_TIMEOUT_S
    instance: str | None = None
    created: int = 0


def _served(request: Request) -> Served:
    return request.app.state.served


async def api_error(request: Request, exc: ApiError):
    _log(request, exc.status, exc.message)
    return error(exc.status, exc.message, exc.type, exc.param, exc.code)


async def http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    _log(request, exc.status_code, str(exc.detail))
    return error(exc.status_code, str(exc.detail), kind)


async def internal_error(request: Request, exc: Exception):  # a bug: one line, no traceback, and the server goes on
    return error(500, f"internal error: {one_line(exc)}", "server_error")


async def health(request: Request):
    s = _served(request)
    if s.service.starting:
        return error(503, "starting: measuring this machine's costs and warming up", "server_error",
                     code="starting", headers={"Retry-After": "5"})
    if not s.service.healthy:
        return error(503, f"the engine is not running ({s.service.failure or 'stopped'})", "server_error")
    return {"status": "ok"} if s.instance is None else {"status": "ok", "instance": s.instance, "pid": os.getpid()}


async def models(request: Request):
    s = _served(request)
    return {"object": "list", "data": [{"id": s.model, "object": "model", "created": s.created,
                                        "owned_by": "verispec", "max_model_len": s.service.max_context}]}


async def metrics(request: Request):
    return PlainTextResponse(prometheus(_served(request).service), media_type="text/plain; version=0.0.4")


async def body_of(request: Request, kind: type[Sampled]) -> Sampled:
    """The request's body as ``kind``, checked: its size and arrival time, JSON, the types, the model, the features
    not served."""
    s = _served(request)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > s.max_body):
        raise ApiError(413, f"the request body is larger than {s.max_body} bytes")

    async def read() -> bytearray:
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > s.max_body:
                raise ApiError(413, f"the request body is larger than {s.max_body} bytes")
        return raw

    try:
        raw = await asyncio.wait_for(read(), s.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive whole within {s.body_timeout:g} s") from None
    except ClientDisconnect:  # the client left mid-upload: nobody to answer (the status is for the log)
        raise ApiError(499, "the client went away while sending its body") from None
    try:
        data = json.loads(raw, parse_constant=no_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's limit
        raise ApiError(400, f"the body is not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        body = kind.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, param=param) from None
    if body.model is not None and body.model != s.model:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {s.model!r}",
                       "not_found_error", param="model", code="model_not_found")
    refuse_unserved(body)
    return body


def engine_request(body: Sampled, prompt_ids: list[int], max_tokens: int | None) -> EngineRequest:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops) or len(stops) > 16:
        raise ApiError(400, "stop must be up to 16 non-empty strings", param="stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    try:
        sampling = Sampling(temperature, top_k, 1.0 if body.top_p is None else body.top_p)
    except VerispecError as exc:
        raise ApiError(400, str(exc)) from None
    seed = secrets.randbelow(SEED_RANGE) if body.seed is None else body.seed % SEED_RANGE
    return EngineRequest(prompt_ids, max_tokens, sampling, seed, tuple(stops))


def encode(request: Request, prompt, chat: bool) -> list[int]:
    try:
        return _served(request).service.target.encode_prompt(prompt, chat=chat)
    except VerispecError as exc:
        raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None


async def chat_completions(request: Request):
    body = await body_of(request, ChatBody)
    messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content)} for m in body.messages]
    ids = encode(request, messages, chat=True)
    cap = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await respond(request, body, engine_request(body, ids, cap), "chat")


async def completions(request: Request):
    body = await body_of(request, CompletionBody)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request (n = 1)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        ids = list(prompt)
    else:
        ids = encode(request, prompt, chat=False)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
    return await respond(request, body, engine_request(body, ids, max_tokens), "text")


async def respond(request: Request, body: Sampled, req: EngineRequest, kind: str):
    """Submit ``req`` and answer: a stream of server-sent events, or the whole completion."""
    s = _served(request)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    try:
        handle = s.service.submit(req, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    except QueueFull as exc:  # a slot frees within a few steps: ask the client to come back in a second
        return error(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    except Starting as exc:
        return error(503, str(exc), "server_error", code="starting", headers={"Retry-After": "5"})
    except VerispecError as exc:
        raise ApiError(400, str(exc)) from None
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    if body.stream:
        first = await _next_event(request, events, handle)
        if first is None:
            return error(499, "the client went away", "invalid_request_error")
        if first[0] == "error":
            return error(500, first[1], "server_error")
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(request, events, handle, first, rid, s.model, kind, usage,
                                      body.return_token_ids),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text, ids, reason, usage = [], [], None, None
    while True:
        ev = await _next_event(request, events, handle)
        if ev is None:
            return error(499, "the client went away", "invalid_request_error")
        if ev[0] == "text":
            text.append(ev[1])
            ids.extend(ev[2])
        elif ev[0] == "error":
            return error(500, ev[1], "server_error")
        else:
            reason, usage = ev[1], ev[2]
            break
    content = "".join(text)
    choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason,
               "logprobs": None} if kind == "chat" else
              {"index": 0, "text": content, "finish_reason": reason, "logprobs": None})
    if body.return_token_ids:
        choice["token_ids"] = ids
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": s.model, "choices": [choice], "usage": usage}


ROUTES = [  # (path, handler, methods): the whole HTTP surface
    ("/health", health, ["GET"]),
    ("/v1/models", models, ["GET"]),
    ("/metrics", metrics, ["GET"]),
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/v1/completions", completions, ["POST"]),
]


def create_app(service, model: str, api_key: str | None = None, max_body: int = MAX_BODY, ready=None,
               manage: bool = True, instance: str | None = None, body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    """The server's ASGI app for ``service``, serving it as ``model``: the module's ``ROUTES`` over a ``Served``;
    with ``manage`` the app starts the service on a thread of its own and stops it when the app stops (otherwise
    the caller runs it); ``ready()`` is called once the app takes requests; ``instance`` (a replica's name) is told
    by ``/health``; a body that has not arrived whole within ``body_timeout`` seconds is answered 408."""

    @asynccontextmanager
    async def lifespan(app):
        if manage:
            service.start()
        if ready is not None:
            ready()
        yield
        if manage:
            service.stop()

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = Served(service, model, max_body, body_timeout, instance, int(time.time()))
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    if api_key:
        app.add_middleware(_KeyCheck, key=api_key.encode())
    if instance is not None:
        app.add_middleware(_Tagged, tag=instance.encode())
    for path, handler, methods in ROUTES:
        app.add_api_route(path, handler, methods=methods)
    return app


class _KeyCheck:
    """Every route but ``/health`` needs ``Authorization: Bearer KEY`` (compared in constant time); a request without
    it is answered 401 here, before any body is read, and never reaches the engine. (Plain ASGI, not Starlette's
    ``BaseHTTPMiddleware``, which would stand between a stream and the client's disconnect.)"""

    def __init__(self, app, key: bytes):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = error(401, "a valid API key is needed: send it as 'Authorization: Bearer KEY'",
                                  "authentication_error", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Tagged:
    """Every response says which instance answered (header ``X-Verispec-Instance``: a replica behind Ray Serve)."""

    def __init__(self, app, tag: bytes):
        self.app, self.tag = app, tag

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-verispec-instance", self.tag)]}
            await send(message)

        await self.app(scope, receive, tagged)


def _log(request: Request, status: int, message: str) -> None:
    """One line on stderr for a refused request: its status, route and why."""
    print(f"verispec serve: {status} {request.method} {request.url.path}: {message}", file=sys.stderr, flush=True)


async def _next_event(request: Request, events: asyncio.Queue, handle: Handle):
    """The request's next event, or None (and the request cancelled) once the client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                handle.cancel()
                return None


async def _sse(request: Request, events: asyncio.Queue, handle: Handle, first, rid: str, model: str, kind: str,
               include_usage: bool, token_ids: bool):
    """The stream of one request: its text as it comes, the finish reason, usage if asked, ``[DONE]``. Whatever
    ends it early (the client gone, the task cancelled) cancels the request, so its slot frees within one step."""
    ev = first
    try:
        if kind == "chat":
            yield chunk(rid, model, kind, None, None, first=True)
        while True:
            if ev is None:
                return
            if ev[0] == "text":
                if ev[1] or token_ids:  # no empty chunks unless they carry token ids
                    yield chunk(rid, model, kind, ev[1], None, ids=ev[2] if token_ids else None)
            elif ev[0] == "error":
                yield "data: " + json.dumps({"error": {"message": ev[1], "type": "server_error", "param": None,
                                                       "code": None}}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            else:
                yield chunk(rid, model, kind, None, ev[1])
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk" if kind == "chat"
                                                 else "text_completion", "created": int(time.time()),
                                                 "model": model, "choices": [], "usage": ev[2]}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            ev = await _next_event(request, events, handle)
    finally:
        if not handle.finished:
            handle.cancel()


# ---------------------------------------------------------------------- /metrics

def prometheus(service) -> str:
    """The service's metrics in Prometheus' text format, under vLLM's names where vLLM has one (``verispec:``
    in place of ``vllm:``)."""
    m = service.metrics
    out: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]):
        out.append(f"# HELP verispec:{name} {help}")
        out.append(f"# TYPE verispec:{name} {kind}")
        out.extend(f"verispec:{name}{labels} {value}" for labels, value in samples)

    def histogram(name: str, help: str, h):
        metric(name, "histogram", help,
               [(f'{{le="{b}"}}', c) for b, c in zip(h.buckets, h.counts)] + [('{le="+Inf"}', h.count)])
        out.append(f"verispec:{name}_sum {h.sum}")
        out.append(f"verispec:{name}_count {h.count}")

    with service._lock:
        metric("num_requests_running", "gauge", "Requests decoding in the batch.", [("", service.running())])
        metric("num_requests_waiting", "gauge", "Requests waiting for a slot (the queue).",
               [("", service.queue_depth())])
        metric("request_received_total", "counter", "Requests received (refused ones included).",
               [("", m.received)])
        metric("request_rejected_total", "counter", "Requests refused at submission (bad input, full queue).",
               [("", m.rejected)])
        metric("request_success_total", "counter", "Requests finished, by reason (abort: the client went away).",
               [(f'{{finished_reason="{k}"}}', v) for k, v in m.finished.items()])
        metric("prompt_tokens_total", "counter", "Prompt tokens of the requests admitted.", [("", m.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", m.generation_tokens)])
        metric("spec_decode_num_drafts_total", "counter", "Sequence steps that drafted.", [("", m.drafts)])
        metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [("", m.draft_tokens)])
        metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
               [("", m.accepted_tokens)])
        metric("spec_decode_mean_accepted_length", "gauge",
               "Tokens per sequence step (accepted drafts + the one the target adds).",
               [("", (m.accepted_tokens + m.steps) / m.steps if m.steps else 0.0)])
        histogram("iteration_time_seconds", "Time of one engine step (one target forward over the batch).",
                  m.step_time)
        histogram("time_to_first_token_seconds", "From submission to the first token.", m.ttft)
        histogram("time_per_output_token_seconds", "Mean time per output token after the first.", m.tpot)
        histogram("e2e_request_latency_seconds", "From submission to the last token.", m.e2e)
    return "\n".join(out) + "\n"
