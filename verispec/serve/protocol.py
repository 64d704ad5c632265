"""What the OpenAI-compatible routes take and give (``serve.api`` serves them): the request bodies, strictly typed,
the features refused by name, the error shape ``{"error": {"message", "type", "param", "code"}}``, the limits on a
body, and the chunks of a stream."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_BODY = 1 << 20  # bytes of a request body (a prompt of the longest context is far smaller)
BODY_TIMEOUT_S = 30.0  # a request body not whole by then is answered 408 (a half-sent body is never waited on)
SEED_RANGE = 1 << 63


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
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


class Sampled(_Body):
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


class ChatBody(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None


class CompletionBody(Sampled):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


def refuse_unserved(body: Sampled) -> None:
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


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown field {where!r}", where
    if err["type"] == "missing":
        return f"missing field {where!r}", where
    return f"{where}: {err['msg']}" if where else err["msg"], where or None


def no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def chunk(rid: str, model: str, kind: str, text: str | None, reason: str | None, first: bool = False,
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
