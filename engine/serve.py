"""`tokenspeed serve`: an OpenAI-compatible HTTP server (chat completions) over one resident engine.

FastAPI + uvicorn, request bodies validated by pydantic, streaming as server-sent events
(sse-starlette) in OpenAI's chunk format, metrics in Prometheus text format (prometheus-client).

One engine, one stream: requests run one at a time on a single engine thread; at most
`queue_size` wait behind the running one and the next is answered 429 at once. Warm sessions
without client changes: a `ConversationCache` keeps the `Session` of each recent conversation
keyed by its messages; a request whose messages extend a cached conversation continues that
session (longest cached prefix), so only the new messages are prefilled. Sessions are evicted
least-recently-used to stay within a KV-cache memory budget.

Source: OpenAI Chat Completions API reference (request, response, chunk and error objects).
"""
import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .grammar import ToolSchemaError, format_tool_calls, normalize_tools
from .session import Checkpoint, Decision, Engine, Session

__all__ = ["ChatCompletionRequest", "ConversationCache", "Server", "create_app", "serve"]


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

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


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


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, message and the field (param)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


# ---------------------------------------------------------------- warm sessions


def _message_key(m: Message) -> str:
    # What identifies a message for conversation reuse: role, text and calls (ids are ignored:
    # clients invent their own).
    calls = [[c.function.name, _parse_arguments(c.function.arguments)] for c in m.tool_calls or ()]
    return json.dumps([m.role, m.text(), calls], sort_keys=True)


def _content(m: Message) -> str:
    # The text a message puts in the context: its calls in the grammar's format, or its text.
    if m.tool_calls:
        return format_tool_calls([{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                                  for c in m.tool_calls])
    return m.text()


def _parse_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise RequestError(400, f"tool call arguments are not JSON: {arguments[:80]!r}", "messages")


@dataclass
class _Entry:
    prefix: str                     # system text + tools: sessions are only shared within one
    messages: list[str]             # `_message_key` of each message after the system one
    checkpoints: list[Checkpoint]   # session state after the system prompt and after each message
    session: Session
    nbytes: int


class ConversationCache:
    """Sessions of recent conversations, reused by the longest cached message prefix.

    Each entry keeps a checkpoint after every message, so a request that shares only the first
    messages of a cached conversation (a retry, a branch, a new conversation with the same
    system prompt and tools) continues it from there: the session is rolled back to the longest
    common prefix (the entry's later messages are dropped). A session is taken out while a
    request uses it and put back afterwards. Least-recently-used sessions are evicted while the
    KV bytes held exceed `budget_bytes`.

    Attributes:
        budget_bytes: KV-cache memory budget in bytes.
        hits, misses, evictions: counters; cached_tokens: context tokens reused by hits.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.hits = self.misses = self.evictions = self.cached_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, prefix: str, messages: list[str]) -> tuple[Session | None, list[Checkpoint]]:
        """Remove the session sharing the longest message prefix with `messages`, rolled back to it.

        Returns:
            (session, checkpoints up to the shared prefix: the last one is its current state),
            or (None, []) on a miss (no cached session with this system prompt and tools).
        """
        best, best_n = None, -1
        for key, e in self._entries.items():
            if e.prefix != prefix:
                continue
            n = 0
            while n < min(len(e.messages), len(messages)) and e.messages[n] == messages[n]:
                n += 1
            if n > best_n or (n == best_n and len(e.messages) == n):  # prefer an exact extension
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return None, []
        e = self._entries.pop(best)
        checkpoints = e.checkpoints[:best_n + 1]
        e.session.rollback(checkpoints[-1])
        self.hits += 1
        self.cached_tokens += checkpoints[-1].n_tokens + len(checkpoints[-1].pending)
        return e.session, checkpoints

    def put(self, prefix: str, messages: list[str], checkpoints: list[Checkpoint], session: Session) -> None:
        """Store `session` as the conversation `messages` (checkpoints: one more than messages);
        evict least-recently-used sessions beyond the budget."""
        cache = session.cache
        nbytes = sum(int(t.nbytes) for t in (getattr(cache, "k", None), getattr(cache, "v", None)) if t is not None)
        self._entries[self._next] = _Entry(prefix, list(messages), list(checkpoints), session, nbytes)
        self._next += 1
        while len(self._entries) > 1 and self.nbytes > self.budget_bytes:
            self._entries.popitem(last=False)
            self.evictions += 1


# ---------------------------------------------------------------- the engine side of a request


class _StopFilter:
    """Cuts text at the first stop sequence; holds back a tail that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add a piece; return the text now safe to send."""
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.text = True, self.text[:cut]
            safe = cut
        else:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            safe = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _response_schema(fmt: dict | None) -> dict | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError(400, "response_format.json_schema.schema must be a JSON schema object",
                               "response_format.json_schema.schema")
        return spec["schema"]
    raise RequestError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}",
                       "response_format.type")


class Server:
    """The engine side: one engine thread, the request queue and the conversation cache.

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

        self.engine = engine
        self.model_name = model_name
        self.queue_size = queue_size
        self.context = context
        self.cache = ConversationCache(cache_budget_bytes)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenspeed-engine")
        self.waiting = 0  # requests admitted and not finished (the running one included)
        self.registry = r = CollectorRegistry()
        self.m_requests = Counter("tokenspeed_requests", "chat completion requests by outcome", ["finish_reason"],
                                  registry=r)
        self.m_rejected = Counter("tokenspeed_queue_rejections", "requests answered 429 (queue full)", registry=r)
        self.m_hits = Gauge("tokenspeed_cache_hits", "requests that continued a cached conversation", registry=r)
        self.m_misses = Gauge("tokenspeed_cache_misses", "requests that started a new session", registry=r)
        self.m_evictions = Gauge("tokenspeed_cache_evictions", "sessions evicted (LRU, memory budget)", registry=r)
        self.m_cached_tokens = Gauge("tokenspeed_cache_reused_tokens", "context tokens reused from cache", registry=r)
        self.m_sessions = Gauge("tokenspeed_cache_sessions", "conversations held", registry=r)
        self.m_bytes = Gauge("tokenspeed_cache_bytes", "KV bytes held by cached conversations", registry=r)
        self.m_queue = Gauge("tokenspeed_queue_depth", "requests running or waiting", registry=r)
        self.m_ttft = Histogram("tokenspeed_ttft_seconds", "request start on the engine -> first token", registry=r,
                                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self._lock = threading.Lock()

    def metrics_text(self) -> bytes:
        """Prometheus text exposition of the server's metrics."""
        from prometheus_client import generate_latest

        c = self.cache
        with self._lock:
            self.m_hits.set(c.hits)
            self.m_misses.set(c.misses)
            self.m_evictions.set(c.evictions)
            self.m_cached_tokens.set(c.cached_tokens)
            self.m_sessions.set(len(c))
            self.m_bytes.set(c.nbytes)
        self.m_queue.set(self.waiting)
        return generate_latest(self.registry)

    def prepare(self, req: ChatCompletionRequest) -> dict:
        """Validate what pydantic cannot (tools, tool_choice, response_format) before queueing.

        Raises:
            RequestError: 400 naming the field.
        """
        try:
            tools = normalize_tools(req.tools)
        except ToolSchemaError as exc:
            raise RequestError(400, str(exc), "tools") from None
        schema = _response_schema(req.response_format)
        if schema is not None:
            try:
                self.engine.json_grammar(schema)
            except ToolSchemaError as exc:
                raise RequestError(400, str(exc), "response_format") from None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise RequestError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
        if choice != "none":
            try:
                self.engine.grammar(tools, choice, req.parallel_tool_calls)
            except ToolSchemaError as exc:
                raise RequestError(400, str(exc), "tool_choice") from None
        first_is_system = req.messages[0].role in ("system", "developer")
        rest = req.messages[1:] if first_is_system else req.messages
        for i, m in enumerate(rest):
            for c in m.tool_calls or ():
                _parse_arguments(c.function.arguments)
            if m.role == "assistant" and not m.text() and not m.tool_calls:
                raise RequestError(400, f"messages[{i + first_is_system}]: an assistant message needs content or "
                                        "tool_calls", f"messages[{i + first_is_system}].content")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return {"tools": tools, "choice": choice, "schema": schema, "system": req.messages[0].text() if first_is_system else None,
                "messages": rest, "stops": stops, "max_tokens": req.max_completion_tokens or req.max_tokens or 256}

    def run(self, req: ChatCompletionRequest, job: dict, deadline_at: float | None, on_text) -> dict:
        """Answer one request on the engine thread.

        Args:
            on_text: callback(str) for streamed text pieces (None when not streaming).
        Returns:
            {"decision", "message", "finish_reason", "usage", "timings"}.
        """
        t0 = time.perf_counter()
        prefix = json.dumps([job["system"], job["tools"]], sort_keys=True)
        keys = [_message_key(m) for m in job["messages"]]
        with self._lock:
            session, checkpoints = self.cache.take(prefix, keys)
        cached_tokens = session.num_tokens if session is not None else 0
        if session is None:
            session = self.engine.session(system=job["system"], tools=job["tools"], capacity=self.context)
            checkpoints = [session.checkpoint()]
        try:
            for m in job["messages"][len(checkpoints) - 1:]:  # one at a time: a checkpoint after each
                session.observe([{"role": "system" if m.role == "developer" else m.role, "content": _content(m)}])
                checkpoints.append(session.checkpoint())
        except ValueError as exc:
            raise RequestError(400, f"messages do not fit the context of {self.context} tokens: {exc}", "messages")
        prompt_tokens = session.num_tokens
        t_prefill = time.perf_counter() - t0
        stop = _StopFilter(job["stops"])
        pieces: list[str] = []

        def text_piece(piece: str) -> bool:
            out = stop.feed(piece)
            if out:
                pieces.append(out)
                if on_text is not None:
                    on_text(out)
            return stop.stopped

        d: Decision = session.decide(
            tool_choice=job["choice"] if job["schema"] is None else "none", deadline_at=deadline_at,
            max_tokens=job["max_tokens"], parallel=req.parallel_tool_calls, response_format=job["schema"],
            temperature=req.temperature, top_p=req.top_p, seed=req.seed, on_text=text_piece)
        if d.status == "text" and not stop.stopped:
            tail = stop.flush()
            if tail and on_text is not None:
                on_text(tail)
        message = d.openai_message([f"call_{uuid.uuid4().hex[:24]}" for _ in d.tool_calls])
        finish = d.finish_reason
        if d.status == "text":
            message["content"] = stop.text
            if stop.stopped:
                finish = "stop"
        answer_key = None
        if d.status == "ok" or (d.status == "text" and not stop.stopped):
            answer_key = _message_key(Message(**message))
        elif d.status == "text":
            session.rollback(checkpoints[-1])  # the context holds more than the client will send back
        if answer_key:
            checkpoints.append(session.checkpoint())
        with self._lock:
            self.cache.put(prefix, keys + ([answer_key] if answer_key else []), checkpoints, session)
        ttft = t_prefill + d.ttft_s
        if d.generated_tokens or d.forced_tokens:
            self.m_ttft.observe(ttft)
        self.m_requests.labels(finish).inc()
        completion = d.generated_tokens + d.forced_tokens
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        timings = {"ttft_ms": ttft * 1e3, "prefill_ms": t_prefill * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3,
                   "cached_tokens": cached_tokens, "prefill_tokens": prompt_tokens - cached_tokens,
                   "status": d.status, "reason": d.reason}
        return {"decision": d, "message": message, "finish_reason": finish, "usage": usage, "timings": timings}


# ---------------------------------------------------------------- HTTP


def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


def create_app(server: Server):
    """The FastAPI application: GET /v1/models, POST /v1/chat/completions, GET /metrics, GET /health."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
    from sse_starlette.sse import EventSourceResponse

    app = FastAPI(title="TokenSpeed", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return _error(400, f"{param or 'body'}: {first.get('msg')}", param)

    @app.exception_handler(RequestError)
    async def refused(request, exc: RequestError):
        return _error(exc.status, exc.message, exc.param, exc.kind)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "tokenspeed"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        arrived = time.monotonic()
        deadline_at = arrived + req.deadline_ms / 1e3 if req.deadline_ms else None
        job = server.prepare(req)
        if server.waiting > server.queue_size:
            server.m_rejected.inc()
            raise RequestError(429, f"the engine queue is full ({server.queue_size} waiting); retry later",
                               None, "rate_limit_error")
        server.waiting += 1
        loop = asyncio.get_running_loop()
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        base = {"id": rid, "created": created, "model": server.model_name, "system_fingerprint": "tokenspeed"}
        if not req.stream:
            try:
                result = await loop.run_in_executor(server.executor, server.run, req, job, deadline_at, None)
            finally:
                server.waiting -= 1
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": result["message"], "finish_reason": result["finish_reason"],
                                 "logprobs": None}],
                    "usage": result["usage"], "tokenspeed": result["timings"]}

        events: asyncio.Queue = asyncio.Queue()

        def on_text(piece: str) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("text", piece))

        def finished(future) -> None:  # runs on the event loop
            server.waiting -= 1
            events.put_nowait(("done", future))

        loop.run_in_executor(server.executor, server.run, req, job, deadline_at, on_text).add_done_callback(finished)

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
                except RequestError as exc:
                    yield {"data": json.dumps({"error": {"message": exc.message, "type": exc.kind,
                                                         "param": exc.param, "code": None}})}
                    break
                for i, call in enumerate(result["message"].get("tool_calls") or ()):
                    yield {"data": chunk({"tool_calls": [dict(call, index=i)]})}
                yield {"data": chunk({}, result["finish_reason"])}
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield {"data": chunk({}, usage=result["usage"])}
                break
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), ping=600)

    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, model_name: str = "tokenspeed",
          queue_size: int = 8, cache_budget_bytes: int = 1 << 30, context: int = 4096) -> None:
    """Serve `engine` over HTTP until interrupted (see `Server` for the arguments)."""
    import uvicorn

    server = Server(engine, model_name, queue_size, cache_budget_bytes, context)
    print(f"# tokenspeed serve: model {engine.source} on http://{host}:{port}/v1", flush=True)
    uvicorn.run(create_app(server), host=host, port=port, log_level="warning")
