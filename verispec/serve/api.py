"""The OpenAI-compatible HTTP layer over a ``Service``: routes, request checking, errors, streaming, metrics.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models``, ``GET /health`` (open even with an API key), ``GET /metrics`` (Prometheus text). Every refusal is
a JSON error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status: 400 for a bad
body (malformed JSON, a wrong type, an unknown field, a number out of range, NaN, a prompt past the context, a feature
verispec does not serve), 401 for a missing or wrong key (compared in constant time; such a request never reaches
the engine), 404 for an unknown model or route, 413 for a body past the cap, 429 when the queue is full; a request
that fails inside the engine gets a 500 JSON error, and the server goes on.
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
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import VerispecError
from ..probs import Sampling
from .service import Handle, QueueFull, Starting, one_line
from .service import Request as EngineRequest

MAX_BODY = 1 << 20  # bytes of a request body (a prompt of the longest context is far smaller)
BODY_TIMEOUT_S = 30.0  # a request body not whole by then is answered 408 (a half-sent body is never waited on)
SEED_RANGE = 1 << 63


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status, headers=headers)


# ---------------------------------------------------------------------- the bodies, strictly typed

class _Body(BaseModel):
    # strict: a string is not a number; an unknown field is refused; NaN and infinities are refused
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class _Sampled(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # an extension (vLLM's): 0 or -1 turns it off
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict | None = None
    user: str | None = None
    return_token_ids: bool = False  # an extension (vLLM's): the generated token ids beside the text


class ChatBody(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None


class CompletionBody(_Sampled):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


def _refuse_unserved(body: _Sampled) -> None:
    """400 for the OpenAI features verispec does not serve, named."""
    unserved = {
        "n": body.n not in (None, 1), "logprobs": body.logprobs not in (None, False),
        "top_logprobs": body.top_logprobs is not None, "presence_penalty": body.presence_penalty not in (None, 0),
        "frequency_penalty": body.frequency_penalty not in (None, 0), "logit_bias": bool(body.logit_bias),
    }
    if isinstance(body, ChatBody):
        unserved.update({k: getattr(body, k) is not None for k in
                         ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")})
        fmt = body.response_format
        unserved["response_format"] = fmt is not None and fmt != {"type": "text"}
    else:
        unserved.update({"echo": body.echo, "suffix": body.suffix is not None,
                         "best_of": body.best_of not in (None, 1)})
    for name, used in unserved.items():
        if used:
            raise ApiError(400, f"{name} is not supported by this server (one choice per request, sampled from the "
                                "target's law; no logprobs, penalties, tools or formats)", param=name)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown field {where!r}", where
    if err["type"] == "missing":
        return f"missing field {where!r}", where
    return f"{where}: {err['msg']}" if where else err["msg"], where or None


# ---------------------------------------------------------------------- the app

def create_app(service, model: str, api_key: str | None = None, max_body: int = MAX_BODY, ready=None,
               manage: bool = True, instance: str | None = None, body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    """The server's ASGI app for ``service``, serving it as ``model``: with ``manage`` the app starts the service
    on a thread of its own and stops it when the app stops (otherwise the caller runs it); ``ready()`` is called
    once the app takes requests; ``instance`` (a replica's name) is told by ``/health``; a body that has not
    arrived whole within ``body_timeout`` seconds is answered 408."""

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
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        _log(request, exc.status, exc.message)
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        _log(request, exc.status_code, str(exc.detail))
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):  # a bug: one line, no traceback, and the server goes on
        return _error(500, f"internal error: {one_line(exc)}", "server_error")

    if api_key:
        app.add_middleware(_KeyCheck, key=api_key.encode())
    if instance is not None:
        app.add_middleware(_Tagged, tag=instance.encode())

    @app.get("/health")
    async def health():
        if service.starting:
            return _error(503, "starting: measuring this machine's costs and warming up", "server_error",
                          code="starting", headers={"Retry-After": "5"})
        if not service.healthy:
            return _error(503, f"the engine is not running ({service.failure or 'stopped'})", "server_error")
        return {"status": "ok"} if instance is None else {"status": "ok", "instance": instance, "pid": os.getpid()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                            "owned_by": "verispec", "max_model_len": service.max_context}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(service), media_type="text/plain; version=0.0.4")

    async def body_of(request: Request, kind: type[_Sampled]) -> _Sampled:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            raise ApiError(413, f"the request body is larger than {max_body} bytes")
        async def read() -> bytearray:
            raw = bytearray()
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > max_body:
                    raise ApiError(413, f"the request body is larger than {max_body} bytes")
            return raw

        try:
            raw = await asyncio.wait_for(read(), body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive whole within {body_timeout:g} s") from None
        except ClientDisconnect:  # the client left mid-upload: nobody to answer (the status is for the log)
            raise ApiError(499, "the client went away while sending its body") from None
        try:
            data = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's limit
            raise ApiError(400, f"the body is not valid JSON ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            body = kind.model_validate(data)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise ApiError(400, message, param=param) from None
        if body.model is not None and body.model != model:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {model!r}",
                           "not_found_error", param="model", code="model_not_found")
        _refuse_unserved(body)
        return body

    def engine_request(body: _Sampled, prompt_ids: list[int], max_tokens: int | None) -> EngineRequest:
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

    def encode(prompt, chat: bool) -> list[int]:
        try:
            return service.target.encode_prompt(prompt, chat=chat)
        except VerispecError as exc:
            raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request, ChatBody)
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in body.messages]
        ids = encode(messages, chat=True)
        cap = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(request, body, engine_request(body, ids, cap), "chat")

    @app.post("/v1/completions")
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
            ids = encode(prompt, chat=False)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        return await respond(request, body, engine_request(body, ids, max_tokens), "text")

    async def respond(request: Request, body: _Sampled, req: EngineRequest, kind: str):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            handle = service.submit(req, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        except QueueFull as exc:  # a slot frees within a few steps: ask the client to come back in a second
            return _error(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        except Starting as exc:
            return _error(503, str(exc), "server_error", code="starting", headers={"Retry-After": "5"})
        except VerispecError as exc:
            raise ApiError(400, str(exc)) from None
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if body.stream:
            first = await _next_event(request, events, handle)
            if first is None:
                return _error(499, "the client went away", "invalid_request_error")
            if first[0] == "error":
                return _error(500, first[1], "server_error")
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_sse(request, events, handle, first, rid, model, kind, usage,
                                          body.return_token_ids),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, ids, reason, usage = [], [], None, None
        while True:
            ev = await _next_event(request, events, handle)
            if ev is None:
                return _error(499, "the client went away", "invalid_request_error")
            if ev[0] == "text":
                text.append(ev[1])
                ids.extend(ev[2])
            elif ev[0] == "error":
                return _error(500, ev[1], "server_error")
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
                "created": int(time.time()), "model": model, "choices": [choice], "usage": usage}

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
                response = _error(401, "a valid API key is needed: send it as 'Authorization: Bearer KEY'",
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


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


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


def _chunk(rid: str, model: str, kind: str, text: str | None, reason: str | None, first: bool = False,
           ids: list[int] | None = None) -> str:
    if kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice, obj = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}, "text_completion"
    if ids is not None:
        choice["token_ids"] = ids
    return "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                                  "choices": [choice]}, ensure_ascii=False) + "\n\n"


async def _sse(request: Request, events: asyncio.Queue, handle: Handle, first, rid: str, model: str, kind: str,
               include_usage: bool, token_ids: bool):
    """The stream of one request: its text as it comes, the finish reason, usage if asked, ``[DONE]``. Whatever
    ends it early (the client gone, the task cancelled) cancels the request, so its slot frees within one step."""
    ev = first
    try:
        if kind == "chat":
            yield _chunk(rid, model, kind, None, None, first=True)
        while True:
            if ev is None:
                return
            if ev[0] == "text":
                if ev[1] or token_ids:  # no empty chunks unless they carry token ids
                    yield _chunk(rid, model, kind, ev[1], None, ids=ev[2] if token_ids else None)
            elif ev[0] == "error":
                yield "data: " + json.dumps({"error": {"message": ev[1], "type": "server_error", "param": None,
                                                       "code": None}}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            else:
                yield _chunk(rid, model, kind, None, ev[1])
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
