"""The FastAPI routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (both with ``stream=true`` as
server-sent events in OpenAI's chunk format), ``/health`` and ``/metrics``.

A request is checked completely (model name, types, sampling fields, stop strings, context length; the body's
size in ``inference.serve.limits``) before it is queued, so a bad one costs no engine work and never reaches its
neighbours. Every error answers OpenAI's error JSON. A streaming client that goes away is noticed when the stream
is cancelled, a waiting non-streaming one when the ASGI channel reports it (or its handler is cancelled); either
way its request leaves the engine at once.

``spectrain_requests_total`` counts each request once, with its outcome: a stream is counted when it ends (200
finished, 500 failed, 503 shutting down, 499 its client went away), not when its headers go out.

A prompt is rendered and tokenised on a worker thread, not on the event loop (a body of megabytes takes seconds),
and text the context could not hold is refused before. Every 429 and 503 says Retry-After; a stream that waits
hears an SSE comment every ``KEEPALIVE_S``, so that proxies with idle timeouts keep it open.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from core.prompts import render_prompt
from inference.sampling import SamplingParams
from inference.serve.engine import ServedModel
from inference.serve.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from inference.serve.metrics import ServeMetrics
from inference.serve.scheduler import Chunk, Closed, Failed, Finished, Generation, QueueFull, Scheduler
from inference.serve.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    ResponseShape,
    error_body,
    new_id,
    usage_body,
)
from inference.serve.text import TextAssembler

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0  # a stream with nothing to send for this long sends an SSE comment


class Unavailable(APIError):
    """A 429 or 503: its answer says when to retry (Retry-After, seconds)."""

    def __init__(self, status: int, message: str, retry_after: int, **kwargs: Any):
        super().__init__(status, message, **kwargs)
        self.retry_after = retry_after


def retry_after(seconds: int | None) -> dict[str, str] | None:
    return {"Retry-After": str(seconds)} if seconds is not None else None


def create_app(
    model: ServedModel, scheduler: Scheduler, metrics: ServeMetrics, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    app = FastAPI(title="spectrain", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    _add_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        ok, state = scheduler.health()
        return JSONResponse(
            {**state, "exactness": model.exactness, "batching": model.batching},
            status_code=200 if ok else 503,
            headers=None if ok else retry_after(scheduler.retry_after()),
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "spectrain",
                    "algorithm": model.label,
                    "max_model_len": model.max_seq_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(model, body)
        prompt_ids = await run_in_threadpool(_completion_prompt, model, body)
        return await _answer(model, scheduler, metrics, request, body, prompt_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        _check_model(model, body)
        turns = [m.turn() for m in body.messages]
        _check_text_length(model, sum(len(turn["content"]) for turn in turns), "messages")
        try:
            prompt_ids = await run_in_threadpool(render_prompt, model.tokenizer, turns)
        except ValueError as exc:  # a template that refuses the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        return await _answer(model, scheduler, metrics, request, body, prompt_ids, chat=True)

    return app


def _add_error_handlers(app: FastAPI, metrics: ServeMetrics) -> None:
    def answer(request: Request, status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        metrics.requests.labels(endpoint=request.url.path, status=str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc.status, exc.body(), retry_after(getattr(exc, "retry_after", None)))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or (first.get("ctx") or {}).get("param")  # a whole-body check names its field
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return answer(request, 400, error_body(message, "invalid_request_error", param))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's shape
        incident = new_id("incident")  # its text (paths, shapes) stays in the log, found by this id
        log.error("%s %s failed (%s)", request.method, request.url.path, incident, exc_info=exc)
        return answer(
            request,
            500,
            error_body(
                f"internal error ({type(exc).__name__}; {incident}: the server's log has the details)", "server_error"
            ),
        )

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return answer(request, exc.status_code, error_body(message, "invalid_request_error"))


def _check_model(model: ServedModel, body: GenerationRequest) -> None:
    if body.model != model.name:
        raise APIError(
            404,
            f"the model '{body.model}' does not exist; this server serves '{model.name}'",
            param="model",
            code="model_not_found",
        )


def _check_text_length(model: ServedModel, chars: int, param: str) -> None:
    """Text the context cannot hold is refused before it is tokenised (which, for megabytes, takes seconds)."""
    if chars > model.max_prompt_chars:
        raise APIError(
            400,
            f"the prompt's text has {chars} characters, more than this model's context of "
            f"{model.max_seq_len} tokens can hold; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


def _completion_prompt(model: ServedModel, body: CompletionRequest) -> list[int]:
    """The prompt's token ids (run on a worker thread: tokenising a long text takes a while)."""
    if isinstance(body.prompt, str):
        _check_text_length(model, len(body.prompt), "prompt")
        return list(model.tokenizer(body.prompt, add_special_tokens=True)["input_ids"])
    vocab = model.algorithm.target.config.vocab_size
    bad = [t for t in body.prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
    return list(body.prompt)


def _max_tokens(model: ServedModel, body: GenerationRequest, prompt_len: int) -> int:
    """The request's token budget; a prompt (plus max_tokens) the context cannot hold is refused now."""
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    room = model.room(prompt_len)
    if room >= 1 and asked is None:
        return min(model.default_max_tokens, room)
    if room < 1 or asked > room:
        wanted = f" + max_tokens={asked}" if asked is not None else ""
        raise APIError(
            400,
            f"this model's context is {model.max_seq_len} tokens, but the prompt has {prompt_len} "
            f"tokens{wanted} (+{model.algorithm.lookahead()} the algorithm reserves); shorten the "
            "prompt or lower max_tokens",
            param="messages" if hasattr(body, "messages") else "prompt",
            code="context_length_exceeded",
        )
    return asked


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _answer(
    model: ServedModel,
    scheduler: Scheduler,
    metrics: ServeMetrics,
    request: Request,
    body: GenerationRequest,
    prompt_ids: list[int],
    *,
    chat: bool,
) -> Response:
    max_tokens = _max_tokens(model, body, len(prompt_ids))
    default = model.default_sampling  # checked at start-up; the request's own fields by its schema
    sampling = SamplingParams(
        default.temperature if body.temperature is None else body.temperature,
        default.top_k if body.top_k is None else max(body.top_k, 0),
        default.top_p if body.top_p is None else body.top_p,
    )
    events: asyncio.Queue = asyncio.Queue()
    send = event_sender(asyncio.get_running_loop(), events)

    seed = body.seed if body.seed is not None else model.request_seed()
    shape = ResponseShape(chat, model.name, body.return_token_ids)
    gen = Generation(
        prompt_ids,
        max_tokens,
        sampling,
        seed,
        TextAssembler(model.tokenizer, body.stop_list()),
        send,
        model.eos_ids,
        stream=body.stream,
        request_id=shape.id,
    )
    try:
        scheduler.submit(gen)
    except QueueFull as full:
        raise Unavailable(
            429,
            f"the server's queue is full ({scheduler.max_queue} requests waiting); retry later",
            full.retry_after,
            type="rate_limit_error",
            code="queue_full",
        ) from None
    except Closed as closed:
        raise Unavailable(503, closed.message, closed.retry_after, type="server_error", code=closed.code) from None
    usage = _usage_builder(model, len(prompt_ids))

    def count(status: int) -> None:
        metrics.requests.labels(endpoint=request.url.path, status=str(status)).inc()

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EndingStream(
            _stream(scheduler, gen, events, shape, usage, include_usage, count),
            media_type="text/event-stream",
            on_unstarted=lambda: _client_gone(scheduler, gen, count),
        )
    return await _collect(scheduler, gen, events, shape, usage, request, count)


def event_sender(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[object], None]:
    """What the engine's thread calls with a request's events: puts each on ``events`` in ``loop``'s thread. A
    closed loop (the server shutting down) has nobody left to tell; any other failure is a bug and propagates."""

    def send(event: object) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:
            if not loop.is_closed():
                raise

    return send


def _usage_builder(model: ServedModel, prompt_tokens: int):
    return lambda done: usage_body(prompt_tokens, done.completion_tokens, done.stats, model.label)


CLIENT_GONE = 499  # nginx's status for a request whose client closed the connection; nobody reads it


def _client_gone(scheduler: Scheduler, gen: Generation, count: Callable[[int], None]) -> None:
    scheduler.cancel(gen)  # a no-op (nothing counted) if the engine had ended it already
    count(CLIENT_GONE)


class EndingStream(StreamingResponse):
    """A stream whose request ends whatever happens to the response: ``_stream``'s ``finally`` cancels and counts
    it, but runs only once its body has started; a client that leaves before (sending the headers fails, or the
    server stops the response first) would leave its request generating and uncounted. ``on_unstarted`` ends it
    then."""

    def __init__(self, body, *, on_unstarted: Callable[[], None], **kwargs: Any):
        self.started = False

        async def watched():
            self.started = True
            async for chunk in body:
                yield chunk

        super().__init__(watched(), **kwargs)
        self._body, self._on_unstarted = body, on_unstarted

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.started:
                self._on_unstarted()
                await self._body.aclose()


async def _stream(
    scheduler: Scheduler,
    gen: Generation,
    events: asyncio.Queue,
    shape: ResponseShape,
    usage,
    include_usage: bool,
    count: Callable[[int], None],
) -> AsyncIterator[str]:
    status = CLIENT_GONE  # until the end event says otherwise
    try:
        if shape.chat:
            yield _sse(shape.role_chunk())
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):  # a timer handle, no task per event (unlike wait_for)
                    event = await events.get()
            except TimeoutError:  # queued, or a slow step: an SSE comment keeps proxies from closing it
                yield ": keep-alive\n\n"
                continue
            if isinstance(event, Chunk):
                if event.text or (shape.return_token_ids and event.token_ids):
                    yield _sse(shape.chunk(event.text, event.token_ids))
                continue
            if isinstance(event, Failed):
                status = event.status
                yield _sse(error_body(event.message, "server_error", code=event.code))
            else:
                status = 200
                yield _sse(shape.chunk(None if shape.chat else "", [], event.finish_reason))
                if include_usage:
                    yield _sse(shape.usage_chunk(usage(event)))
            yield "data: [DONE]\n\n"
            return
    finally:  # also when the client went away and the stream was cancelled
        if status == CLIENT_GONE:
            _client_gone(scheduler, gen, count)
        else:
            count(status)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away. It waits on the ASGI channel rather than polling: every timer wake-up of
    a waiting request takes the GIL from the engine's thread, which on a small model is busy in Python."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(
    scheduler: Scheduler,
    gen: Generation,
    events: asyncio.Queue,
    shape: ResponseShape,
    usage,
    request: Request,
    count: Callable[[int], None],
) -> Response:
    response = Response(status_code=CLIENT_GONE)
    text, token_ids = [], []
    gone = asyncio.ensure_future(_disconnected(request))
    getter = None
    try:
        while True:
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                return response
            event = getter.result()
            if isinstance(event, Chunk):
                text.append(event.text)
                token_ids.extend(event.token_ids)
            elif isinstance(event, Failed):
                response = JSONResponse(
                    error_body(event.message, "server_error", code=event.code),
                    status_code=event.status,
                    headers=retry_after(event.retry_after),
                )
                return response
            else:
                assert isinstance(event, Finished)
                response = JSONResponse(shape.full("".join(text), token_ids, event.finish_reason, usage(event)))
                return response
    finally:  # also when this handler is cancelled (server shutdown): the request must leave the engine
        gone.cancel()
        if getter is not None:
            getter.cancel()
        if response.status_code == CLIENT_GONE:
            scheduler.cancel(gen)
        count(response.status_code)
