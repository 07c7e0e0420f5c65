"""`tokenspeed serve`: an OpenAI-compatible HTTP server (chat completions) over one resident engine.

FastAPI + uvicorn, request bodies validated by pydantic, streaming as server-sent events
(sse-starlette) in OpenAI's chunk format, metrics in Prometheus text format (prometheus-client).
The answers, warm sessions included, come from `tokenspeed.chat.ChatEngine`.

One engine, one stream: requests run one at a time on a single engine thread; at most
`queue_size` wait behind the running one and the next is answered 429 at once.

Source: OpenAI Chat Completions API reference (request, response, chunk and error objects).
"""
import asyncio
import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatEngine, ChatError
from .engine import Engine

__all__ = ["ChatCompletionRequest", "Server", "create_app", "listen", "serve"]


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
        answer ends with finish_reason "deadline" and no call.
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
    deadline_ms: float | None = Field(default=None, gt=0)


class Server:
    """The HTTP side's state: the `ChatEngine`, its single engine thread, the queue bound and metrics.

    Args:
        engine: the resident `Engine`.
        model_name: the id /v1/models reports.
        queue_size: requests that may wait behind the running one (more -> 429).
        cache_budget_bytes: KV bytes the conversation cache may hold.
        context: KV capacity of each conversation in tokens.
    """

    def __init__(self, engine: Engine, model_name: str, queue_size: int = 8,
                 cache_budget_bytes: int = 1 << 30, context: int = 4096):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.chat = ChatEngine(engine, context, cache_budget_bytes)
        self.model_name = model_name
        self.queue_size = queue_size
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenspeed-engine")
        self.waiting = 0  # requests admitted and not finished (the running one included); event loop only
        self.registry = r = CollectorRegistry()
        self.m_requests = Counter("tokenspeed_requests", "chat completion requests by finish reason",
                                  ["finish_reason"], registry=r)
        self.m_rejected = Counter("tokenspeed_queue_rejections", "requests answered 429 (queue full)", registry=r)
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
                ("tokenspeed_queue_depth", "requests running or waiting", lambda: self.waiting)]:
            Gauge(name, doc, registry=r).set_function(value)

    def run(self, job: dict, deadline_at: float | None, on_text):
        """Answer on the engine thread; count the outcome."""
        result = self.chat.complete(job, deadline_at, on_text)
        self.m_requests.labels(result.finish_reason).inc()
        if result.decision.generated_tokens or result.decision.forced_tokens:
            self.m_ttft.observe(result.timings["ttft_ms"] / 1e3)
        return result


# ---------------------------------------------------------------- HTTP


def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


def create_app(server: Server):
    """The FastAPI application: GET /v1/models, POST /v1/chat/completions, GET /metrics, GET /health."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import Response
    from sse_starlette.sse import EventSourceResponse

    app = FastAPI(title="TokenSpeed", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
        # a body that is not JSON at all is located at its character offset: name no field then
        loc = [] if first.get("type") == "json_invalid" else [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return _error(400, f"{param or 'body'}: {first.get('msg')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(request, exc: StarletteHTTPException):
        # what the framework refuses itself (a body it cannot parse, unknown path or method), in OpenAI's shape
        response = _error(exc.status_code, str(exc.detail), None)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(ChatError)
    async def refused(request, exc: ChatError):
        return _error(400, str(exc), exc.param)

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

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        arrived = time.monotonic()
        deadline_at = arrived + req.deadline_ms / 1e3 if req.deadline_ms else None
        job = server.chat.prepare(req.model_dump(exclude_none=True))
        if server.waiting > server.queue_size:
            server.m_rejected.inc()
            return _error(429, f"the engine queue is full ({server.queue_size} waiting); retry later", None,
                          "rate_limit_error")
        server.waiting += 1
        loop = asyncio.get_running_loop()
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        base = {"id": rid, "created": created, "model": server.model_name, "system_fingerprint": "tokenspeed"}
        if not req.stream:
            try:
                result = await loop.run_in_executor(server.executor, server.run, job, deadline_at, None)
            finally:
                server.waiting -= 1
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": result.message, "finish_reason": result.finish_reason,
                                 "logprobs": None}],
                    "usage": result.usage, "tokenspeed": result.timings}

        events: asyncio.Queue = asyncio.Queue()

        def on_text(piece: str) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("text", piece))

        def finished(future) -> None:  # runs on the event loop
            server.waiting -= 1
            events.put_nowait(("done", future))

        loop.run_in_executor(server.executor, server.run, job, deadline_at, on_text).add_done_callback(finished)

        def chunk(delta: dict, finish=None, usage=None) -> str:
            body = {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            if usage is not None:
                body["choices"], body["usage"] = [], usage
            return json.dumps(body)

        async def stream():
            yield {"data": chunk({"role": "assistant", "content": ""})}
            while True:
                kind, value = await events.get()
                if kind == "text":
                    yield {"data": chunk({"content": value})}
                    continue
                try:
                    result = value.result()
                except ChatError as exc:
                    yield {"data": json.dumps({"error": {"message": str(exc), "type": "invalid_request_error",
                                                         "param": exc.param, "code": None}})}
                    break
                for i, call in enumerate(result.message.get("tool_calls") or ()):
                    yield {"data": chunk({"tool_calls": [dict(call, index=i)]})}
                yield {"data": chunk({}, result.finish_reason)}
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield {"data": chunk({}, usage=result.usage)}
                break
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), ping=600)

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
          cache_budget_bytes: int = 1 << 30, context: int = 4096) -> None:
    """Serve `engine` over HTTP on the listening socket `sock` (from `listen`) until interrupted
    (see `Server` for the other arguments)."""
    import uvicorn

    host, port = sock.getsockname()[:2]

    class _Announced(uvicorn.Server):
        # Says "serving on" once the app started on the socket, not before.
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                print(f"# tokenspeed serve: model {engine.source} serving on http://{host}:{port}/v1", flush=True)

    server = Server(engine, model_name, queue_size, cache_budget_bytes, context)
    _Announced(uvicorn.Config(create_app(server), log_level="warning")).run(sockets=[sock])
