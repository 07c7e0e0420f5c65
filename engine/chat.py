"""OpenAI-shaped chat completions over warm sessions, in process (used by `tokenspeed serve` and LangChain).

`ChatEngine.complete()` takes a request as OpenAI's chat-completions body (messages as dicts)
and answers it on a `Session`. A `ConversationCache` keeps the session of each recent
conversation keyed by its messages, with a checkpoint after every message: a request whose
messages extend (or share a prefix with) a cached conversation continues that session from
the longest shared prefix, so a framework that resends the whole history each turn pays only
for the new messages. Sessions are evicted least-recently-used to stay within a KV budget.

Source: OpenAI Chat Completions API reference (messages, tools, tool_choice, response_format).
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from .grammar import CallFormat, ToolSchemaError, format_tool_calls, normalize_tools
from .engine import Engine
from .session import Checkpoint, Decision, Session

__all__ = ["ChatError", "ChatEngine", "ConversationCache"]

_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(ValueError):
    """A chat request that cannot be answered as asked; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def message_text(m: dict) -> str:
    """A message's text: its content string, or its {"type": "text"} parts joined."""
    content = m.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def _calls(m: dict, where: str) -> list[dict]:
    # [{"name", "arguments": dict}] of an assistant message's OpenAI tool_calls.
    out = []
    for j, c in enumerate(m.get("tool_calls") or ()):
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            raise ChatError(f"{where}.tool_calls[{j}]: arguments are not a JSON string", f"{where}.tool_calls")
        out.append({"name": fn.get("name"), "arguments": args})
    return out


def _message_key(m: dict) -> str:
    # What identifies a message for conversation reuse: role, text and calls (call ids are not:
    # clients make up their own).
    return json.dumps([m["role"], message_text(m), _calls(m, "message")], sort_keys=True)


def _context_message(m: dict, fmt: CallFormat) -> dict:
    # The message as the session renders it: calls in the family's format `fmt` (as its grammar
    # writes them), developer as system.
    calls = _calls(m, "message")
    return {"role": "system" if m["role"] == "developer" else m["role"],
            "content": format_tool_calls(calls, fmt) if calls else message_text(m)}


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
        self.cached_tokens += e.session.num_tokens
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
            raise ChatError("response_format.json_schema.schema must be a JSON schema object",
                            "response_format.json_schema.schema")
        return spec["schema"]
    raise ChatError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}",
                    "response_format.type")


@dataclass
class ChatResult:
    """The answer to one chat request.

    Attributes:
        decision: the `Decision` of the answer.
        message: OpenAI assistant message {"role", "content", "tool_calls"?} (content cut at a
            stop sequence).
        finish_reason: "tool_calls", "stop", "length", "deadline" or "invalid".
        usage: {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
            {"cached_tokens"}} (cached_tokens: context reused from a warm session).
        timings: {"ttft_ms" (request start on the engine -> first token, prefill of new
            messages included), "prefill_ms", "total_ms", "cached_tokens", "prefill_tokens"}.
    """

    decision: Decision
    message: dict
    finish_reason: str
    usage: dict
    timings: dict


class ChatEngine:
    """Chat completions on one `Engine` with warm sessions. Thread-safe by a lock: one answer at a time.

    Args:
        engine: the resident `Engine`.
        context: KV capacity of each conversation, tokens.
        cache_budget_bytes: KV bytes the conversation cache may hold.
    """

    def __init__(self, engine: Engine, context: int = 4096, cache_budget_bytes: int = 1 << 30):
        self.engine = engine
        self.context = context
        self.cache = ConversationCache(cache_budget_bytes)
        self.lock = threading.Lock()

    def prepare(self, request: dict) -> dict:
        """Validate a request (OpenAI body: messages, tools, tool_choice, parallel_tool_calls,
        response_format, max_tokens/max_completion_tokens, temperature, top_p, seed, stop) and
        compile its grammar; cheap enough to run before queueing.

        Returns:
            the job for `complete()`.
        Raises:
            ChatError: the message names the problem, `param` the field.
        """
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise ChatError(f"messages[{i}].role must be one of {list(_ROLES)}", f"messages.{i}.role")
            calls = _calls(m, f"messages[{i}]")
            if m["role"] == "assistant" and not message_text(m) and not calls:
                raise ChatError(f"messages[{i}]: an assistant message needs content or tool_calls",
                                f"messages.{i}.content")
        try:
            tools = normalize_tools(request.get("tools"))
        except ToolSchemaError as exc:
            raise ChatError(str(exc), "tools") from None
        schema = _response_schema(request.get("response_format"))
        if schema is not None:
            try:
                self.engine.json_grammar(schema)
            except ToolSchemaError as exc:
                raise ChatError(str(exc), "response_format") from None
        choice = request.get("tool_choice")
        choice = choice if choice is not None else ("auto" if tools else "none")
        parallel = bool(request.get("parallel_tool_calls", True))
        if choice != "none":
            if not tools:
                raise ChatError(f"tool_choice {choice!r} needs tools", "tool_choice")
            try:
                self.engine.grammar(tools, choice, parallel)
            except ToolSchemaError as exc:
                raise ChatError(str(exc), "tool_choice") from None
        system = messages[0]["role"] in ("system", "developer")
        stop = request.get("stop")
        return {"system": message_text(messages[0]) if system else None, "messages": messages[system:],
                "tools": tools, "choice": choice, "parallel": parallel, "schema": schema,
                "stops": [stop] if isinstance(stop, str) else list(stop or []),
                "max_tokens": request.get("max_completion_tokens") or request.get("max_tokens") or 256,
                "temperature": float(request.get("temperature") or 0.0),
                "top_p": float(request.get("top_p") if request.get("top_p") is not None else 1.0),
                "seed": request.get("seed")}

    def complete(self, job: dict, deadline_at: float | None = None, on_text=None) -> ChatResult:
        """Answer a prepared request (see `prepare`).

        Args:
            deadline_at: absolute `time.monotonic()` deadline for the whole answer, or None.
            on_text: callback(str) receiving pieces of a text answer as they are generated.
        Raises:
            ChatError: the messages do not fit the context (param "messages").
        """
        with self.lock:
            return self._complete(job, deadline_at, on_text)

    def _complete(self, job: dict, deadline_at: float | None, on_text) -> ChatResult:
        t0 = time.perf_counter()
        prefix = json.dumps([job["system"], job["tools"]], sort_keys=True)
        keys = [_message_key(m) for m in job["messages"]]
        session, checkpoints = self.cache.take(prefix, keys)
        cached_tokens = session.num_tokens if session is not None else 0
        if session is None:
            session = self.engine.session(system=job["system"], tools=job["tools"], capacity=self.context)
            checkpoints = [session.checkpoint()]
        try:
            for m in job["messages"][len(checkpoints) - 1:]:  # one at a time: a checkpoint after each
                session.observe([_context_message(m, self.engine.call_format)])
                checkpoints.append(session.checkpoint())
        except ValueError as exc:
            raise ChatError(f"messages do not fit the context of {self.context} tokens: {exc}", "messages") from None
        prompt_tokens = session.num_tokens
        t_prefill = time.perf_counter() - t0
        stop = _StopFilter(job["stops"])

        def text_piece(piece: str) -> bool:
            out = stop.feed(piece)
            if out and on_text is not None:
                on_text(out)
            return stop.stopped

        d = session.decide(tool_choice=job["choice"] if job["schema"] is None else "none", deadline_at=deadline_at,
                           max_tokens=job["max_tokens"], parallel=job["parallel"], response_format=job["schema"],
                           temperature=job["temperature"], top_p=job["top_p"], seed=job["seed"], on_text=text_piece)
        message = d.openai_message([f"call_{uuid.uuid4().hex[:24]}" for _ in d.tool_calls])
        finish = d.finish_reason
        if d.status == "text":
            tail = "" if stop.stopped else stop.flush()
            if tail and on_text is not None:
                on_text(tail)
            message["content"] = stop.text
            finish = "stop" if stop.stopped else finish
        if d.status == "ok" or (d.status == "text" and not stop.stopped):
            keys.append(_message_key(message))
            checkpoints.append(session.checkpoint())
        elif d.status == "text":
            session.rollback(checkpoints[-1])  # the context holds more than the client will send back
        self.cache.put(prefix, keys, checkpoints, session)
        completion = d.generated_tokens + d.forced_tokens
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        timings = {"ttft_ms": (t_prefill + d.ttft_s) * 1e3, "prefill_ms": t_prefill * 1e3,
                   "total_ms": (time.perf_counter() - t0) * 1e3, "cached_tokens": cached_tokens,
                   "prefill_tokens": prompt_tokens - cached_tokens}
        return ChatResult(d, message, finish, usage, timings)
