"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (plain and SSE streaming),
/v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from ..sampling import SamplingParams
from .service import Handle, QueueFull, Service, Unavailable


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of the OpenAI API this server ignores are accepted

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # not OpenAI; as in vLLM
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1)

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,  # the OpenAI default
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
        )

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(SamplingFields):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, gt=0)


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        service.stop()

    app = FastAPI(title="specdecode", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            if err.get("type") == "json_invalid":
                problems.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            else:
                problems.append(f"{where or 'body'}: {err.get('msg')}")
        return _error(400, "; ".join(problems) or "invalid request")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.param)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            service.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        body = {"status": "ok" if service.alive else "unavailable", "model": service.model_name,
                "running": len(service.engine.rows), "waiting": service.engine.waiting, "speculation": service.speculation}
        return JSONResponse(body, status_code=200 if service.alive else 503)

    @app.get("/metrics")
    async def metrics():
        service.metrics.queue_length.set(service.engine.waiting)
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0, "owned_by": "specdecode"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: give one prompt per request (got a list of {len(prompt)})", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt: the prompt is empty", "prompt")
        handle, input_ids = _submit(service, body, prompt, body.max_tokens or 16)
        return await _respond(request, service, handle, body, input_ids.shape[1], chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if not body.messages:
            raise ApiError(400, "messages: give at least one message", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        handle, input_ids = _submit(service, body, messages, body.max_completion_tokens or body.max_tokens)
        return await _respond(request, service, handle, body, input_ids.shape[1], chat=True)

    return app


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _submit(service: Service, body: SamplingFields, prompt, max_tokens: int | None):
    if body.model and body.model != service.model_name:
        raise ApiError(400, f"model: unknown model {body.model!r}; this server serves {service.model_name!r}", "model")
    try:
        input_ids = service.encode(prompt)
        if max_tokens is None:  # chat without a limit: the server default, within the context window
            room = (service.context_window or 1 << 30) - input_ids.shape[1]
            max_tokens = max(1, min(service.default_max_tokens, room))
        handle = service.submit(input_ids, max_tokens=max_tokens, sampling=body.sampling(), stop=body.stop_strings())
    except ValueError as error:
        raise ApiError(400, str(error)) from None
    except QueueFull as error:
        raise ApiError(429, str(error)) from None
    except Unavailable as error:
        raise ApiError(503, str(error)) from None
    return handle, input_ids


async def _events(request: Request, service: Service, handle: Handle):
    """The request's ("text" | "done" | "error", value) items; cancels the row if the client goes away."""
    finished = False
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(handle.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            yield kind, value
            if kind in ("done", "error"):
                finished = True
                return
    finally:
        if not finished:
            service.cancel(handle)


async def _respond(request: Request, service: Service, handle: Handle, body: SamplingFields, prompt_tokens: int, chat: bool):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    head = {"id": rid, "created": created, "model": service.model_name}

    def usage() -> dict:
        n = len(handle.seq.result.token_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

    def choice(text: str | None, finish: str | None, stream: bool) -> dict:
        if not chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if stream:
            return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}

    if not body.stream:
        pieces, finish = [], None
        async with aclosing(_events(request, service, handle)) as events:  # closing it cancels an unfinished row
            async for kind, value in events:
                if kind == "text":
                    pieces.append(value)
                elif kind == "error":
                    return _error(500, value)
                else:
                    finish = value
        if finish is None:  # the client went away
            return Response(status_code=499)
        stats = handle.seq.stats
        return {
            **head, "object": "chat.completion" if chat else "text_completion",
            "choices": [choice("".join(pieces), finish, stream=False)], "usage": usage(),
            "speculation": {"drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
                            "target_passes": stats.target_passes, "plain_steps": stats.plain_steps},
        }

    obj = "chat.completion.chunk" if chat else "text_completion"

    def sse(payload: dict) -> str:
        return f"data: {json.dumps({**head, 'object': obj, **payload})}\n\n"

    async def stream():
        if chat:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        async with aclosing(_events(request, service, handle)) as events:  # a client that hangs up closes it
            async for kind, value in events:
                if kind == "text":
                    yield sse({"choices": [choice(value, None, stream=True)]})
                elif kind == "error":
                    yield f"data: {json.dumps(error_body(500, value))}\n\n"
                    return
                else:
                    yield sse({"choices": [choice(None if chat else "", value, stream=True)]})
                    if (body.stream_options or {}).get("include_usage"):
                        yield sse({"choices": [], "usage": usage()})
                    yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")
