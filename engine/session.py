"""Session: the agent API over one resident KV cache.

An `Engine` (`tokenspeed.engine`) loads a model once and stays resident. `Engine.session()`
returns a `Session` that keeps its KV cache between calls: `observe()` prefills new context
immediately (streaming prefill), so `decide()` only prefills its own trigger tokens (the chat
template's assistant prefix, e.g. `<|im_start|>assistant\\n`, and the grammar-forced start of the
call) before the first decode step.

Timing conventions: all durations are seconds (float) from `time.perf_counter()`; absolute
deadlines are `time.monotonic()` values.
"""
from __future__ import annotations

import itertools
import re
import time

import torch

from .decision import (Checkpoint, Decision, Segment, SessionArgumentError, finite_arg, keep_complete_calls,
                       positive_int_arg, sampling_args, settle)
from .auto import AutoRule
from .decode import NonFiniteLogitsError, Target, decode
from .device import DecodeGraphs
from .grammar import (DEFAULT_TOOL_PROMPT, TokenMask, complete_tool_calls, json_closings, looping_string,
                      looping_structure, tools_system_prompt)
from .kv import KVConfig, TieredKVCache
from .prefix_cache import prefill_system
from .speculation import Speculator

__all__ = ["Session", "Decision", "Checkpoint", "Segment", "SessionArgumentError", "SessionAborted", "render_turn",
           "kv_bytes", "check_kv_capacity"]

_ROLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,31}$")  # chat roles are template text: no markup in them
_SESSION_IDS = itertools.count(1)
ABORT_CHUNK = 128  # prefill tokens per forward when an `abort` check runs between forwards
DEADLINE_CHUNK = 16  # the fewest prefill tokens per forward as a deadline nears (`Session._flush`)


class SessionAborted(RuntimeError):
    """`observe()` or `decide()` stopped between two forwards because its `abort` callable said so
    (e.g. the client that asked has gone, or its deadline passed while prefilling); the session
    was rolled back to its state before the call."""


def render_turn(tok, system_text: str, messages: list[dict], first: bool) -> list[int]:
    """Token ids of chat `messages` as a session appends them after its system message.

    Rendered on their own after the system message, keeping only their tokens (chat templates are
    prefix-stable: O(message), not O(history)); contents are tokenized as text only, so no
    special token can be forged from them. A template that writes the system message with the
    last user message (Mistral, `Tokenizer.system_moves`) gets it once, with the first message
    after it (`first`): re-writing it at every turn would repeat it, moving it would change
    cached tokens.

    Args:
        tok: the `tokenspeed.tokenizer.Tokenizer`.
        system_text: the system message (system prompt and tools, `tools_system_prompt`).
        messages: [{"role": str, "content": str}].
        first: these are the first messages after the system message.
    """
    head = [{"role": "system", "content": system_text}] if first or not tok.system_moves else []
    return tok.encode_chat(messages, head)


def kv_bytes(args, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache of `tokens` slots for a model of `args` (`ModelArgs`): keys and values of
    every layer, [tokens, n_kv_heads, head_dim] each, in `dtype`."""
    return 2 * args.n_layers * tokens * args.n_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()


def _available_memory(device: torch.device) -> int:
    # bytes free for a new allocation on `device`: the CUDA device's free memory, else the host's available memory
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_kv_capacity(engine, capacity, kv_budget=None) -> None:
    """Check a session's KV size before anything is allocated.

    Args:
        engine: the `tokenspeed.engine.Engine`.
        capacity: None (the model's max_seq_len) or tokens in [1, max_seq_len].
        kv_budget: None, a positive int of tokens or a `KVConfig` (then its hot tier's budget counts).
    Raises:
        SessionArgumentError: a wrong type or range, or the KV cache needs more memory than the
            device has available (the message gives both in GiB).
    """
    most = engine.model.args.max_seq_len
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or not 1 <= capacity <= most):
        raise SessionArgumentError(f"capacity must be None or an integer in [1, {most}] (the model's "
                                   f"max_position_embeddings) tokens, got {capacity!r:.40}")
    if kv_budget is not None and not isinstance(kv_budget, KVConfig) and (
            isinstance(kv_budget, bool) or not isinstance(kv_budget, int) or kv_budget < 1):
        raise SessionArgumentError(f"kv_budget must be None, a positive integer of tokens or a KVConfig, "
                                   f"got {kv_budget!r:.40}")
    tokens = (kv_budget.budget if isinstance(kv_budget, KVConfig) else kv_budget) if kv_budget is not None \
        else capacity or most
    need, free = kv_bytes(engine.model.args, tokens, engine.model.kv_dtype), _available_memory(engine.model.device)
    if need > free:
        what = "kv_budget" if kv_budget is not None else "capacity" if capacity is not None else \
            "capacity (default: max_position_embeddings)"
        raise SessionArgumentError(f"{what}={tokens} tokens needs {need / 2**30:.2f} GiB of KV cache, more than the "
                                   f"{free / 2**30:.2f} GiB available on {engine.model.device}: pass a smaller capacity or a "
                                   f"kv_budget")


def _seed_arg(seed) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64):
        raise SessionArgumentError(f"seed must be None or an integer in [0, 2**64), got {seed!r:.40}")


def _callback_arg(fn, name: str) -> None:
    if fn is not None and not callable(fn):
        raise SessionArgumentError(f"{name} must be a callable or None, got {type(fn).__name__}")


def _text_arg(text: str, name: str) -> None:
    # text the tokenizer can take: valid Unicode (a lone surrogate such as "\ud800" is not)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SessionArgumentError(f"{name} is not valid Unicode: {exc.reason} at index {exc.start}") from None


class Session:
    """A stateful agent context resident in one KV cache. Not thread-safe: use from one thread.
    Made by `tokenspeed.engine.Engine.session()` (its arguments are documented there).

    Attributes:
        engine: the `tokenspeed.engine.Engine` whose model, tokenizer and settings it uses.
        tools: the normalized tool definitions.
        segments: list of `Segment` describing the context in cache order.
        num_tokens: tokens in the context (cached plus pending).
        target: the `tokenspeed.decode.Target` (model, KV cache, cached token ids) the decode loop uses;
            on CUDA its decode and verification forwards run as CUDA graphs (`tokenspeed.device.DecodeGraphs`).
        speculator: the `tokenspeed.speculation.Speculator` (drafting state of this session).
        system_from_disk: whether the system prompt's KV was read from the disk cache instead of
            prefilled (`tokenspeed.prefix_cache`).
        kept_tokens: of the tokens the last `observe()` appended, how many kept their KV from
            the context before its `since` checkpoint instead of being prefilled (0 without `since`).
    """

    def __init__(self, engine, system: str | None, tools: list[dict], capacity: int | None,
                 kv_budget: "int | KVConfig | None" = None, tool_prompt: str = DEFAULT_TOOL_PROMPT):
        check_kv_capacity(engine, capacity, kv_budget)
        if system is not None:
            if not isinstance(system, str):
                raise SessionArgumentError(f"system must be a string or None, got {type(system).__name__}")
            _text_arg(system, "system")
        self.engine = engine
        self.id = next(_SESSION_IDS)
        self._branches = [[0, None]]  # [branch id, last valid checkpoint serial]: root .. current (None: open)
        self._serials = itertools.count(1)
        self.model = engine.model
        self.tok = engine.tokenizer
        self.tools = tools
        self.tool_prompt = tool_prompt
        self._system_text = tools_system_prompt(system, tools, tool_prompt, engine.call_format)
        system_ids = self.tok.encode_chat([{"role": "system", "content": self._system_text}], [])
        if kv_budget is None:
            if len(system_ids) >= (capacity or self.model.args.max_seq_len):
                raise SessionArgumentError(f"capacity={capacity or self.model.args.max_seq_len} tokens cannot hold "
                                           f"the system prompt and tools ({len(system_ids)} tokens)")
            cache, window = self.model.new_cache(capacity), None
        else:
            kv = kv_budget if isinstance(kv_budget, KVConfig) else KVConfig(budget=kv_budget)  # validates it
            if len(system_ids) >= kv.budget:
                raise ValueError(f"kv_budget {kv.budget} tokens cannot hold the pinned system prompt and tools "
                                 f"({len(system_ids)} tokens)")
            cache, window = TieredKVCache(self.model.args, kv, self.model.kv_dtype, self.model.device), kv.budget
        self._mask = TokenMask(self.tok.vocab_size, engine.device, engine.mask_executor)
        graphs = DecodeGraphs(self.model, cache) if engine.device.type == "cuda" and kv_budget is None else None
        self.target = Target(self.model, cache, self._mask, graphs, engine.host_worker, engine.pipeline)
        self.pending: list[int] = []       # appended to the context but not yet prefilled
        self.kept_tokens = 0
        # In a pruned session the draft attends over the last `budget` tokens only: its cost stays flat.
        self.speculator = Speculator(engine.speculation, self.model.args.max_seq_len, window)
        self._append(system_ids, "system", pinned=True)
        self.system_from_disk = prefill_system(self)

    # ---------------------------------------------------------------- context

    @property
    def cache(self):
        """The KV cache (`tokenspeed.model.KVCache`, or `tokenspeed.kv.TieredKVCache` with a kv_budget)."""
        return self.target.cache

    @property
    def tokens(self) -> list[int]:
        """Token ids whose KV is in the cache, in slot order (a copy: O(context))."""
        return self.target.tokens.tolist()

    @property
    def segments(self) -> list[Segment]:
        """The context's `Segment`s in cache order (held by the KV cache, which prunes by them)."""
        return self.target.cache.segments

    @property
    def num_tokens(self) -> int:
        return len(self.target.tokens) + len(self.pending)

    def _render(self, messages: list[dict], n_segments: int | None = None) -> list[int]:
        # the messages' tokens after the system message (`render_turn`), in a context of n_segments
        # segments (None: this one's)
        n_segments = len(self.segments) if n_segments is None else n_segments
        if not n_segments:
            return self.tok.encode_chat(messages, [])
        return render_turn(self.tok, self._system_text, messages, first=n_segments == 1)

    def _append(self, ids: list[int], kind: str, source: str = "", pinned: bool = False) -> None:
        start = self.num_tokens
        self.cache.admit(start, len(ids))
        self.pending.extend(ids)
        self.segments.append(Segment(start, start + len(ids), kind, source, pinned))

    def _forward(self, ids: list[int], logits_for="last"):
        # Prefill/decode `ids` at the next positions; returns logits [1, V] for the last one.
        return self.target.forward(ids, logits_for)

    def _flush(self, abort=None, deadline_at: float | None = None, kept: int = 0) -> None:
        # A family whose answer has no header (Mistral: the assistant prefix is empty) has no
        # trigger tokens: the context's last token stays pending, so that the next decision's
        # first forward has a row to read the logits from. With `abort`, the prefill runs in
        # forwards of ABORT_CHUNK tokens and stops between two when abort() is true. With
        # `deadline_at` it stops once the deadline has passed, and each forward takes about half
        # the time left at the rate measured on this prefill's forwards so far (from
        # DEADLINE_CHUNK tokens, the first one too, to ABORT_CHUNK): the stop lands within about
        # one DEADLINE_CHUNK forward of the deadline, where a fixed chunk overshot by up to a whole
        # ABORT_CHUNK forward. `kept`: tokens that joined the cache without a forward (`observe`'s
        # since): the budget and the draft follow them too.
        keep = 0 if self.tok.assistant_prefix else 1
        prefill = len(self.pending) > keep
        if prefill:
            ids, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            i, rate = 0, None  # rate: seconds per token of this prefill's forwards
            while i < len(ids):
                if abort is not None and abort():
                    raise SessionAborted(f"aborted after {i} of {len(ids)} prefill tokens")
                step = len(ids) if abort is None and deadline_at is None else ABORT_CHUNK
                if deadline_at is not None:
                    left = deadline_at - time.monotonic()
                    if left <= 0:
                        raise SessionAborted(f"deadline passed after {i} of {len(ids)} prefill tokens")
                    step = DEADLINE_CHUNK if rate is None else \
                        max(DEADLINE_CHUNK, min(ABORT_CHUNK, int(left / 2 / max(rate, 1e-9))))
                t = time.perf_counter()
                self._forward(ids[i:i + step], "none")
                rate = (time.perf_counter() - t) / len(ids[i:i + step])
                i += step
        if prefill or kept:
            self.cache.trim()  # back to the KV budget between decisions
            self.speculator.observe(self.target.context())  # the draft model's KV follows, off the decision path

    def observe(self, content, role: str = "user", kind: str = "text", source: str = "", pin: bool = False,
                abort=None, deadline_at: float | None = None, since: Checkpoint | None = None) -> int:
        """Append an observation to the context and prefill it now (streaming prefill).

        Content is tokenized as text only: special tokens written in it (`<|im_end|>`) never
        become control tokens, so observed text cannot end its turn or forge another.

        Args:
            content: text, or a list of chat messages [{"role", "content"}].
            role: chat role for text content ("user", "tool", ...).
            kind: "text" or "sensor" (sensor readings may be superseded by pruning policies).
            source: producer name, e.g. "joint_states". In a pruned session a newer "sensor"
                reading of the same source makes the older one the first to leave the hot tier.
            pin: keep this observation in the hot tier for good (pruned sessions); with a
                `source`, only until a newer pinned observation of the same source arrives (a
                new goal supersedes the last one, which may then be evicted first).
            abort: a callable () -> bool checked between prefill forwards (of `ABORT_CHUNK`
                tokens), or None (one prefill, never stopped).
            deadline_at: absolute `time.monotonic()` deadline, or None: the prefill stops
                (SessionAborted) once it has passed, its forwards shrinking as it nears so that
                the stop comes within about one forward of `DEADLINE_CHUNK` tokens after it.
            since: a `Checkpoint` of this session to go back to first: the context becomes exactly
                that of `rollback(since)` then `observe(content, ...)`, but the tokens that followed
                `since` keep their KV as far as they equal the ones that follow it now (the longest
                common prefix of the two, starting with the checkpoint's pending tokens), and only
                the rest is prefilled (`kept_tokens`: how many of this observation's were kept).
                E.g. a state line predicted on a checkpoint, then the real one: a moved cube
                re-prefills the line from its first differing token on. Kept keys and values are the ones a prefill would
                write (same tokens, same positions, same context before them); in a pruned session
                the kept tokens' relevance scores restart at 0 and the older ones' are `since`'s.
        Returns:
            tokens appended to the context.
        Raises:
            SessionArgumentError: content is neither str nor a list of {"role": str, "content":
            str} messages, a role is not a plain name, a text is not valid Unicode (a lone
            surrogate), `kind` is neither "text" nor "sensor", abort is not callable or
            deadline_at not a finite number, or `since` is not a checkpoint this session can roll
            back to (see `rollback()`).
            SessionAborted: abort() said so, or deadline_at passed, before the prefill ended.
            ValueError: context full.
        On an error the session is left as it was before the call (as `rollback(since)` leaves it
        when `since` was given, except for an invalid `since`: then it is unchanged).
        """
        if kind not in ("text", "sensor"):
            raise SessionArgumentError(f'observe(): kind must be "text" or "sensor", got {kind!r}')
        messages = [{"role": role, "content": content}] if isinstance(content, str) else content
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role", "user"), str)
                and _ROLE.match(m.get("role", "user")) for m in messages):
            raise SessionArgumentError("observe() takes a string or a list of {'role': name, 'content': str} "
                                       "messages (role: letters, digits, '_' or '-')")
        _callback_arg(abort, "abort")
        deadline_at = finite_arg(deadline_at, "deadline_at", " (time.monotonic() seconds) or None")
        messages = [{"role": m.get("role", "user"), "content": m["content"]} for m in messages]
        for i, m in enumerate(messages):
            _text_arg(m["content"], f"observe() message {i} content")
        self.kept_tokens = kept = 0
        if since is None:
            ids = self._render(messages)
            cp = self.checkpoint()
        else:
            self._check_checkpoint(since)
            ids = self._render(messages, since.n_segments)
            new, old = [*since.pending, *ids], self.target.tokens[since.n_tokens:since.n_tokens + len(since.pending) + len(ids)]
            same = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
            # a family without an assistant prefix keeps the context's last token pending (`_flush`)
            same = min(same, len(new) - (0 if self.tok.assistant_prefix else 1))
            kept = self._rollback(since, same)
            self.kept_tokens = max(kept - len(since.pending), 0)
            cp = since
        try:
            self._append(ids, kind, source, pinned=pin)
            if kept:  # their KV stayed in the cache: they are not pending
                self.target.tokens.extend(self.pending[:kept])
                del self.pending[:kept]
            self._flush(abort, deadline_at, kept)
        except BaseException:
            self.rollback(cp)  # the KV cache is full, or aborted: the context is left as before the call
            raise
        return len(ids)

    def checkpoint(self) -> Checkpoint:
        """Capture the context (O(1): the KV prefix is immutable until rollback)."""
        last_end = self.segments[-1].end if self.segments else 0
        return Checkpoint(len(self.target.tokens), tuple(self.pending), len(self.segments), last_end, self.cache.snapshot(),
                          self.id, self._branches[-1][0], next(self._serials))

    def _on_branch(self, cp: Checkpoint) -> int | None:
        # index in self._branches of cp's branch when cp is a state of the current context's history, else None
        for i, (branch, last) in enumerate(self._branches):
            if branch == cp.branch:
                return i if last is None or cp.serial <= last else None
        return None

    def rollback(self, cp: Checkpoint) -> None:
        """Restore the context exactly as it was at `cp` (later tokens and KV are discarded).

        Every rollback starts a new branch of the context: a checkpoint stays valid while it is a
        state of the current context's history (taken on this branch, or on an earlier one before
        the point this branch left it); one of an abandoned branch is refused.

        Raises:
            SessionArgumentError: `cp` is not a Checkpoint of this session, or it was taken on a
                branch that a rollback abandoned (its context is no longer this one's history).
        """
        self._rollback(cp)

    def _check_checkpoint(self, cp) -> int:
        # index in self._branches of cp's branch, or SessionArgumentError (see rollback())
        if not isinstance(cp, Checkpoint) or cp.session_id != self.id:
            raise SessionArgumentError("rollback() takes a Checkpoint taken from this same session")
        at = self._on_branch(cp)
        if at is None or cp.n_tokens > len(self.target.tokens) or cp.n_segments > len(self.segments):
            raise SessionArgumentError("rollback(): the checkpoint belongs to a branch of this session's context that "
                                       "an earlier rollback abandoned")
        return at

    def _rollback(self, cp: Checkpoint, keep: int = 0) -> int:
        # rollback(cp) of a checked cp, except that the KV cache keeps up to `keep` of the cached
        # tokens that followed cp (as many of them from the first as it holds in the hot tier); the
        # caller appends those tokens again at once and moves them from `pending` to
        # `target.tokens` (observe's since). Returns how many the cache kept.
        at = self._check_checkpoint(cp)  # before reading cp's fields: it may be anything
        self._branches[at:] = [[cp.branch, cp.serial], [next(self._serials), None]]
        kept = self.cache.restore(cp.n_tokens, cp.kv, keep)  # a pruned cache also undoes evictions and recalls since cp
        del self.target.tokens[cp.n_tokens:]
        self.pending = list(cp.pending)
        del self.segments[cp.n_segments:]
        if self.segments:
            self.segments[-1].end = cp.last_segment_end
        return kept

    # ---------------------------------------------------------------- decisions

    def decide(self, tool_choice="required", deadline: float | None = None, deadline_at: float | None = None,
               max_tokens: int = 256, jump_forward: bool = True, parallel: bool = False,
               response_format: dict | None = None, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, on_text=None, abort=None, auto_threshold: float | None = None) -> Decision:
        """Produce schema-valid tool call(s), before a deadline or say why not; or a text answer.

        Greedy decoding (by default) under the tool-call grammar; jump-forward appends
        grammar-forced tokens without sampling them (they still enter the KV cache, batched with
        the next forward). With speculation (`Engine.speculation`) drafted tokens are verified
        several per forward; the output is token-for-token the plain greedy output.

        Calls are written in the model family's own format (`Engine.call_format`). With
        tool_choice "auto" the first token settles call or text (a text answer may not start with
        the call's first character, e.g. "<" of "<tool_call>"); a text answer comes back as status
        "text". Which one: a call when the model's probability mass on the tokens opening a call at
        that position, p(call) (`Decision.p_call`), reaches the model's calibrated threshold
        (`Engine.auto_threshold`, `tokenspeed.auto`), else text.

        Args:
            tool_choice: "required", "auto" (call or text), "none" (text, no grammar), {"name":
                tool}, or OpenAI's {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}
                (see `ToolGrammar.build`).
            deadline: seconds from now, > 0; or deadline_at: absolute `time.monotonic()` time (one
                already past gives "deadline_missed").
            max_tokens: most tokens the answer may take.
            jump_forward: append forced tokens without a model call (off: one forward per token).
            parallel: the answer may hold several calls (`Decision.tool_calls`).
            response_format: a JSON schema: the answer is one JSON value valid under it (status
                "text"; tools and tool_choice are ignored). Each new schema's grammar is compiled in the
                first call that uses it, and in a session without tools the first one also builds the
                engine's grammar tokenizer (`Engine.ll_tokenizer`), inside the deadline: call
                `engine.json_grammar(schema)` beforehand to keep both out of it.
            temperature, top_p, seed: sampling (temperature 0: greedy), as in `generate()`.
            on_text: callback(str) receiving each new piece of a text answer as it is generated
                (never pieces of a call); returning True stops the answer there (stop sequences).
            abort: a callable () -> bool checked before the first forward and between decode
                steps, or None: when it returns True the decision stops there, the session is
                rolled back and `SessionAborted` is raised.
            auto_threshold: tool_choice "auto" (also in allowed_tools) calls when p(call) >= this,
                in [0, 1] (1: a text answer); None: `Engine.auto_threshold`'s for this session's tool prompt (the
                model's calibration; without one the first token is the plain masked argmax).
        Returns:
            a `Decision`. On "ok" and "text" the answer stays in the context as the assistant
            turn; otherwise the session is rolled back to its state before the call.
        Raises:
            ToolSchemaError: tool_choice is malformed or names an unknown tool, or the response
                format's schema is invalid.
            SessionArgumentError: deadline not a positive finite number or deadline_at not a
                finite number (NaN would disable the deadline), max_tokens not a positive integer,
                temperature negative or not finite, top_p outside (0, 1], seed not None or an
                integer in [0, 2**64), on_text or abort not callable, auto_threshold not None or a
                number in [0, 1].
            SessionAborted: abort() said so; the session is left as it was before the call.
            ValueError: the KV cache is full; the session is left as it was before the call.
        """
        t0 = time.perf_counter()
        deadline = finite_arg(deadline, "deadline", " of seconds or None")
        if deadline is not None and deadline <= 0:
            raise SessionArgumentError(f"deadline must be a positive number of seconds or None, got {deadline!r}")
        deadline_at = finite_arg(deadline_at, "deadline_at", " (time.monotonic() seconds) or None")
        positive_int_arg(max_tokens, "max_tokens")
        sampling_args(temperature, top_p)
        _seed_arg(seed)
        _callback_arg(on_text, "on_text")
        _callback_arg(abort, "abort")
        auto_threshold = finite_arg(auto_threshold, "auto_threshold", " in [0, 1] or None")
        if auto_threshold is not None and not 0 <= auto_threshold <= 1:
            raise SessionArgumentError(f"auto_threshold must be a number in [0, 1] or None, got {auto_threshold!r}")
        if deadline is not None:
            deadline_at = time.monotonic() + deadline
        if response_format is not None:
            grammar = self.engine.json_grammar(response_format)
        elif tool_choice == "none" or (tool_choice == "auto" and not self.tools):
            grammar = None
        else:
            grammar = self.engine.grammar(self.tools, tool_choice, parallel)
        matcher = grammar.matcher() if grammar is not None else None
        cp = self.checkpoint()
        trigger = self.tok.encode(self.tok.assistant_prefix)
        self._append(trigger, "trigger")
        prefill, self.pending = self.pending, []
        gen = torch.Generator(self.engine.device).manual_seed(seed) if seed is not None else None
        stream = None if grammar is not None and grammar.mode == "required" else \
            self._text_stream(on_text, calls=grammar is not None and grammar.mode == "auto")
        fmt = self.engine.call_format
        several = grammar is not None and grammar.mode != "json" and parallel and fmt.parallel
        repeated = self._repeat_guard() if several else None
        on_step = stream or repeated
        if abort is not None or (stream is not None and repeated is not None):
            def on_step(out: list[int]) -> bool:  # between two decode steps: stop here when aborted
                return (abort is not None and bool(abort())) or (stream is not None and stream(out)) or \
                    (repeated is not None and repeated(out))
        try:
            if abort is not None and abort():
                raise SessionAborted("aborted before the first forward")
            with self.cache.decision():  # a pruned cache recalls before the first forward only
                out, feed, stats = decode(self.target, self.speculator, prefill, tok=self.tok, matcher=matcher,
                                          jump_forward=jump_forward, max_tokens=max_tokens, deadline_at=deadline_at,
                                          t0=t0, temperature=temperature, top_p=top_p, generator=gen,
                                          on_token=on_step, auto=self._auto_rule(grammar, auto_threshold),
                                          force=self._loop_guard(grammar, matcher) if grammar is not None else None)
            if abort is not None and abort():
                raise SessionAborted(f"aborted after {len(out)} answer tokens")
        except NonFiniteLogitsError as exc:  # never "ok" on garbage: the monitor's fallback applies
            out, feed = [], []
            d = Decision(status="invalid", reason=str(exc))
            grammar = stream = None
            is_text = False
        except BaseException:
            self.rollback(cp)  # e.g. the KV cache is full: the context is left as before the call
            raise
        else:
            d = Decision(status="deadline_missed" if stats.deadline_missed else "invalid", reason=stats.reason,
                         **stats.counters())
            is_text = True
        if stream is not None:
            stream(out)  # grammar-forced tokens that closed the answer after the last step
        d.prefill_tokens = len(prefill)
        d.text = self.tok.decode(out)
        is_text = is_text and (grammar is None or grammar.mode == "json"
                               or (grammar.mode == "auto" and d.text[:1] not in ("", fmt.first)))
        settle(d, matcher, is_text, len(out), max_tokens, deadline_at, fmt)
        rewritten = several and keep_complete_calls(d, len(out), max_tokens, fmt)
        d.total_s = time.perf_counter() - t0
        d.kv = self.cache.take_metrics()
        if rewritten:  # the answer as returned (its complete, distinct calls) replaces what was decoded
            self.rollback(cp)
            self._append(trigger + self.tok.encode_text(d.text) + self.tok.encode(self.tok.assistant_suffix),
                         "assistant")
        elif d.status in ("ok", "text"):
            # The answer stays in the context; its unprocessed tail is prefilled with the next observe().
            end = self.tok.encode(self.tok.assistant_suffix)
            self.pending = feed + end
            self.segments[-1].kind = "assistant"
            self.segments[-1].end = len(self.target.tokens) + len(self.pending)
        else:
            self.rollback(cp)
        return d

    def _auto_rule(self, grammar, threshold: float | None) -> AutoRule | None:
        # tool_choice "auto": the rule of its first position (`tokenspeed.auto`)
        if grammar is None or grammar.call_start is None:
            return None
        threshold = threshold if threshold is not None else self.engine.auto_threshold.get(self.tool_prompt)
        return AutoRule(grammar.call_start.to(self.engine.device), grammar.call_evidence.to(self.engine.device),
                        threshold)

    def _repeat_guard(self):
        # decode()'s on_token callback under parallel calls: True (end the answer) once the last
        # complete call repeats an earlier one (a small model may repeat one call until max_tokens)
        fmt = self.engine.call_format

        def repeated(out: list[int]) -> bool:
            calls = complete_tool_calls(self.tok.decode(out), fmt)
            return len(calls) > 1 and calls[-1] in calls[:-1]

        return repeated

    def _loop_guard(self, grammar, matcher):
        # decode()'s `force` callback: the quote that ends a JSON string of the answer once it runs in
        # a loop (`looping_string`; else only its length cap would end it, at about max_tokens); once
        # the answer runs away outside its strings (`looping_structure`: nested too deep, or one unit
        # deepening it repeated) the first of `json_closings` the grammar accepts, which ends the
        # JSON. Under "auto" only in a call: a text answer is free text.
        quote, first = self.tok.encode_text('"'), None if grammar.mode == "json" else self.engine.call_format.first

        def close(out: list[int]) -> list[int]:
            text = self.tok.decode(out)
            if first is not None and not text.startswith(first):
                return []
            if looping_string(text):
                return quote
            if looping_structure(text):
                for closing in json_closings(text):
                    ids = self.tok.encode_text(closing)
                    if matcher.validate_tokens(ids) == len(ids):
                        return ids
            return []

        return close

    def _text_stream(self, on_text, calls: bool = False):
        # decode()'s on_token callback: new complete UTF-8 text of a text answer -> on_text(piece);
        # calls: the answer may be a call instead (tool_choice="auto"), whose text is never streamed.
        if on_text is None:
            return None
        printed = ""

        def stream(out: list[int]) -> bool:
            nonlocal printed
            text = self.tok.decode(out)
            if (calls and text.startswith(self.engine.call_format.first)) or text.endswith("\ufffd"):
                # a call, or an incomplete character
                return False
            piece, printed = text[len(printed):], text
            return bool(piece) and bool(on_text(piece))

        return stream

    def generate(self, prompt: str | None = None, max_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, on_token=None) -> str:
        """Chat completion: add `prompt` as a user turn (if given) and generate the assistant's reply.

        Args:
            prompt: user message text, or None to continue from the current context.
            max_tokens: most new tokens.
            temperature: 0 for greedy; > 0 samples from softmax(logits / temperature).
            top_p: nucleus sampling mass (Holtzman et al., 2020), used when temperature > 0.
            seed: RNG seed for sampling: reproducible outputs without speculation
                (`Engine.speculation` None). With it, the draws depend on which tokens were
                proposed, and the adaptive length and the draft model's on/off switch follow
                measured timings, so a seed fixes the distribution, not the exact text.
            on_token: callback(str) receiving each new text piece as it is generated (streaming).
        Returns:
            the generated text (the reply stays in the context). With speculation, greedy output
            is identical and sampled output has the same distribution (rejection sampling).
        Raises:
            SessionArgumentError: prompt not a string or None (or not valid Unicode), max_tokens
                not a positive integer, temperature negative or not finite, top_p outside (0, 1],
                seed not None or an integer in [0, 2**64), on_token not callable.
            NonFiniteLogitsError: a forward produced NaN/inf logits (corrupt weights in memory).
            ValueError: the KV cache is full (the prompt or the reply does not fit).
        On an error the session is left as it was before the call (the prompt is not added).
        """
        if prompt is not None and not isinstance(prompt, str):
            raise SessionArgumentError(f"prompt must be a string or None, got {type(prompt).__name__}")
        if prompt is not None:
            _text_arg(prompt, "prompt")
        positive_int_arg(max_tokens, "max_tokens")
        sampling_args(temperature, top_p)
        _seed_arg(seed)
        _callback_arg(on_token, "on_token")
        cp = self.checkpoint()
        try:
            if prompt is not None:
                self._append(self._render([{"role": "user", "content": prompt}]), "text")
            self._append(self.tok.encode(self.tok.assistant_prefix), "assistant")
            feed, self.pending = self.pending, []
            gen = torch.Generator(self.engine.device).manual_seed(seed) if seed is not None else None
            out, feed, _ = decode(self.target, self.speculator, feed, tok=self.tok, max_tokens=max_tokens,
                                  temperature=temperature, top_p=top_p, generator=gen,
                                  on_token=self._text_stream(on_token))
        except BaseException:
            self.rollback(cp)  # e.g. the KV cache is full: the context is left as before the call
            raise
        self.pending = feed + self.tok.encode(self.tok.assistant_suffix)
        self.segments[-1].end = len(self.target.tokens) + len(self.pending)
        return self.tok.decode(out)
