"""`tokenspeed serve`: an OpenAI-compatible HTTP server (chat completions) over one resident engine.

FastAPI + uvicorn, request bodies validated by pydantic, streaming as server-sent events
(sse-starlette) in OpenAI's chunk format, metrics in Prometheus text format (prometheus-client).
The answers, warm sessions included, come from `tokenspeed.chat.ChatEngine`.

One engine, one stream: requests run one at a time on a single engine thread, so every request
that should not run costs everyone behind it. A request is therefore read (at most
`max_body_bytes`, else 413), parsed, validated and tokenized on a preparation thread before it
may wait for the engine (`ChatEngine.prepare`: over-length prompts, bad Unicode and deep schemas
are refused with OpenAI-shaped 400s); at most `queue_size` wait behind the running one and the
next is answered 429 at once with Retry-After; a request whose `deadline_ms` cannot be met given
the work ahead of it is refused at once too. A request whose client disconnects, or whose
deadline passes, is dropped from the queue, or stopped between two forwards on the engine
(`ChatEngine.complete`). The event loop keeps answering (/health, admission) while the engine
runs: nothing holds the GIL for long (tokenizing releases it, a first request's one-time costs
are paid before serving, the start-up heap is frozen out of the garbage collector's full
collections, the GIL changes hands every millisecond). Every error is OpenAI-shaped
JSON (an unexpected one: 500, logged with its traceback); a stream that fails ends with an error
event, then `[DONE]`.

Source: OpenAI Chat Completions API reference (request, response, chunk and error objects);
RFC 9110 section 10.2.3 (Retry-After).
"""
import asyncio
import contextlib
import gc
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .chat import ChatEngine, ChatError, ChatResult
from .engine import Engine

log = logging.getLogger("tokenspeed.serve")
ADMISSION_SAFETY = 0.5  # a deadline is refused at admission when this share of the estimated time is too late
PREPARE_QUEUE = 64  # requests that may be read and prepared at once (beyond: 429)
# The engine thread holds the GIL between its C calls; the event loop, woken by a socket, waits up
# to this long for it (Python's default: 5 ms, several times per request): set by `serve`
SWITCH_INTERVAL_S = 0.001

__all__ = ["ChatCompletionRequest", "Server", "Ticket", "create_app", "listen", "serve"]


# ---------------------------------------------------------------- request models


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One chat message (OpenAI shape). content: text or a list of {"type": "text", "text"} parts."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The body of POST /v1/chat/completions (fields OpenAI clients send that we do not use are ignored).

    deadline_ms: TokenSpeed's extension: the answer must be complete this many milliseconds
        after the request arrives (queue wait included), as `Session.decide(deadline=)`; a late
        answer ends with finish_reason "length", no content, and the choice's
        `tokenspeed_finish` {"reason": "deadline", "detail": why}.
    auto_threshold: TokenSpeed's extension: with tool_choice "auto", call when the model's
        probability of opening a call at the answer's first position reaches this (in [0, 1]);
        default: the model's calibration (`tokenspeed.auto`).
    """

    model_config = ConfigDict(extra="ignore")
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    deadline_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    auto_threshold: float | None = Field(default=None, ge=0.0, le=1.0)


@dataclass(eq=False)
class Ticket:
    """One admitted request on its way to the engine (shared by the event loop and the engine thread).

    Attributes:
        deadline_at: absolute `time.monotonic()` deadline, or None.
        cost_s: estimated engine seconds of the request (`Server.cost`).
        gone: set when the client has gone: the engine drops or stops the request.
        started: `time.monotonic()` when the engine took it, or None.
        dropped: it was answered before the engine took it (its deadline passed in the queue).
    """

    deadline_at: float | None
    cost_s: float
    gone: threading.Event = field(default_factory=threading.Event)
    started: float | None = None
    dropped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def drop(self) -> bool:
        """Mark it answered without the engine, unless the engine has taken it; True when dropped."""
        with self.lock:
            self.dropped = self.started is None
            return self.dropped

    def start(self) -> bool:
        """Mark it taken by the engine (engine thread), unless dropped or gone; True when taken."""
        with self.lock:
            if self.dropped or self.gone.is_set():
                return False
            self.started = time.monotonic()
            return True


class Server:
    """The HTTP side's state: the `ChatEngine`, its engine and preparation threads, admission and metrics.

    Admission estimates each request's engine time from rates measured on this machine (moving
    averages over the answers, none before the first): prompt tokens not in a warm session times
    the prefill time per token, plus the expected answer length times the time per answer token.

    Args:
        engine: the resident `Engine`.
        model_name: the id /v1/models reports.
        queue_size: requests that may wait behind the running one (more -> 429).
        cache_budget_bytes: KV bytes the conversation cache may hold.
        context: KV capacity of each conversation in tokens.
        max_body_bytes: largest request body accepted (larger -> 413).
    """

    def __init__(self, engine: Engine, model_name: str, queue_size: int = 8,
                 cache_budget_bytes: int = 1 << 30, context: int = 4096, max_body_bytes: int = 8 << 20):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.chat = ChatEngine(engine, context, cache_budget_bytes)
        self.model_name = model_name
        self.queue_size = queue_size
        self.max_body_bytes = max_body_bytes
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenspeed-engine")
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenspeed-prepare")
        self.tickets: set[Ticket] = set()  # admitted and not finished on the engine; event loop only
        self.admitting = 0  # requests read or prepared, not yet admitted; event loop only
        # measured rates (`_learn`): none yet, so no request is refused on a guess; until then
        # deadlines are kept by dropping and stopping requests, which needs no estimate
        self.prefill_s = self.decode_s = 0.0
        self.answer_tokens = 16.0
        self.registry = r = CollectorRegistry()
        self.m_requests = Counter("tokenspeed_requests", "chat completion requests by finish reason",
                                  ["finish_reason"], registry=r)
        self.m_rejected = Counter("tokenspeed_queue_rejections", "requests answered 429 (queue full, or their "
                                  "deadline cannot be met behind the queue)", registry=r)
        self.m_dropped = Counter("tokenspeed_dropped", "requests stopped or dropped before their answer (client gone, "
                                 "deadline)", ["why"], registry=r)
        self.m_ttft = Histogram("tokenspeed_ttft_seconds", "request start on the engine -> first token", registry=r,
                                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        cache = self.chat.cache
        for name, doc, value in [
                ("tokenspeed_cache_hits", "requests that continued a cached conversation", lambda: cache.hits),
                ("tokenspeed_cache_misses", "requests that started a new session", lambda: cache.misses),
                ("tokenspeed_cache_evictions", "sessions evicted (LRU, memory budget)", lambda: cache.evictions),
                ("tokenspeed_cache_reused_tokens", "context tokens reused from cached sessions",
                 lambda: cache.cached_tokens),
                ("tokenspeed_cache_sessions", "conversations held", lambda: len(cache)),
                ("tokenspeed_cache_bytes", "KV bytes held by cached conversations", lambda: cache.nbytes),
                ("tokenspeed_queue_depth", "requests running, waiting or being prepared", lambda: self.depth),
                ("tokenspeed_queue_ahead_seconds", "estimated engine seconds left of the admitted requests (one "
                 "running past its estimate: 0)",
                 lambda: self.ahead_s()),
                ("tokenspeed_prefill_seconds_per_token", "measured prefill time per prompt token (admission estimate)",
                 lambda: self.prefill_s),
                ("tokenspeed_decode_seconds_per_token", "measured time per answer token (admission estimate)",
                 lambda: self.decode_s)]:
            Gauge(name, doc, registry=r).set_function(value)

    @property
    def depth(self) -> int:
        """Requests running, waiting for the engine or being prepared."""
        return len(self.tickets) + self.admitting

    def cost(self, job: dict) -> float:
        """Estimated engine seconds of a prepared job (prompt tokens not in a warm session, answer)."""
        new = job["prompt_tokens"] - self.chat.cache.peek(*self.chat.prompt_key(job))
        return max(0, new) * self.prefill_s + min(job["max_tokens"], self.answer_tokens) * self.decode_s

    def ahead_s(self) -> float:
        """Estimated seconds until the engine has finished the requests admitted so far."""
        now = time.monotonic()
        # a request running past its estimate counts nothing more (not less than nothing)
        return sum(max(0.0, t.cost_s - (now - t.started if t.started is not None else 0.0)) for t in self.tickets
                   if not t.dropped and not t.gone.is_set()) if self.tickets else 0.0

    def retry_after(self) -> int:
        """Whole seconds after which the engine should have room again (Retry-After), at least 1."""
        return max(1, math.ceil(self.ahead_s()))

    def prepare(self, body: bytes) -> tuple["ChatCompletionRequest", dict, float]:
        """Parse, validate and tokenize a request body (on the preparation thread).

        Returns:
            (the request, its job for `ChatEngine.complete`, its estimated engine seconds).
        Raises:
            ChatError: the body is not JSON, not a valid request (`param` names the field), or
                does not fit (see `ChatEngine.prepare`).
        """
        try:
            req = ChatCompletionRequest.model_validate(json.loads(body))
        except ValueError as exc:  # not JSON (json.JSONDecodeError, UnicodeDecodeError), or not a request
            if not isinstance(exc, ValidationError):
                raise ChatError(f"body: not valid JSON: {exc}") from None
            first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            raise ChatError(f"{param or 'body'}: {first.get('msg')}", param) from None
        except RecursionError:
            raise ChatError("body: nested too deeply") from None
        job = self.chat.prepare(req.model_dump(exclude_none=True))
        return req, job, self.cost(job)

    def run(self, job: dict, ticket: Ticket, on_text) -> ChatResult | None:
        """Answer on the engine thread (None: dropped or gone before it started); count the outcome."""
        if not ticket.start():
            self.m_dropped.labels("queue").inc()
            return None
        result = self.chat.complete(job, ticket.deadline_at, on_text, ticket.gone.is_set)
        self.m_requests.labels(result.finish_reason).inc()
        if result.detail["reason"] in ("cancelled", "deadline"):
            self.m_dropped.labels(result.detail["reason"]).inc()
        if result.decision.generated_tokens or result.decision.forced_tokens:
            self.m_ttft.observe(result.timings["ttft_ms"] / 1e3)
        self._learn(result)
        return result

    def _learn(self, result: ChatResult) -> None:
        # moving averages of the measured rates (engine thread; floats: the event loop reads them whole)
        t, a = result.timings, 0.3
        if t["prefill_tokens"] >= 128:  # shorter ones are mostly fixed costs (a new session, a first forward)
            rate = t["prefill_ms"] / 1e3 / t["prefill_tokens"]
            self.prefill_s = rate if not self.prefill_s else self.prefill_s + a * (rate - self.prefill_s)
        n = result.usage["completion_tokens"]
        if n:
            rate = (t["total_ms"] - t["prefill_ms"]) / 1e3 / n
            self.decode_s = rate if not self.decode_s else self.decode_s + a * (rate - self.decode_s)
            self.answer_tokens += a * (n - self.answer_tokens)


# ---------------------------------------------------------------- HTTP


class _Refusal(Exception):
    # an HTTP error answer decided before the engine: (status, message, param, type, code, headers)
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.args_ = (status, message, param, kind, code, headers)


def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def _error_event(exc: BaseException) -> str:
    # the SSE data of an error that ends a stream
    if isinstance(exc, ChatError):
        body = {"message": str(exc), "type": "invalid_request_error", "param": exc.param, "code": exc.code}
    else:
        body = {"message": f"internal error: {type(exc).__name__}", "type": "server_error", "param": None,
                "code": None}
    return json.dumps({"error": body})


async def _read_body(request, limit: int) -> bytes:
    # the body, refused with 413 once it is over `limit` bytes (by its Content-Length, or as it arrives)
    size = request.headers.get("content-length")
    too_big = _Refusal(413, f"the request body is larger than the limit of {limit} bytes", None,
                       code="request_too_large")
    if size is not None and size.isdigit() and int(size) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)


async def _warm(app, server: Server) -> None:
    # Pays before serving the one-time costs a first request would otherwise pay on the event
    # loop, stalling every other client meanwhile (40-110 ms measured on a loaded machine): the
    # executors start their threads on their first job (`Thread.start` waits until the new thread
    # runs), FastAPI reads each endpoint's source on its first call, and the first stream's
    # response imports anyio's asyncio backend, and the engine builds its grammar tokenizer on the first
    # request with tools or a response format (`Engine.ll_tokenizer`, 0.1-0.3 s). One call per route;
    # the chat route's empty body is refused by `Server.prepare` (400) and reaches no engine.
    import anyio

    anyio.Event()
    loop = asyncio.get_running_loop()
    engine = server.chat.engine
    await asyncio.gather(loop.run_in_executor(server.executor, lambda: engine.ll_tokenizer),
                         loop.run_in_executor(server.prep, int))

    async def ignore(message) -> None:
        pass

    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method == "HEAD":
                continue
            body = [{"type": "http.request", "body": b"{}", "more_body": False}]
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                     "scheme": "http", "path": route.path, "raw_path": route.path.encode(), "root_path": "",
                     "query_string": b"", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
            await app(scope, lambda: _next(body), ignore)
    # What exists now (the model, the libraries, the app) lives as long as the process: frozen, it is
    # out of the cyclic collector's sight. Otherwise every full collection walks it all holding the
    # GIL, and the loop with it: ~210,000 objects, 110 ms of CPU here (/health took 0.4-1.1 s, loaded).
    gc.collect()
    gc.freeze()


async def _next(messages: list) -> dict:
    # an ASGI receive() over a list of messages; then the client has gone
    return messages.pop(0) if messages else {"type": "http.disconnect"}


async def _until_disconnected(receive) -> None:
    # returns when the client has gone (after the body was read, the next message is the disconnect)
    while (await receive())["type"] != "http.disconnect":
        pass


def _chunk(base: dict, delta: dict, finish=None, usage=None, detail=None) -> str:
    # one chat.completion.chunk of a stream (`base`: id, created, model...); with `usage`, the
    # usage chunk (no choices)
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    if detail is not None:
        choice["tokenspeed_finish"] = detail
    body = {**base, "object": "chat.completion.chunk", "choices": [choice]}
    if usage is not None:
        body["choices"], body["usage"] = [], usage
    return json.dumps(body)


def _last_chunks(base: dict, result: ChatResult, req: ChatCompletionRequest) -> list[str]:
    # the chunks that end a streamed answer after its text: its tool calls, its finish, the usage if asked
    out = [_chunk(base, {"tool_calls": [dict(call, index=i)]}) for i, call in
           enumerate(result.message.get("tool_calls") or ())]
    out.append(_chunk(base, {}, result.finish_reason, detail=result.detail))
    if req.stream_options is not None and req.stream_options.include_usage:
        out.append(_chunk(base, {}, usage=result.usage))
    return out


class _Guard:
    """ASGI middleware: an exception that escapes the app becomes an OpenAI-shaped 500 (when no
    response has started) and is logged with its traceback; never a plain-text 500."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await _error(500, f"internal error: {type(exc).__name__}", None, "server_error")(scope, receive, send)


def create_app(server: Server):
    """The FastAPI application: GET /v1/models, POST /v1/chat/completions, GET /metrics, GET /health."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import Response
    from sse_starlette.sse import EventSourceResponse

    @asynccontextmanager
    async def lifespan(app):
        await _warm(app, server)
        yield

    app = FastAPI(title="TokenSpeed", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(_Guard)

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(request, exc: StarletteHTTPException):
        # what the framework refuses itself (unknown path or method), in OpenAI's shape
        return _error(exc.status_code, str(exc.detail), None, headers=exc.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "tokenspeed"}]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    def full_queue(why: str):
        server.m_rejected.inc()
        return _error(429, why, None, "rate_limit_error", headers={"Retry-After": str(server.retry_after())})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrived = time.monotonic()
        if len(server.tickets) >= server.queue_size + 1:  # the running one and queue_size waiting: refused at once
            return full_queue(f"the engine queue is full ({server.queue_size} waiting); retry later")
        if server.admitting >= PREPARE_QUEUE:
            return full_queue(f"{PREPARE_QUEUE} requests are being read and prepared; retry later")
        loop = asyncio.get_running_loop()
        server.admitting += 1
        try:
            body = await _read_body(request, server.max_body_bytes)
            req, job, cost = await loop.run_in_executor(server.prep, server.prepare, body)
        except _Refusal as exc:
            return _error(*exc.args_)
        except ChatError as exc:
            return _error(400, str(exc), exc.param, code=exc.code)
        finally:
            server.admitting -= 1
        deadline_at = arrived + req.deadline_ms / 1e3 if req.deadline_ms else None
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        base = {"id": rid, "created": int(time.time()), "model": server.model_name, "system_fingerprint": "tokenspeed"}
        # refused by estimates only when half of what they predict is already too late
        prefill = ADMISSION_SAFETY * max(0.0, cost - min(job["max_tokens"], server.answer_tokens) * server.decode_s)
        if deadline_at is not None and time.monotonic() + prefill > deadline_at:
            # passed already, or not even the prompt's prefill fits: the deadline reason at once, no engine time
            why = "the deadline passed while the request was read and prepared" if time.monotonic() >= deadline_at \
                else f"cannot be met: its prefill alone takes about {prefill / ADMISSION_SAFETY * 1e3:.0f} ms here"
            server.m_dropped.labels("admission").inc()
            stopped = server.chat.stopped(job, time.monotonic(), why)
            if not req.stream:
                return completion(base, stopped)

            async def stopped_stream():  # a stream all the same: the role, the finish, [DONE]
                for data in [_chunk(base, {"role": "assistant", "content": ""}), *_last_chunks(base, stopped, req),
                             "[DONE]"]:
                    yield {"data": data}

            return EventSourceResponse(stopped_stream(), ping=600)
        if deadline_at is not None and time.monotonic() + ADMISSION_SAFETY * server.ahead_s() + prefill > deadline_at:
            return full_queue(f"deadline_ms={req.deadline_ms:g} cannot be met behind the {len(server.tickets)} "
                              f"requests ahead (about {server.ahead_s() * 1e3:.0f} ms of work); retry later")
        if len(server.tickets) >= server.queue_size + 1:  # filled while this one was prepared
            return full_queue(f"the engine queue is full ({server.queue_size} waiting); retry later")
        ticket = Ticket(deadline_at, cost)
        server.tickets.add(ticket)
        events: asyncio.Queue = asyncio.Queue()

        def on_text(piece: str) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("text", piece))

        future = loop.run_in_executor(server.executor, server.run, job, ticket, on_text if req.stream else None)
        future.add_done_callback(lambda _: server.tickets.discard(ticket))

        async def answer() -> ChatResult | None:
            # the engine's result; the deadline reason at once if the deadline passes while queued
            while True:
                timeout = None
                if deadline_at is not None and ticket.started is None:
                    timeout = max(0.0, deadline_at - time.monotonic())
                done, _ = await asyncio.wait({future}, timeout=timeout)
                if done:
                    return future.result() or server.chat.stopped(job, deadline_at, "dropped in the queue")
                # uvloop rounds timers to whole milliseconds, so the wait may end just before the
                # deadline: drop only once it has passed
                if deadline_at is not None and time.monotonic() >= deadline_at and ticket.drop():
                    return server.chat.stopped(job, deadline_at, "the deadline passed in the queue")

        if not req.stream:
            watch = asyncio.ensure_future(_until_disconnected(request.receive))
            work = asyncio.ensure_future(answer())
            try:
                await asyncio.wait({watch, work}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
            if not work.done():  # the client has gone: the engine drops or stops the request
                ticket.gone.set()
                work.cancel()
                return Response(status_code=204)
            try:
                return completion(base, work.result())
            except ChatError as exc:  # found only on the engine (a template that renders differently there)
                return _error(400, str(exc), exc.param, code=exc.code)

        async def stream():
            work = asyncio.ensure_future(answer())
            work.add_done_callback(lambda _: events.put_nowait(("done", None)))
            try:
                yield {"data": _chunk(base, {"role": "assistant", "content": ""})}
                while (event := await events.get())[0] == "text":
                    yield {"data": _chunk(base, {"content": event[1]})}
                try:
                    result = work.result()
                except Exception as exc:
                    if not isinstance(exc, ChatError):
                        log.error("unexpected error answering %s", rid, exc_info=exc)
                    yield {"data": _error_event(exc)}
                else:
                    for data in _last_chunks(base, result, req):
                        yield {"data": data}
                yield {"data": "[DONE]"}
            finally:  # the client has gone (the generator is closed) or the stream ended
                ticket.gone.set()

        return EventSourceResponse(stream(), ping=600)

    def completion(base: dict, result: ChatResult) -> dict:
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": result.message, "finish_reason": result.finish_reason,
                             "logprobs": None, "tokenspeed_finish": result.detail}],
                "usage": result.usage, "tokenspeed": result.timings}

    return app


def listen(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: any free port), for `serve`.

    Bound before the model loads, so a port in use fails at once.

    Raises:
        OSError: the address cannot be bound (e.g. errno EADDRINUSE: the port is in use).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: no wait after TIME_WAIT
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve(engine: Engine, sock: socket.socket, model_name: str = "tokenspeed", queue_size: int = 8,
          cache_budget_bytes: int = 1 << 30, context: int = 4096, max_body_bytes: int = 8 << 20) -> None:
    """Serve `engine` over HTTP on the listening socket `sock` (from `listen`) until SIGINT or SIGTERM,
    then shut down gracefully, print one line and return (see `Server` for the other arguments)."""
    import uvicorn

    host, port = sock.getsockname()[:2]

    class _Announced(uvicorn.Server):
        # Says "serving on" once the app started on the socket, not before.
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                print(f"# tokenspeed serve: model {engine.source} serving on http://{host}:{port}/v1", flush=True)

        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again, which ends
        # the process with a KeyboardInterrupt traceback (SIGINT) or killed (SIGTERM): the graceful
        # shutdown is the end here, one line and exit 0
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    if self._captured_signals:
                        name = signal.Signals(self._captured_signals[0]).name
                        print(f"# tokenspeed serve: stopped ({name})", flush=True)
                    self._captured_signals.clear()

    server = Server(engine, model_name, queue_size, cache_budget_bytes, context, max_body_bytes)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the process is the server's
    _Announced(uvicorn.Config(create_app(server), log_level="warning")).run(sockets=[sock])
