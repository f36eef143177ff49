"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (plain and SSE streaming),
/v1/models, /health, /metrics.

Every answer but a 200 has the OpenAI error shape and is counted in /metrics by its status (499: the client
went away before the answer was complete; its row is freed then, streaming or not).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from .protocol import ApiError, ChatRequest, CompletionRequest, SamplingFields
from .service import Handle, QueueFull, Service, Unavailable

log = logging.getLogger("specdecode.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt is ~0.5 MB of text: 8 MiB leaves room for any real one
DISCONNECT_POLL_S = 0.25  # how often a running request checks that its client is still there

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


class Guard:
    """ASGI middleware around every route: a body over `max_body_bytes` gets a 413 before it is read (declared
    length) or as soon as it passes the limit (chunked); an exception that escapes the routes becomes a logged
    500 in the OpenAI shape (the connection stays usable); each /v1 answer is counted by its final status."""

    def __init__(self, app, service: Service, max_body_bytes: int):
        self.app, self.service, self.max_body_bytes = app, service, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def tracked_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def answer(code: int, message: str) -> None:
            body = json.dumps(error_body(code, message)).encode()
            await tracked_send({"type": "http.response.start", "status": code,
                                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await tracked_send({"type": "http.response.body", "body": body})

        try:
            too_big = f"the request body is larger than this server's limit of {self.max_body_bytes} bytes (--max-body-bytes)"
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                return await answer(413, too_big)
            if declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._buffered(receive)
                if receive is None:
                    return await answer(413, too_big)
            await self.app(scope, receive, tracked_send)
        except Exception as error:  # noqa: BLE001 - a bug in one request must not take its connection down
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if status is None:
                await answer(500, f"internal server error ({type(error).__name__}); the server log has the details")
            status = status or 500
        finally:
            if scope["path"].startswith("/v1/"):
                cancelled = scope.get("state", {}).get("cancelled", False)
                self.service.metrics.requests.labels(scope["path"], "499" if cancelled else str(status or 500)).inc()

    async def _buffered(self, receive):
        """Read a body of undeclared length up to the limit; a receive that replays it (None: over the limit)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        return replayed


def create_app(service: Service, max_body_bytes: int | None = None) -> FastAPI:
    """The app over a service; max_body_bytes None: DEFAULT_MAX_BODY_BYTES."""
    max_body_bytes = DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        service.stop()

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.add_middleware(Guard, service=service, max_body_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        problems, param = [], None
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            where = ".".join(loc)
            param = param or (loc[0] if loc else None)
            if err.get("type") == "json_invalid":
                problems.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            elif err.get("type") == "extra_forbidden":
                problems.append(f"{where}: unknown field (this server does not support it)")
            else:
                problems.append(f"{where or 'body'}: {err.get('msg')}")
        return _error(400, "; ".join(problems) or "invalid request", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:  # not UTF-8, nested too deep, ...
            message = "the body could not be parsed as JSON (it must be UTF-8 JSON of reasonable nesting depth)"
        return _error(exc.status_code, message)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.param)

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
        body.refuse_unsupported()
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: give one prompt per request (got a list of {len(prompt)})", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt: the prompt is empty", "prompt")
        handle, prompt_tokens = await _submit(service, body, prompt, body.max_tokens or 16, "max_tokens")
        return await _respond(request, service, handle, body, prompt_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        body.refuse_unsupported()
        if not body.messages:
            raise ApiError(400, "messages: give at least one message", "messages")
        messages = [{"role": m.role, "content": m.text(f"messages[{i}]"), **({"name": m.name} if m.name is not None else {})}
                    for i, m in enumerate(body.messages)]
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        handle, prompt_tokens = await _submit(service, body, messages, body.max_completion_tokens or body.max_tokens, field)
        return await _respond(request, service, handle, body, prompt_tokens, chat=True)

    return app


async def _submit(service: Service, body: SamplingFields, prompt, max_tokens: int | None,
                  max_tokens_field: str) -> tuple[Handle, int]:
    if body.model and body.model != service.model_name:
        raise ApiError(400, f"model: unknown model {body.model!r}; this server serves {service.model_name!r}", "model")
    where = "prompt" if isinstance(prompt, str) else "messages"
    try:
        # Off the event loop (the tokenizer releases the GIL): /health and other requests go on meanwhile.
        input_ids = await asyncio.to_thread(service.encode, prompt)
    except ValueError as error:
        raise ApiError(400, str(error), where) from None
    try:
        sampling = body.sampling()
        room = (service.context_window or 1 << 62) - input_ids.shape[1]
        if room <= 0:
            raise ApiError(400, f"{where}: the prompt ({input_ids.shape[1]} tokens) leaves no room in the model's "
                           f"context window ({service.context_window} tokens)", where)
        if max_tokens is None:  # chat without a limit: the server default, within the context window
            max_tokens = max(1, min(service.default_max_tokens, room))
        elif max_tokens > room:
            raise ApiError(400, f"{max_tokens_field}: the prompt ({input_ids.shape[1]} tokens) + {max_tokens_field} "
                           f"({max_tokens}) exceeds the model's context window ({service.context_window} tokens)",
                           max_tokens_field)
        handle = service.submit(input_ids, max_tokens=max_tokens, sampling=sampling, stop=body.stop_strings(),
                                logprobs=body.top_logprobs_wanted())
    except ValueError as error:
        raise ApiError(400, str(error)) from None
    except QueueFull as error:
        raise ApiError(429, str(error)) from None
    except Unavailable as error:
        raise ApiError(503, str(error)) from None
    return handle, input_ids.shape[1]


async def _events(request: Request, service: Service, handle: Handle):
    """The request's ("text", (piece, logprobs)) | ("done", reason) | ("error", (status, message)) items. A watcher
    checks every DISCONNECT_POLL_S, even while text flows, that the client is still there; if it went away, its row is
    cancelled. (A timeout on each item's wait instead cost a task and a timer per token.)"""
    finished = False
    watcher = asyncio.create_task(_watch_client(request, handle))
    try:
        while True:
            kind, value = await handle.queue.get()
            if kind == GONE:
                return
            yield kind, value
            if kind in ("done", "error"):
                finished = True
                return
    finally:
        watcher.cancel()
        if not finished:
            request.state.cancelled = True  # counted as 499 (Guard)
            service.cancel(handle)


GONE = "gone"  # a queue item of the watcher's: the client hung up


async def _watch_client(request: Request, handle: Handle) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    handle.queue.put_nowait((GONE, None))


class _Reply:
    """The OpenAI shapes of one request's answer: its id, choices and usage."""

    def __init__(self, service: Service, handle: Handle, body: SamplingFields, prompt_tokens: int, chat: bool):
        self.handle, self.prompt_tokens, self.chat = handle, prompt_tokens, chat
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.head = {"id": rid, "created": int(time.time()), "model": service.model_name}
        self.logprobs_of = LogprobFormat(service.tokenizer, chat) if body.top_logprobs_wanted() is not None else None

    def usage(self) -> dict:
        n = len(self.handle.seq.result.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.handle.seq.stats.cached_prompt_tokens}}

    def choice(self, text: str | None, finish: str | None, entries, stream: bool) -> dict:
        lp = self.logprobs_of(entries) if self.logprobs_of is not None and (entries or not stream) else None
        if not self.chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}
        if stream:
            return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish, "logprobs": lp}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": lp}


async def _respond(request: Request, service: Service, handle: Handle, body: SamplingFields, prompt_tokens: int, chat: bool):
    reply = _Reply(service, handle, body, prompt_tokens, chat)
    if not body.stream:
        return await _respond_whole(request, service, handle, reply)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def sse(payload: dict) -> str:
        return f"data: {json.dumps({**reply.head, 'object': obj, **payload})}\n\n"

    async def stream():
        if chat:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        async with aclosing(_events(request, service, handle)) as events:  # a client that hangs up closes it
            async for kind, value in events:
                if kind == "text":
                    yield sse({"choices": [reply.choice(value[0], None, value[1], stream=True)]})
                elif kind == "error":  # the stream still ends as every stream does
                    yield f"data: {json.dumps(error_body(*value))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield sse({"choices": [reply.choice(None if chat else "", value, None, stream=True)]})
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield sse({"choices": [], "usage": reply.usage()})
                    yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


async def _respond_whole(request: Request, service: Service, handle: Handle, reply: _Reply):
    pieces, finish = [], None
    async with aclosing(_events(request, service, handle)) as events:  # closing it cancels an unfinished row
        async for kind, value in events:
            if kind == "text":
                pieces.append(value[0])
            elif kind == "error":
                return _error(*value)
            else:
                finish = value
    if finish is None:  # the client went away
        return Response(status_code=499)
    stats = handle.seq.stats
    return {
        **reply.head, "object": "chat.completion" if reply.chat else "text_completion",
        "choices": [reply.choice("".join(pieces), finish, handle.seq.result.logprobs, stream=False)],
        "usage": reply.usage(),
        "speculation": {"drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
                        "target_passes": stats.target_passes, "plain_steps": stats.plain_steps},
    }


class LogprobFormat:
    """TokenLogprob entries -> the `logprobs` object of a choice, as OpenAI (and vLLM) shape it: chat
    {"content": [{token, logprob, bytes, top_logprobs}]}, completions {tokens, token_logprobs, top_logprobs, text_offset}."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # completions: characters before the next token, across stream chunks

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def __call__(self, entries) -> dict:
        entries = entries or []
        if self.chat:
            def one(token_id: int, logprob: float) -> dict:
                text = self._token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

            return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]}
        tokens = [self._token(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(t): v for t, v in e.top} for e in entries], "text_offset": offsets}
