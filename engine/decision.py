"""What a decision returns (`Decision`) and how its status is settled; the session's context records
(`Segment`, `Checkpoint`) and argument checks."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from .grammar import SMOLLM2, CallFormat, complete_tool_calls, format_tool_calls, parse_tool_calls

__all__ = ["Decision", "Segment", "Checkpoint", "SessionArgumentError", "settle", "keep_complete_calls", "finite_arg", "positive_int_arg",
           "sampling_args"]


class SessionArgumentError(ValueError, TypeError):
    """An argument of a `Session` method is invalid (the message names it and what is accepted).

    A ValueError and a TypeError, so callers that caught either before keep working.
    """


def finite_arg(value, name: str, unit: str = "") -> float | None:
    """A finite number, or None; else SessionArgumentError (a NaN deadline would disable it)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SessionArgumentError(f"{name} must be a finite number{unit}, got {value!r}")
    return float(value)


def sampling_args(temperature, top_p) -> None:
    """Check sampling settings: temperature >= 0 and top_p in (0, 1], else SessionArgumentError."""
    t, p = finite_arg(temperature, "temperature"), finite_arg(top_p, "top_p")
    if t is None or p is None or t < 0 or not 0 < p <= 1:
        raise SessionArgumentError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")


def positive_int_arg(value, name: str) -> int:
    """`value` when it is a positive int (not a bool), else SessionArgumentError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SessionArgumentError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass
class Decision:
    """Result of `Session.decide()`.

    Attributes:
        status: "ok" (valid tool call(s), in time; `reason` "max_tokens" when they are the complete
            calls of a list cut there, see `keep_complete_calls`), "deadline_missed", "invalid" (the budget of
            tokens ran out inside a call, or the grammar failed), or "text" (tool_choice "auto" or
            "none", or a response format: the model answered in text; `reason` is "max_tokens"
            when the text was cut there, else empty).
        tool_call: the first call, `{"name": str, "arguments": dict}` (TokenSpeed's own shape:
            arguments already parsed), when status == "ok", else None. `openai_message()` gives
            OpenAI's shape.
        tool_calls: every call of the answer in the same shape (several only with parallel=True).
        text: the generated text (the raw call, or the text answer).
        reason: why the status is not "ok" (empty when ok).
        ttft_s: decide() start -> first token chosen, seconds.
        itl_s: seconds between consecutive sampled tokens (amortised over the tokens of a step
            when one verification emits several).
        total_s: decide() wall time, seconds.
        prefill_tokens: trigger tokens prefilled at decide() time (history was already cached).
        forwards: model forward passes.
        forced_tokens: tokens appended by jump-forward without sampling.
        generated_tokens: tokens chosen by sampling (model decisions).
        draft_tokens: tokens proposed by drafters and verified by the target (grammar-forced
            runs inside a draft chain are counted in forced_tokens, not here).
        accepted_tokens: of draft_tokens, how many the target accepted.
        draft_sources: {"canonical" | "lookup" | "model": [proposed, accepted]} per drafter.
        drafted_ahead: decode steps whose chain was drafted during the previous step's forward
            (pipelined drafting, `tokenspeed.decode`): the guess it assumed came true.
        p_call: tool_choice "auto": the probability mass the model put on opening a call at the
            answer's first position (`tokenspeed.auto`); None otherwise.
        kv: KV tiering metrics since the previous decision (pruned sessions only, else None):
            see `tokenspeed.kv.TieredKVCache.take_metrics`.
    """

    status: str
    tool_call: dict | None = None
    tool_calls: list[dict] = field(default_factory=list)
    text: str = ""
    reason: str = ""
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    prefill_tokens: int = 0
    forwards: int = 0
    forced_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_sources: dict = field(default_factory=dict)
    drafted_ahead: int = 0
    p_call: float | None = None
    kv: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def cut(self) -> bool:
        """Whether `max_tokens` ended the answer: a text, the complete calls of a call list cut
        there (reason "max_tokens"), or a call cut before it was complete (status "invalid")."""
        return self.status != "deadline_missed" and "max_tokens" in self.reason

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason: "tool_calls", "stop", "length" (`cut` at max_tokens: a text, the
        complete calls of a call list cut there, or a call cut before it was complete, status
        "invalid"), or TokenSpeed's "deadline" (deadline_missed) and "invalid" (the grammar failed:
        no valid call, see `reason`)."""
        if self.status == "deadline_missed":
            return "deadline"
        if self.cut:
            return "length"
        return {"ok": "tool_calls", "text": "stop"}.get(self.status, "invalid")

    def openai_message(self, call_ids: list[str] | None = None) -> dict:
        """The answer as an OpenAI chat-completions assistant message.

        `{"role": "assistant", "content": None, "tool_calls": [{"id", "type": "function",
        "function": {"name", "arguments": "<JSON string>"}}]}` for calls; `{"role": "assistant",
        "content": text}` for a text answer; content None for "deadline_missed" and "invalid"
        (never a half call).

        Args:
            call_ids: ids for the calls (default "call_0", "call_1", ...).
        """
        if self.status == "ok":
            ids = call_ids or [f"call_{i}" for i in range(len(self.tool_calls))]
            return {"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for i, c in zip(ids, self.tool_calls)]}
        return {"role": "assistant", "content": self.text if self.status == "text" else None}

    def timings(self) -> dict:
        """Timings in milliseconds plus token counts, for printing or JSON."""
        itl = sorted(self.itl_s)
        return {"ttft_ms": self.ttft_s * 1e3, "total_ms": self.total_s * 1e3,
                "itl_ms_p50": itl[len(itl) // 2] * 1e3 if itl else None,
                "prefill_tokens": self.prefill_tokens, "forwards": self.forwards,
                "forced_tokens": self.forced_tokens, "generated_tokens": self.generated_tokens,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "drafted_ahead": self.drafted_ahead}


@dataclass
class Segment:
    """A span of context tokens [start, end) in cache order, with what it holds.

    kind: "system" (system prompt + tool schemas, pinned), "text", "sensor", "assistant", "trigger".
    source: who produced it (e.g. "joint_states"), or "".
    """

    start: int
    end: int
    kind: str
    source: str = ""
    pinned: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """Opaque session state for `Session.rollback()`."""

    n_tokens: int
    pending: tuple[int, ...]
    n_segments: int
    last_segment_end: int
    kv: object = None  # tokenspeed.kv.KVSnapshot for pruned sessions
    session_id: int = 0  # the session it belongs to: another session's checkpoint is refused
    branch: int = 0  # the branch of the context it was taken on (a rollback starts a new one)
    serial: int = 0  # taken order within the session: on an abandoned branch, later ones are invalid


def settle(d: Decision, matcher, is_text: bool, n_out: int, max_tokens: int, deadline_at: float | None,
           fmt: CallFormat = SMOLLM2) -> None:
    """Set the decision's final status and reason from how decoding ended (a call is parsed here,
    in the family's call format `fmt`)."""
    if deadline_at is not None and time.monotonic() >= deadline_at and d.status != "deadline_missed":
        d.status, d.reason = "deadline_missed", "deadline passed before the answer completed"
    elif d.status == "deadline_missed":
        pass
    elif is_text and (matcher is None or matcher.is_accepting() or n_out >= max_tokens):
        d.status, d.reason = "text", "max_tokens" if n_out >= max_tokens else ""
    elif d.status == "invalid" and not d.reason and matcher.is_accepting():
        calls = parse_tool_calls(d.text, fmt)
        if calls is not None:
            d.status, d.tool_calls, d.tool_call = "ok", calls, calls[0]
        else:
            d.reason = f"output is not a tool call: {d.text[:80]!r}"


def keep_complete_calls(d: Decision, n_out: int, max_tokens: int, fmt: CallFormat = SMOLLM2) -> bool:
    """Runaway guard of an answer that may hold several calls: keep its complete, distinct calls.

    A call list that ended where a call repeated an earlier one (the decode loop stops there:
    `Session._repeat_guard`; or the list closed after one) becomes the calls before the first
    repeat, status "ok"; one cut at `max_tokens` becomes its complete calls so far, status "ok"
    with reason "max_tokens" (finish "length"). `d.text` is then those calls as the grammar writes
    them in `fmt`. Anything else is left as it is.

    Returns:
        whether `d` was changed (its text is no longer the decoded tokens).
    """
    cut = d.status == "invalid" and n_out >= max_tokens
    if not (d.status == "ok" or cut or (d.status == "invalid" and not d.reason)):
        return False
    calls = complete_tool_calls(d.text, fmt)
    distinct = next((calls[:i] for i in range(1, len(calls)) if calls[i] in calls[:i]), calls)
    if not distinct or (d.status == "ok" and len(distinct) == len(calls)):
        return False
    d.status, d.tool_calls, d.tool_call = "ok", distinct, distinct[0]
    d.reason = "max_tokens" if cut and len(distinct) == len(calls) else ""
    d.text = format_tool_calls(distinct, fmt)
    return True
