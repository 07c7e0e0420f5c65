"""OpenAI-shaped chat completions over warm sessions, in process (used by `tokenspeed serve` and LangChain).

`ChatEngine.complete()` takes a request as OpenAI's chat-completions body (messages as dicts)
and answers it on a `Session`. A `ConversationCache` keeps the session of each recent
conversation keyed by its messages, with a checkpoint after every message: a request whose
messages extend (or share a prefix with) a cached conversation continues that session from
the longest shared prefix, so a framework that resends the whole history each turn pays only
for the new messages. Sessions are evicted least-recently-used to stay within a KV budget.

Every request is validated and its prompt tokenized by `prepare()` before it waits for the
engine: a prompt over the context is refused with `context_length_exceeded` without a prefill.
Finish reasons are OpenAI's (`FINISH_REASONS`); TokenSpeed's own reason and why go in
`ChatResult.detail` (see `finish`).

Source: OpenAI Chat Completions API reference (messages, tools, tool_choice, response_format,
finish_reason, error codes).
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from .grammar import AUTO_TOOL_PROMPT, DEFAULT_TOOL_PROMPT, CallFormat, ToolSchemaError, format_tool_calls, \
    normalize_tools, parse_tool_choice, tools_system_prompt
from .engine import Engine
from .session import Checkpoint, Decision, Session, SessionAborted, check_kv_capacity, render_turn

__all__ = ["ChatError", "ChatEngine", "ChatResult", "ConversationCache", "FINISH_REASONS", "MAX_JSON_DEPTH", "finish"]

_ROLES = ("system", "developer", "user", "assistant", "tool")
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")  # OpenAI's set
MAX_JSON_DEPTH = 64  # nesting of objects and arrays a request may have (tool schemas included)
_CHARS_PER_TOKEN = 8  # characters per token of room in the prefix tried first on a long text (`_over`)


class ChatError(ValueError):
    """A chat request that cannot be answered as asked.

    Attributes:
        param: the request field (dotted path, e.g. "messages.3.content"), or None.
        code: OpenAI's error code when one applies (e.g. "context_length_exceeded"), or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def _check_values(request: dict) -> None:
    # Every string is valid Unicode (a lone surrogate such as "\ud800" is not: the tokenizer and
    # the grammar compiler cannot take it) and nothing nests deeper than MAX_JSON_DEPTH; iterative,
    # so that a deep body cannot exhaust the stack here.
    stack = [((k,), v, 1) for k, v in request.items()]
    while stack:
        path, value, depth = stack.pop()
        where = ".".join(map(str, path))
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ChatError(f"{path[0]}: nested deeper than {MAX_JSON_DEPTH} levels", str(path[0]))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str):
                    _check_text(k, f"{where} key {k[:20]!r}", where)
                stack.append(((*path, k), v, depth + 1))
        elif isinstance(value, str):
            _check_text(value, where, where)


def _check_text(text: str, what: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ChatError(f"{what}: not valid Unicode ({exc.reason} at index {exc.start})", param) from None


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


def _repeats_a_call(job: dict, calls: list[dict]) -> bool:
    # tool_choice "auto" and one of `calls` ({"name", "arguments"}) is already in the conversation
    # (an earlier assistant message's call)
    if parse_tool_choice(job["choice"])[0] != "auto":
        return False
    made = [c for m in job["messages"] if m["role"] == "assistant" for c in _calls(m, "message")]
    return any(c in made for c in calls)


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
        self._lock = threading.Lock()  # `peek` runs beside the engine thread's `take` and `put`
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
        with self._lock:
            best, best_n = self._best(prefix, messages)
            if best is None:
                self.misses += 1
                return None, []
            e = self._entries.pop(best)
        checkpoints = e.checkpoints[:best_n + 1]
        e.session.rollback(checkpoints[-1])
        self.hits += 1
        self.cached_tokens += e.session.num_tokens
        return e.session, checkpoints

    def _best(self, prefix: str, messages: list[str]) -> tuple[int | None, int]:
        # (key of the entry sharing the longest message prefix, messages shared); (None, -1) if none
        best, best_n = None, -1
        for key, e in self._entries.items():
            if e.prefix != prefix:
                continue
            n = 0
            while n < min(len(e.messages), len(messages)) and e.messages[n] == messages[n]:
                n += 1
            if n > best_n or (n == best_n and len(e.messages) == n):  # prefer an exact extension
                best, best_n = key, n
        return best, best_n

    def peek(self, prefix: str, messages: list[str]) -> int:
        """Context tokens a request for `messages` would reuse now (0 on a miss); changes nothing.
        Safe to call from another thread than the one that takes and puts sessions."""
        with self._lock:
            best, n = self._best(prefix, messages)
            return self._entries[best].checkpoints[n].n_tokens if best is not None else 0

    def put(self, prefix: str, messages: list[str], checkpoints: list[Checkpoint], session: Session) -> None:
        """Store `session` as the conversation `messages` (checkpoints: one more than messages);
        evict least-recently-used sessions beyond the budget."""
        cache = session.cache
        nbytes = sum(int(t.nbytes) for t in (getattr(cache, "k", None), getattr(cache, "v", None)) if t is not None)
        with self._lock:
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


def _auto_threshold(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ChatError(f"auto_threshold must be a number in [0, 1], got {value!r:.40}", "auto_threshold")
    return float(value)


def finish(d: Decision, completion_tokens: int, max_tokens: int) -> tuple[str, dict]:
    """OpenAI's finish_reason of a decision, and TokenSpeed's own reason and why.

    | decision | finish_reason | detail reason |
    |---|---|---|
    | "ok" | "tool_calls" | "tool_calls" |
    | "ok", the complete calls of a list cut at max_tokens | "length" | "max_tokens" |
    | "text" | "stop" ("length" when cut at max_tokens) | "stop" ("max_tokens") |
    | "invalid", cut at max_tokens inside a call | "length" | "max_tokens" |
    | "deadline_missed" | "length" (the time budget ran out; no content) | "deadline" |
    | "invalid" otherwise (output withheld: not a valid call) | "content_filter" | "invalid" |

    Returns:
        (finish_reason, {"reason": TokenSpeed's reason, "detail": why, or ""}).
    """
    if d.status == "ok":
        if d.cut:  # the complete calls of a list cut there
            return "length", {"reason": "max_tokens", "detail": "the call list was cut at max_tokens"}
        return "tool_calls", {"reason": "tool_calls", "detail": ""}
    if d.status == "text":
        return ("length" if d.cut else "stop"), {"reason": "max_tokens" if d.cut else "stop", "detail": d.reason}
    if d.status == "deadline_missed":
        return "length", {"reason": "deadline", "detail": d.reason}
    if completion_tokens >= max_tokens or d.cut:
        return "length", {"reason": "max_tokens", "detail": d.reason}
    return "content_filter", {"reason": "invalid", "detail": d.reason}


@dataclass
class ChatResult:
    """The answer to one chat request.

    Attributes:
        decision: the `Decision` of the answer.
        message: OpenAI assistant message {"role", "content", "tool_calls"?} (content cut at a
            stop sequence).
        finish_reason: OpenAI's: "tool_calls", "stop", "length" or "content_filter" (see `finish`).
        detail: TokenSpeed's own finish {"reason": "tool_calls" | "stop" | "max_tokens" |
            "deadline" | "invalid" | "context" | "cancelled", "detail": why} (see `finish`;
            "context": the KV cache filled up; "cancelled": the caller's `cancelled()` said so).
        usage: {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
            {"cached_tokens"}} (cached_tokens: context reused from a warm session, or the system
            prompt's KV read from the disk prefix cache, `tokenspeed.prefix_cache`).
        timings: {"ttft_ms" (request start on the engine -> first token, prefill of new
            messages included), "prefill_ms", "total_ms", "cached_tokens", "prefill_tokens"}.
    """

    decision: Decision
    message: dict
    finish_reason: str
    usage: dict
    timings: dict
    detail: dict


class ChatEngine:
    """Chat completions on one `Engine` with warm sessions. Thread-safe by a lock: one answer at a time.

    Args:
        engine: the resident `Engine`.
        context: KV capacity of each conversation, tokens.
        cache_budget_bytes: KV bytes the conversation cache may hold.
    Raises:
        SessionArgumentError: context is not in [1, the model's max_seq_len], or one conversation's
            KV cache would not fit in the memory available.
    """

    def __init__(self, engine: Engine, context: int = 4096, cache_budget_bytes: int = 1 << 30):
        check_kv_capacity(engine, context)  # a context the model or the memory cannot hold fails here, not per request
        self.engine = engine
        self.context = context
        self.cache = ConversationCache(cache_budget_bytes)
        self.lock = threading.Lock()
        self._system_counts: dict[str, int] = {}  # system message text -> its tokens (`_system_tokens`)

    def prepare(self, request: dict) -> dict:
        """Validate a request (OpenAI body: messages, tools, tool_choice, parallel_tool_calls,
        response_format, max_tokens/max_completion_tokens, temperature, top_p, seed, stop, and
        TokenSpeed's auto_threshold: see `Session.decide`) and compile its grammar; cheap enough
        to run before queueing.

        Also renders and tokenizes the prompt (system prompt, tools and messages) to count it:
        a prompt that does not fit the context, or does not leave room for an explicit
        max_tokens, is refused here (code "context_length_exceeded") without a prefill.

        Returns:
            the job for `complete()` (its "prompt_tokens": the prompt's length in tokens).
        Raises:
            ChatError: the message names the problem, `param` the field.
        """
        if not isinstance(request, dict):
            raise ChatError("the request must be a JSON object")
        _check_values(request)
        try:
            return self._prepare(request)
        except RecursionError:  # a limit of a library below (schema compiler, template) reached anyway
            raise ChatError(f"the request nests too deeply (at most {MAX_JSON_DEPTH} levels)") from None

    def _prepare(self, request: dict) -> dict:
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
        # counted before any grammar is compiled: an over-length request costs only its tokenization
        system = messages[0]["role"] in ("system", "developer")
        stop = request.get("stop")
        choice = request.get("tool_choice")
        choice = choice if choice is not None else ("auto" if tools else "none")
        try:
            mode = parse_tool_choice(choice)[0]
        except ToolSchemaError as exc:
            raise ChatError(str(exc), "tool_choice") from None
        job = {"system": message_text(messages[0]) if system else None, "messages": messages[system:], "tools": tools,
               "tool_prompt": AUTO_TOOL_PROMPT if mode in ("auto", "none") else DEFAULT_TOOL_PROMPT}
        prompt = self._prompt_tokens(job)
        asked = request.get("max_completion_tokens") or request.get("max_tokens")
        param = "max_completion_tokens" if request.get("max_completion_tokens") else "max_tokens"
        if prompt >= self.context:  # counting stopped there: a lower bound
            raise ChatError(f"This model's maximum context length is {self.context} tokens. However, your messages "
                            f"resulted in at least {prompt} tokens. Please reduce the length of the messages.",
                            "messages", "context_length_exceeded")
        if asked and prompt + asked > self.context:
            raise ChatError(f"This model's maximum context length is {self.context} tokens. However, you requested "
                            f"{prompt + asked} tokens ({prompt} in the messages, {asked} in the completion). Please "
                            f"reduce the length of the messages or {param}.", param, "context_length_exceeded")
        schema = _response_schema(request.get("response_format"))
        if schema is not None:
            try:
                self.engine.json_grammar(schema)
            except ToolSchemaError as exc:
                raise ChatError(str(exc), "response_format") from None
        parallel = bool(request.get("parallel_tool_calls", True))
        if choice != "none":
            if not tools:
                raise ChatError(f"tool_choice {choice!r} needs tools", "tool_choice")
            try:
                self.engine.grammar(tools, choice, parallel)
            except ToolSchemaError as exc:
                raise ChatError(str(exc), "tool_choice") from None
        return {**job, "choice": choice, "parallel": parallel, "schema": schema, "prompt_tokens": prompt,
                "stops": [stop] if isinstance(stop, str) else list(stop or []),
                "max_tokens": asked or min(256, self.context - prompt),
                "temperature": float(request.get("temperature") or 0.0),
                "top_p": float(request.get("top_p") if request.get("top_p") is not None else 1.0),
                "seed": request.get("seed"), "auto_threshold": _auto_threshold(request.get("auto_threshold"))}

    def _prompt_tokens(self, job: dict) -> int:
        # Tokens of the prompt as a fresh session holds it before its answer (the system message,
        # every message rendered as `Session.observe` renders it, the trigger); counting stops
        # once it is over the context.
        tok, fmt = self.engine.tokenizer, self.engine.call_format
        try:
            system = tools_system_prompt(job["system"], job["tools"], job["tool_prompt"], fmt)
            n = self._system_tokens(system)
            for i, m in enumerate(job["messages"]):
                if n >= self.context:
                    break
                m = _context_message(m, fmt)
                n += self._over(m["content"], self.context - n) or \
                    len(render_turn(tok, system, [m], first=i == 0))
        except ValueError as exc:  # the chat template refuses the conversation (e.g. roles must alternate)
            raise ChatError(f"messages: {exc}", "messages") from None
        return n

    def _over(self, text: str, room: int) -> int:
        # A lower bound of the tokens of `text` when a prefix of it alone is over `room` tokens,
        # else 0: bounds what an over-length text costs to refuse by the context, not by the text.
        # The prefix ends before a space, where the pre-tokenizer splits the whole text too; a
        # few tokens are taken off for a prefix cut elsewhere.
        head = text[:_CHARS_PER_TOKEN * (room + 2)]
        if len(head) == len(text):
            return 0
        cut = head.rfind(" ")
        head = head[:cut] if cut > len(head) // 2 else head
        n = len(self.engine.tokenizer.encode_text(head)) - 8
        return n if n > room else 0

    def _system_tokens(self, system: str) -> int:
        # tokens of the system message (prompt and tools) and the trigger; the last few counted
        # are kept (every request of a conversation, or of an agent, sends the same ones)
        if system not in self._system_counts:
            tok = self.engine.tokenizer
            n = self._over(system, self.context) or len(tok.encode_chat([{"role": "system", "content": system}], []))
            self._system_counts[system] = n + len(tok.encode(tok.assistant_prefix))
            while len(self._system_counts) > 32:
                self._system_counts.pop(next(iter(self._system_counts)))
        return self._system_counts[system]

    def prompt_key(self, job: dict) -> tuple[str, list[str]]:
        """(system prompt and tools, message keys) by which the conversation cache knows a prepared job."""
        return json.dumps([job["system"], job["tools"], job["tool_prompt"]], sort_keys=True), \
            [_message_key(m) for m in job["messages"]]

    def complete(self, job: dict, deadline_at: float | None = None, on_text=None, cancelled=None) -> ChatResult:
        """Answer a prepared request (see `prepare`).

        The answer stops between two forwards (prefill included) when `deadline_at` passes
        (finish "length", detail "deadline") or `cancelled()` returns True (detail "cancelled");
        a request whose deadline passed or that was cancelled before it reached the engine
        answers so at once, without a forward. The conversation's session is rolled back to its
        last complete message and kept warm.

        Args:
            deadline_at: absolute `time.monotonic()` deadline for the whole answer, or None.
            on_text: callback(str) receiving pieces of a text answer as they are generated.
            cancelled: a callable () -> bool (e.g. the client has gone), or None.
        """
        with self.lock:
            return self._complete(job, deadline_at, on_text, cancelled)

    def stopped(self, job: dict, deadline_at: float | None, why: str, t0: float | None = None,
                cached: int = 0) -> ChatResult:
        """The result of a prepared request stopped before an answer: by its deadline (finish
        "length", detail "deadline") when `deadline_at` has passed, else by its caller (finish
        "stop", detail "cancelled"); no content. t0: `time.perf_counter()` at its start (timings)."""
        t0 = time.perf_counter() if t0 is None else t0
        late = deadline_at is not None and time.monotonic() >= deadline_at
        d = Decision(status="deadline_missed" if late else "invalid", reason=why)
        detail = {"reason": "deadline" if late else "cancelled", "detail": why}
        usage = {"prompt_tokens": job["prompt_tokens"], "completion_tokens": 0, "total_tokens": job["prompt_tokens"],
                 "prompt_tokens_details": {"cached_tokens": cached}}
        total = (time.perf_counter() - t0) * 1e3
        timings = {"ttft_ms": total, "prefill_ms": total, "total_ms": total, "cached_tokens": cached,
                   "prefill_tokens": 0}
        return ChatResult(d, {"role": "assistant", "content": None}, "length" if late else "stop", usage, timings,
                          detail)

    def _complete(self, job: dict, deadline_at: float | None, on_text, cancelled) -> ChatResult:
        t0 = time.perf_counter()

        def abort() -> bool:
            return (deadline_at is not None and time.monotonic() >= deadline_at) or \
                (cancelled is not None and bool(cancelled()))

        if abort():
            return self.stopped(job, deadline_at, "stopped before it reached the engine", t0)
        prefix, keys = self.prompt_key(job)
        session, checkpoints = self.cache.take(prefix, keys)
        cached_tokens = session.num_tokens if session is not None else 0
        if session is None:
            session = self.engine.session(system=job["system"], tools=job["tools"], capacity=self.context,
                                          tool_prompt=job["tool_prompt"])
            checkpoints = [session.checkpoint()]
            if session.system_from_disk:  # the system prompt's KV came from the disk prefix cache
                cached_tokens = len(session.target.tokens)
        try:
            for m in job["messages"][len(checkpoints) - 1:]:  # one at a time: a checkpoint after each
                session.observe([_context_message(m, self.engine.call_format)], abort=abort, deadline_at=deadline_at)
                checkpoints.append(session.checkpoint())
        except SessionAborted as exc:  # rolled back to the last complete message: kept warm
            self.cache.put(prefix, keys[:len(checkpoints) - 1], checkpoints, session)
            return self.stopped(job, deadline_at, f"prefill stopped: {exc}", t0, cached_tokens)
        except ValueError as exc:  # counted in prepare(): only a template that renders differently gets here
            self.cache.put(prefix, keys[:len(checkpoints) - 1], checkpoints, session)
            raise ChatError(f"messages do not fit the context of {self.context} tokens: {exc}", "messages",
                            "context_length_exceeded") from None
        prompt_tokens = session.num_tokens
        t_prefill = time.perf_counter() - t0
        stop = _StopFilter(job["stops"])

        def text_piece(piece: str) -> bool:
            out = stop.feed(piece)
            if out and on_text is not None:
                on_text(out)
            return stop.stopped

        full = None

        def answer(auto_threshold: float | None) -> Decision:
            return session.decide(tool_choice=job["choice"] if job["schema"] is None else "none",
                                  deadline_at=deadline_at, max_tokens=job["max_tokens"], parallel=job["parallel"],
                                  response_format=job["schema"], temperature=job["temperature"], top_p=job["top_p"],
                                  seed=job["seed"], on_text=text_piece, abort=abort, auto_threshold=auto_threshold)

        try:
            d = answer(job["auto_threshold"])
            if d.status == "ok" and _repeats_a_call(job, d.tool_calls):
                # "auto" (an agent's loop): a call the conversation already holds, its result
                # there too, is a small model's loop, not progress; the answer is text instead
                session.rollback(checkpoints[-1])
                d = answer(1.0)
        except SessionAborted as exc:  # rolled back to before the answer: kept warm
            self.cache.put(prefix, keys, checkpoints, session)
            return self.stopped(job, deadline_at, f"decode stopped: {exc}", t0, cached_tokens)
        except ValueError as exc:  # the KV cache filled up during the answer (rolled back)
            d, full = Decision(status="invalid", reason=f"the context of {self.context} tokens is full: {exc}"), exc
        message = d.openai_message([f"call_{uuid.uuid4().hex[:24]}" for _ in d.tool_calls])
        completion = d.generated_tokens + d.forced_tokens
        finish_reason, detail = finish(d, completion, job["max_tokens"])
        if full is not None:
            finish_reason, detail = "length", {"reason": "context", "detail": d.reason}
        if d.status == "text":
            tail = "" if stop.stopped else stop.flush()
            if tail and on_text is not None:
                on_text(tail)
            message["content"] = stop.text
            if stop.stopped:
                finish_reason, detail = "stop", {"reason": "stop", "detail": "stop sequence"}
        if d.status == "ok" or (d.status == "text" and not stop.stopped):
            keys.append(_message_key(message))
            checkpoints.append(session.checkpoint())
        elif d.status == "text":
            session.rollback(checkpoints[-1])  # the context holds more than the client will send back
        self.cache.put(prefix, keys, checkpoints, session)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        timings = {"ttft_ms": (t_prefill + d.ttft_s) * 1e3, "prefill_ms": t_prefill * 1e3,
                   "total_ms": (time.perf_counter() - t0) * 1e3, "cached_tokens": cached_tokens,
                   "prefill_tokens": prompt_tokens - cached_tokens}
        return ChatResult(d, message, finish_reason, usage, timings, detail)
