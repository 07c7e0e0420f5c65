"""The engine thread: owns the tokenspeed Engine and its resident Session.

ROS callbacks never block on inference: they hand observations and decision requests to this
thread and return. Observations are coalesced per source (a newer reading replaces one not yet
prefilled, so the backlog never exceeds one entry per source); at most one decision request is
outstanding. A reading identical to its source's previous one, with at most `repeat_slack`
tokens of other observations after that one, is not prefilled again (it is echoed with 0
tokens). A decision request may bring its own observation (a state line that stands for the
queued readings): then only that line is prefilled before the decision, and queued readings
wait; readings are prefilled one at a time, so a request waits for at most one observe(). Results come back through `drain()`, and `notify()` (a ROS guard condition's
trigger) wakes the executor to collect them.

The session's hot KV cache is bounded by the engine's relevance pruning (`kv_budget` tokens):
sensor readings are observed with kind "sensor" and their source, so a newer reading of the same
source supersedes the older one first; goals are pinned. Old history moves to the engine's cold
tier instead of growing the per-token cost.

Decided ahead (speculative actions): `decide_ahead(restate, tool_choice)` prefills a predicted
state line on a session checkpoint and decides there while the engine is otherwise idle. A later
`decide()` whose state line and tool_choice are exactly the predicted ones, with nothing observed
in between, is answered with that call at once ("hit"; `drain()` gives a `DecidedAhead` when the
call is ready): its context is then token for token the
one a fresh decision would have had, so under greedy decoding the call is the one a fresh decision
gives. Anything else is a "miss": the state line of the request is observed on the checkpoint
instead (`Session.observe`'s since), so the predicted line's tokens up to the first one that
differs keep their KV and only the rest is prefilled (a moved cube changes the line from its
coordinates on); the context is then again token for token a fresh decision's.
A call the node did not publish (`not_executed`: its deadline passed before it was out) is rolled
back out of the context, as a decision that misses its deadline inside the engine is: the context
never says the robot did what it did not do.
Each result carries a `DecisionTrace` of its stages.
"""
from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import jsonschema
import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

from tokenspeed.stages import LoadStages, process_age_s
from tokenspeed_ros.deadline_monitor import ModelResult
from tokenspeed_ros.launch_spec import help_requested
from tokenspeed_ros.spin import SPIN_TIMEOUT_S, spin_once

GIL_SWITCH_INTERVAL_S = 0.001     # CPython's thread switch interval in the node processes (s)
TAKE_BACK_OBSERVATIONS = 32        # a call is taken back (`not_executed`) until this many observations followed it
AHEAD_BUDGET_S = 10.0             # a decision decided ahead may take this long (no robot waits on it) (s)
THREAD_DIED = "engine thread died"
# What the engine thread's load imports (torch first), imported ahead on a thread from process start
ENGINE_MODULES = ("tokenspeed.engine", "tokenizers", "llguidance", "jinja2", "safetensors.torch")


@dataclass
class Observed:
    """An observation as it entered the session: tokens appended (0 when there is no engine)."""

    source: str
    text: str
    stamp_s: float          # sensor stamp, seconds
    tokens: int


@dataclass
class DecidedAhead:
    """A call decided ahead (`EngineWorker.decide_ahead`) is ready: the state line it assumed and the call."""

    text: str
    call: dict              # {"name", "arguments"}


@dataclass
class DecisionTrace:
    """Where one decision's time went on the engine thread. Times are wall clock (time.time()
    seconds, comparable with ROS stamps on one host); 0.0 where a stage did not happen.

    queued: the node handed the request over; prefill_start / prefill_end: the observations
    prefilled for this decision right before it (the state line, or the queue); decide_start /
    first_token / end: decide() and its first token; for a decision decided ahead ("hit") these
    are when the stored call was taken, and ahead_* say how it was made. Tokens: prefill_tokens
    prefilled before the decision on its path; kept_tokens: those of its observations that kept
    their KV instead (`Session.observe`'s since: the predicted line's common prefix on a miss, or
    the unanswered line's that it replaced); tokens_in: every token that entered the context for this
    decision since the last one (observations, the state line, decide()'s trigger tokens; not the
    answer); request_tokens: the tokens prefilled between the request (the reading it answers)
    and the call (its state line where not yet in the context, decide()'s trigger tokens; 0 for a
    call decided ahead); context_tokens: the context when it decided.
    """

    queued: float
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    prefill_tokens: int = 0
    kept_tokens: int = 0
    decide_start: float = 0.0
    first_token: float = 0.0
    end: float = 0.0
    tokens_in: int = 0
    request_tokens: int = 0
    context_tokens: int = 0
    ahead: str = ""                 # "hit", "miss" or "" (none was decided ahead)
    ahead_prefill_ms: float = 0.0
    ahead_decide_ms: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Ahead:
    """A decision decided ahead on a checkpoint: what it assumed and what it gave."""

    source: str
    text: str
    tool_choice: object
    checkpoint: object              # tokenspeed Checkpoint before the predicted state line
    book: tuple                     # the worker's bookkeeping at the checkpoint (`EngineWorker._book`)
    answer: tuple                   # (Checkpoint, bookkeeping) after the state line, before its call
    result: tuple                   # (status, call, reason) of the decision
    tokens_in: int                  # state line + trigger tokens
    prefill_ms: float
    decide_ms: float


class CallChecker:
    """Validates a tool call against its tool's JSON schema before it may reach the robot: the
    engine's grammar already constrains decoding; this is the independent check at the
    boundary. tools: OpenAI tool dicts."""

    def __init__(self, tools: list[dict]):
        self._validators = {t["function"]["name"]: jsonschema.Draft202012Validator(
            t["function"].get("parameters", {"type": "object"})) for t in tools}

    def problem(self, call: dict) -> str | None:
        """None when `call` ({"name", "arguments"}) names a known tool with valid arguments,
        else why not."""
        validator = self._validators.get(call.get("name"))
        if validator is None:
            return f"unknown tool {call.get('name')!r}"
        error = jsonschema.exceptions.best_match(validator.iter_errors(call.get("arguments")))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            return f"{call['name']}: {where}: {error.message}"
        return None


class EngineWorker:
    """A daemon thread that loads the engine, prefills observations and runs decisions.

    model: path, "tiny-random" or "" (embedded model); threads: CPU threads (0 = engine default);
    quantize: "auto", "gguf", "int4", "int8" or "none" (fp32 weights); device ("auto", "cpu", "cuda[:N]") and
    dtype ("auto", "float32", ...): see `tokenspeed.Engine.load`;
    system: system prompt; tools: OpenAI tool dicts; tool_choice: passed to decide() unless a
    request brings its own;
    kv_budget: hot KV tokens of the session (relevance pruning beyond it); repeat_slack: see above
    (tokens; 0 = only when the reading is still the context's last observation); replace_sources:
    sources whose reading replaces the previous one of the same source when that one is still the
    context's last observation and no decision answered it (the session rolls back to before it:
    e.g. state lines, so that missed decisions do not leave a trail of stale states);
    notify: called from the engine thread whenever `drain()` has something new; logger: rclpy
    logger; stages: the node's start-up `LoadStages` so far, which the load continues (`stages`:
    complete once `state` is "ready"). `state` is "loading", "ready" or "fault" (then `fault` says
    why): an exception that ends the thread after the load (e.g. torch refusing a thread count) is a fault too - the
    decision in flight is answered "engine_fault" and every later one falls back at once, so
    /diagnostics shows the engine as an error, never `ready`.
    """

    def __init__(self, *, model: str, threads: int, system: str, tools: list[dict], tool_choice,
                 kv_budget: int, notify: Callable[[], None], logger, repeat_slack: int = 0, quantize: str = "auto",
                 device: str = "auto", dtype: str = "auto", replace_sources: tuple[str, ...] = (),
                 stages: LoadStages | None = None):
        self.stages = stages if stages is not None else LoadStages()
        self._cfg = dict(model=model or None, threads=threads or None, system=system, tools=tools,
                         quantize=None if quantize == "none" else quantize, device=device, dtype=dtype)
        self._tool_choice = tool_choice
        self._checker = CallChecker(tools)
        self._kv_budget = kv_budget
        self._notify = notify
        self._log = logger
        self.state = "loading"
        self.ready_at = 0.0             # time.time() when `state` became "ready" (0 until then)
        self.fault = ""
        self.context_tokens = 0
        self.weights = ""               # the engine's weight format once loaded (fp32, int8, int4)
        self.coalesced = 0          # observations replaced before they were prefilled
        self._cv = threading.Condition()
        self._obs: dict[str, tuple[str, str, float]] = {}  # source -> (text, kind, stamp_s), not yet prefilled
        self._request: tuple | None = None   # (decision_id, deadline_at, tool_choice, restate, queued at)
        self._new_episode = False       # new_episode() was called: roll back before anything else
        self._episode_start = None      # Checkpoint of the session with only the system prompt and tools
        # since the last decision: observations, their tokens, seconds prefilling them, and of the
        # tokens how many kept their KV (not prefilled, `_observe`'s since)
        self._prefill = [0, 0, 0.0, 0]
        self._missed = ""                          # "miss" when the next decision's ahead one was dropped
        self._ahead_request: tuple | None = None   # (restate, tool_choice) to decide ahead when idle
        self._ahead_running = False                # the engine thread is deciding ahead now
        self._ahead: _Ahead | None = None          # the decision decided ahead, until used or dropped
        self.ahead_counts = {"hit": 0, "miss": 0, "redone": 0, "dropped": 0, "failed": 0}
        self._repeat_slack = repeat_slack
        self._observed = 0                                 # tokens observed so far (decisions not counted)
        self._previous: dict[str, tuple[str, int]] = {}    # source -> (text, self._observed after it)
        self._replace = frozenset(replace_sources)
        # the context's last observation while no decision answered it: (source, Checkpoint before
        # it, the bookkeeping before it)
        self._unanswered: tuple | None = None
        # the last call answered (the context's last answer): (decision_id, Checkpoint before the call,
        # the bookkeeping before it, [(source, (text, kind, stamp_s)) observed after it]), until the
        # next decision, decision ahead or episode; `not_executed` takes it back
        self._answered: tuple | None = None
        self._retract: int | None = None    # not_executed()'s decision id, for the engine thread
        self._out: list[Observed | ModelResult] = []
        self._stop = False
        self._loaded = threading.Event()
        self._has_output = threading.Event()     # set while drain() has something
        self._threads: int | None = None     # CPU threads to switch to before the next engine step
        self.threads = 0                     # CPU threads of the engine thread (0 until loaded)
        self._session = None
        self._thread = threading.Thread(target=self._run, name="tokenspeed-engine", daemon=True)

    def start(self) -> None:
        """Start the thread (it loads the model first)."""
        self._thread.start()

    def close(self, timeout: float = 1.0) -> bool:
        """Ask the thread to stop after its current step and wait up to `timeout` seconds.

        Returns False when it is still busy (a model load or forward cannot be interrupted);
        the caller should then end the process with os._exit, since finalizing the interpreter
        under a running torch thread can abort.
        """
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_loaded(self, timeout: float | None = None) -> str:
        """Wait until the model is loaded or failed to (at most `timeout` seconds; None = no
        limit); returns `state`."""
        self._loaded.wait(timeout)
        return self.state

    def set_threads(self, threads: int) -> None:
        """Use `threads` CPU threads (0 = the count torch had before the engine loaded) from the
        engine's next step on."""
        with self._cv:
            self._threads = threads
            self._cv.notify()

    def set_repeat_slack(self, tokens: int) -> None:
        """Change repeat_slack (see the class docstring), tokens."""
        with self._cv:
            self._repeat_slack = tokens

    def observe(self, source: str, text: str, stamp_s: float, kind: str = "sensor") -> None:
        """Queue an observation: kind "sensor" (superseded by newer readings of the source) or
        "text" (pinned, e.g. the goal). It replaces a queued, not yet prefilled one from the
        same source and goes to the back of the queue (observations queued before a decide()
        request are prefilled before it, in the order of their latest observe())."""
        with self._cv:
            if self._obs.pop(source, None) is not None:
                self.coalesced += 1
            self._obs[source] = (text, kind, stamp_s)
            self._cv.notify()

    def new_episode(self) -> None:
        """Start a new episode (e.g. a new task): queued observations and decide_ahead() requests
        are dropped, a decision in progress stops at its next forward (answered "superseded"), and
        before anything observed or requested after this call, the session rolls back to its
        system prompt and tools (`Session.rollback`), so nothing of the last episode - its
        readings, its calls - stays in the context for the next decisions to copy."""
        with self._cv:
            self._obs.clear()
            self._ahead_request = None      # here, not on the engine thread: one made after this call stays
            self._new_episode = True
            self._cv.notify()

    def decide(self, decision_id: int, deadline_at: float, tool_choice=None,
               restate: tuple[str, str, float] | None = None) -> None:
        """Request a decision that must finish by `deadline_at` (time.monotonic() seconds), with
        `tool_choice` (as Session.decide; None = the worker's default), e.g. OpenAI's
        allowed_tools form for the tools whose preconditions hold now.

        restate: (source, text, stamp_s) of a "sensor" observation prefilled right before the
        decision (skipped when it is already the context's last message); queued readings are
        then prefilled after the decision. None: queued readings are prefilled first.
        Raises RuntimeError if a request is still queued (callers keep one outstanding).
        """
        with self._cv:
            if self.fault.startswith(THREAD_DIED):     # nobody would answer it
                self._emit(ModelResult(decision_id, "engine_fault", reason=self.fault))
                return
            if self._request is not None:
                raise RuntimeError("a decision request is already queued")
            self._request = (decision_id, deadline_at, self._tool_choice if tool_choice is None else tool_choice,
                             restate, time.monotonic(), DecisionTrace(time.time()))
            self._cv.notify()

    def not_executed(self, decision_id: int) -> None:
        """The call answering decision `decision_id` was never executed (the deadline monitor
        dropped it as late, or published the fallback in its place): before anything observed or
        requested after this call, the session rolls back to before that call, as for a decision
        that missed its deadline inside the engine (its state line is again unanswered), and what
        was observed after the call is observed again. Nothing changes when a later decision,
        decision ahead or episode, or more than TAKE_BACK_OBSERVATIONS observations came since
        (logged): the node calls it as soon as the monitor resolved the result."""
        with self._cv:
            self._retract = decision_id
            self._cv.notify()

    def decide_ahead(self, restate: tuple[str, str, float], tool_choice) -> None:
        """Decide the next call ahead when the engine is idle: prefill `restate` ((source, text,
        stamp_s), the state line predicted for the next decision) on a checkpoint and decide with
        `tool_choice` there (see the module docstring). Replaces one not yet started; anything
        observed or requested before it starts cancels it."""
        with self._cv:
            self._ahead_request = (restate, tool_choice)
            self._cv.notify()

    @property
    def ahead_pending(self) -> bool:
        """A decide_ahead() request is waiting for the engine or being decided now."""
        return self._ahead_request is not None or self._ahead_running

    @property
    def decided_ahead(self) -> dict | None:
        """The call decided ahead and not yet used or dropped ({"name", "arguments"}), or None."""
        ahead = self._ahead
        return None if ahead is None else ahead.result[1]

    def drain(self) -> list[Observed | DecidedAhead | ModelResult]:
        """Everything finished since the last call, in order."""
        with self._cv:
            out, self._out = self._out, []
            self._has_output.clear()
        return out

    def wait_output(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until drain() has something; returns whether it has."""
        return self._has_output.wait(timeout)

    # ------------------------------------------------------------------ engine thread
    def _emit(self, item) -> None:
        with self._cv:      # after close() the node and its guard condition may be gone
            self._out.append(item)
            self._has_output.set()
            if not self._stop:
                self._notify()

    def _run(self) -> None:
        in_flight: list[int] = []       # the decision id taken from the queue and not yet answered
        try:
            self._serve(in_flight)
        except Exception as e:  # noqa: BLE001 - the thread must not die silently
            self.state, self.fault = "fault", f"{THREAD_DIED}: {type(e).__name__}: {e}"
            self._log.error(self.fault)
            with self._cv:
                queued, self._request = self._request, None
            for decision_id in in_flight + ([queued[0]] if queued is not None else []):
                self._emit(ModelResult(decision_id, "engine_fault", reason=self.fault))

    def _serve(self, in_flight: list[int]) -> None:
        default_threads = self._load()
        while True:
            with self._cv:
                while (not self._stop and not self._obs and self._request is None and self._threads is None
                       and not self._new_episode and self._ahead_request is None and self._retract is None):
                    self._cv.wait()
                if self._stop:
                    return
                if self._retract is not None:   # under the lock: before anything requested after not_executed()
                    self._take_back(self._retract)
                    self._retract = None
                    continue
                if self._new_episode:       # under the lock: what is observed next joins the new episode
                    self._new_episode = False
                    self._drop_ahead("dropped")
                    self._begin_episode()
                    continue
                if self._threads is not None:
                    import torch    # imported by the load

                    torch.set_num_threads(self._threads or default_threads)   # OpenMP: this thread's own
                    self.threads = torch.get_num_threads()
                    self._log.info(f"engine threads: {self.threads}")
                    self._threads = None
                    if not self._obs and self._request is None:
                        continue
                ahead_job = None
                if self._request is not None:
                    self._ahead_request = None      # too late to decide ahead
                elif not self._obs:                 # readings first: the prediction follows them
                    ahead_job, self._ahead_request = self._ahead_request, None
                    self._ahead_running = ahead_job is not None
                request, self._request = self._request, None
                in_flight[:] = [] if request is None else [request[0]]
                if request is not None and request[3] is not None:     # the state line stands for the queue
                    source, text, stamp_s = request[3]
                    self._obs.pop(source, None)
                    batch = [(source, (text, "sensor", stamp_s))]
                elif request is not None:                                # everything queued, then decide
                    batch, self._obs = list(self._obs.items()), {}
                elif self._obs:                                          # one reading, then look again
                    source = next(iter(self._obs))
                    batch = [(source, self._obs.pop(source))]
            if ahead_job is not None:
                try:
                    self._decide_ahead(*ahead_job)
                finally:
                    self._ahead_running = False
                continue
            if request is not None and self._ahead is not None and request[3] is not None and \
                    (request[3][0], request[3][1], request[2]) == (self._ahead.source, self._ahead.text,
                                                                  self._ahead.tool_choice):
                self._emit(self._take_ahead(*request))
                continue
            if request is None and self._ahead is not None:     # a reading came first: decide ahead again after it
                with self._cv:
                    self._ahead_request = self._ahead_request or (
                        (self._ahead.source, self._ahead.text, 0.0), self._ahead.tool_choice)
            # the first reading is observed on the checkpoint before the predicted line (`_observe`'s since)
            since = self._drop_ahead("miss" if request is not None else "redone", rewind=not batch)
            trace = request[5] if request is not None else None
            t0, n0, k0 = time.time(), self._prefill[1], self._prefill[3]
            for source, (text, kind, stamp_s) in batch:
                self._prefill_one(source, text, kind, stamp_s, since)
                since = None
            if request is not None:
                trace.prefill_start, trace.prefill_end = t0, time.time()
                trace.kept_tokens = self._prefill[3] - k0
                trace.prefill_tokens = self._prefill[1] - n0 - trace.kept_tokens
                trace.ahead = self._missed
                self._missed = ""
                self._emit(self._decide(*request))
                in_flight.clear()

    def _prefill_one(self, source: str, text: str, kind: str, stamp_s: float, since: tuple | None = None) -> None:
        t0 = time.monotonic()
        n, kept = self._observe(source, text, kind, since)
        if self._answered is not None:
            self._answered[3].append((source, (text, kind, stamp_s)))
            if len(self._answered[3]) > TAKE_BACK_OBSERVATIONS:     # long resolved (published): not kept for ever
                self._answered = None
        self._prefill[0] += n > 0
        self._prefill[1] += n
        self._prefill[2] += time.monotonic() - t0
        self._prefill[3] += kept
        self._log.debug(f"observed {source}: {n} tokens ({kept} kept) in {(time.monotonic() - t0) * 1e3:.0f} ms: {text}")
        self._emit(Observed(source, text, stamp_s, n))

    def _load(self) -> int:
        """Load the engine and open the session (state "ready", else "fault"); returns torch's thread
        count from before the load."""
        default_threads = 0
        try:
            t0, stages = time.perf_counter(), self.stages
            import tokenspeed
            import torch

            default_threads = torch.get_num_threads()
            stages.done("engine imports (torch; begun at process start)")
            engine = tokenspeed.Engine.load(self._cfg["model"], threads=self._cfg["threads"],
                                            quantize=self._cfg["quantize"], device=self._cfg["device"],
                                            dtype=self._cfg["dtype"], stages=stages)
            self._session = engine.session(system=self._cfg["system"], tools=self._cfg["tools"],
                                           kv_budget=self._kv_budget)
            stages.done("session: grammar tokenizer, system prompt and tools prefilled")
            self._episode_start = self._session.checkpoint()
            self.context_tokens = self._session.num_tokens
            self.weights = engine.weights
            self.threads = torch.get_num_threads()
            self.ready_at = time.time()
            self.state = "ready"
            self._log.info(f"engine ready in {time.perf_counter() - t0:.1f} s, {engine.weights} weights on {engine.device} "
                           f"({self.context_tokens} tokens of system prompt and tools); start-up stages from process "
                           f"start (CPU: the whole process, every thread):\n{stages.table()}")
            if engine.weight_choice is not None:
                self._log.info(engine.weight_choice.describe())
        except Exception as e:  # any failure: state "fault" (a managed node fails configure)
            self.state, self.fault = "fault", f"{type(e).__name__}: {e}"
            self._log.error(f"engine failed to load: {self.fault}")
        self._loaded.set()
        with self._cv:
            if not self._stop:
                self._notify()
        return default_threads

    def _begin_episode(self) -> None:
        if self._session is None:
            return
        dropped = self._session.num_tokens - self._episode_start.n_tokens
        try:
            self._session.rollback(self._episode_start)
        except Exception as e:  # the context goes on as it is: the next decisions still get a call or a fallback
            self._log.error(f"engine fault in new_episode(): {type(e).__name__}: {e}")
            return
        self._previous.clear()              # nothing observed so far is in the context any more
        self._unanswered = self._answered = None
        self._prefill = [0, 0, 0.0, 0]
        self.context_tokens = self._session.num_tokens
        self._log.info(f"new episode: {dropped} tokens of the last one dropped, context {self.context_tokens} tokens")

    def _book(self) -> tuple:
        """The worker's bookkeeping of the context (restored with a rollback)."""
        return dict(self._previous), self._observed, self._unanswered

    def _observe(self, source: str, text: str, kind: str, since: tuple | None = None) -> tuple[int, int]:
        """Put one reading into the context. Returns (tokens appended, of them how many kept their
        KV instead of being prefilled).

        A reading that repeats its source's previous one (see repeat_slack) appends nothing. One
        of `replace_sources` replaces the context's last observation when that is of its source
        and unanswered. since: (Checkpoint, `_book()`) that the session and the bookkeeping go
        back to first (a call decided ahead that missed); the reading is observed on it, or on the
        unanswered line it replaces, with `Session.observe`'s since: the tokens that followed
        there keep their KV as far as they equal the new ones."""
        if self._session is None:
            return 0, 0
        if since is not None:
            self._set_book(since[1])
        previous = self._previous.get(source)
        if previous is not None and previous[0] == text and self._observed - previous[1] <= self._repeat_slack:
            if since is not None:
                self._restore(*since)
            return 0, 0
        if self._unanswered is not None and self._unanswered[0] == source and source in self._replace:
            since = self._unanswered[1:]
            self._set_book(since[1])
        try:
            before = (source, since[0] if since is not None else self._session.checkpoint(), self._book())
            n = self._session.observe(text, role="user", kind=kind, source=source, pin=kind == "text",
                                      since=None if since is None else since[0])
            self.context_tokens = self._session.num_tokens
            self._observed += n
            self._previous[source] = (text, self._observed)
            self._unanswered = before
            return n, self._session.kept_tokens
        except Exception as e:
            self.context_tokens = self._session.num_tokens
            self._log.error(f"engine fault in observe({source}): {type(e).__name__}: {e}", throttle_duration_sec=10.0)
            return 0, 0

    def _decide_ahead(self, restate: tuple[str, str, float], tool_choice) -> None:
        if self._session is None:
            return
        self._drop_ahead("dropped")         # a newer prediction replaces it
        self._answered = None               # predicted after a call the robot executes
        source, text, _ = restate
        cp, book = self._session.checkpoint(), self._book()
        t0 = time.perf_counter()
        ok = False
        try:
            n, kept = self._observe(source, text, "sensor")
            if n:   # a miss goes back to where the line was observed (before the unanswered one it replaced)
                cp, book = self._unanswered[1], self._unanswered[2]
            answer = self._session.checkpoint(), self._book()
            t1 = time.perf_counter()
            d = self._session.decide(tool_choice=tool_choice, deadline_at=time.monotonic() + AHEAD_BUDGET_S)
            ok = d.status == "ok" and self._checker.problem(d.tool_call) is None
        except Exception as e:  # nothing is decided ahead; the next decision is made as usual
            self._log.error(f"engine fault in decide_ahead(): {type(e).__name__}: {e}", throttle_duration_sec=10.0)
        if not ok:
            self._restore(cp, book)
            self.ahead_counts["failed"] += 1
            return
        self._unanswered = None
        self._ahead = _Ahead(source, text, tool_choice, cp, book, answer, (d.status, d.tool_call, ""),
                             n + d.prefill_tokens, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        self.context_tokens = self._session.num_tokens
        self._log.info(f"decided ahead: {d.tool_call['name']} ({n - kept} tokens of predicted state prefilled in "
                       f"{self._ahead.prefill_ms:.0f} ms, decided in {self._ahead.decide_ms:.0f} ms)")
        self._emit(DecidedAhead(text, d.tool_call))

    def _restore(self, cp, book: tuple) -> None:
        """Roll the session back to `cp` and the bookkeeping (`_book()`) with it."""
        try:
            self._session.rollback(cp)
        except Exception as e:  # the context goes on as it is: the next decisions still get a call or a fallback
            self._log.error(f"engine fault in rollback(): {type(e).__name__}: {e}")
        self._set_book(book)
        self.context_tokens = self._session.num_tokens

    def _set_book(self, book: tuple) -> None:
        """Take back the bookkeeping `_book()` gave (the session goes back with it: `_restore`)."""
        self._previous, self._observed, self._unanswered = dict(book[0]), book[1], book[2]

    def _drop_ahead(self, why: str, rewind: bool = True) -> tuple | None:
        """Discard the decision decided ahead, if any: "miss" (the next decision's state line or
        tools differ), "redone" (a reading came first: it is decided ahead again after it),
        "dropped" (a new episode or a newer prediction). The session and the bookkeeping go back
        to before its state line; with rewind False they are left for the caller, who gets that
        (Checkpoint, book) to observe the next reading on (`_observe`'s since); else None."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        self.ahead_counts[why] += 1
        self._missed = "miss" if why == "miss" else self._missed
        self._log.info(f"decided-ahead call {ahead.result[1]['name']} {why}: rolled back")
        if not rewind:
            return ahead.checkpoint, ahead.book
        self._restore(ahead.checkpoint, ahead.book)
        return None

    def _take_back(self, decision_id: int) -> None:
        """not_executed(decision_id) on the engine thread (under the lock): roll the session back to
        before that decision's call and queue again what was observed after it (a reading queued
        since replaces its source's)."""
        answered, self._answered = self._answered, None
        if answered is None or answered[0] != decision_id:
            self._log.warning(f"decision {decision_id} was not executed, but its call is no longer the context's "
                              f"last answer: the context is left as it is")
            return
        _, cp, book, since = answered        # no decision ahead since: it would have ended `_answered`
        tokens = self._session.num_tokens
        self._restore(cp, book)
        self._obs = {**dict(since), **self._obs}
        self._log.info(f"decision {decision_id}: its call was not executed: rolled back ({tokens - self.context_tokens} "
                       f"tokens), {len(since)} observations after it queued again")

    def _take_ahead(self, decision_id: int, deadline_at: float, tool_choice, restate, queued_at: float,
                    trace: DecisionTrace) -> ModelResult:
        """Answer a request with the call decided ahead for exactly its state line and tool choice."""
        ahead, self._ahead = self._ahead, None
        self.ahead_counts["hit"] += 1
        self._answered = (decision_id, *ahead.answer, [])
        now = time.time()
        self._emit(Observed(restate[0], restate[1], restate[2], 0))     # the line is in the context now
        status, call, reason = ahead.result
        trace.prefill_start = trace.prefill_end = trace.decide_start = trace.first_token = trace.end = now
        trace.tokens_in, self._prefill = self._prefill[1] + ahead.tokens_in, [0, 0, 0.0, 0]
        trace.context_tokens, trace.ahead = self.context_tokens, "hit"
        trace.ahead_prefill_ms, trace.ahead_decide_ms = ahead.prefill_ms, ahead.decide_ms
        self._log.info(f"decision {decision_id}: {status} {call['name']} decided ahead (hit); queued -> taken "
                       f"{(time.monotonic() - queued_at) * 1e3:.1f} ms, budget left "
                       f"{(deadline_at - time.monotonic()) * 1e3:.0f} ms")
        return ModelResult(decision_id, status, call, reason, 0.0, time.monotonic() - queued_at, trace.as_dict())

    def _decide(self, decision_id: int, deadline_at: float, tool_choice, restate, queued_at: float,
                trace: DecisionTrace) -> ModelResult:
        if self._session is None:
            return ModelResult(decision_id, "engine_fault", reason=self.fault or "engine not loaded")
        from tokenspeed import SessionAborted   # loaded with the engine (the module stays torch-free)

        started = time.monotonic()
        trace.decide_start = time.time()
        trace.context_tokens = self._session.num_tokens
        self._answered = None
        try:
            before, book = self._session.checkpoint(), self._book()
            d = self._session.decide(tool_choice=tool_choice, deadline_at=deadline_at,
                                     abort=lambda: self._new_episode)
            status, call, reason = d.status, d.tool_call, d.reason or ""
            problem = self._checker.problem(call) if status == "ok" else None
            if problem is not None:     # never executed, and not left in the context as if it were
                self._session.rollback(before)
                status, call, reason = "invalid", None, problem
            if status in ("ok", "text"):    # the answer stays in the context: the last observation is answered
                self._unanswered = None
            if status == "ok":
                self._answered = (decision_id, before, book, [])
        except SessionAborted:     # the session is as before decide()
            self._log.info(f"decision {decision_id}: superseded by a new episode")
            return ModelResult(decision_id, "superseded", reason="a new episode began", trace=trace.as_dict())
        except Exception as e:
            self._log.error(f"engine fault in decide(): {type(e).__name__}: {e}", throttle_duration_sec=10.0)
            return ModelResult(decision_id, "engine_fault", reason=f"{type(e).__name__}: {e}")
        self.context_tokens = self._session.num_tokens
        n_obs, n_tok, prefill_s, n_kept = self._prefill
        self._prefill = [0, 0, 0.0, 0]
        trace.first_token, trace.end = trace.decide_start + (d.ttft_s or 0.0), time.time()
        trace.tokens_in = n_tok + d.prefill_tokens
        trace.request_tokens = trace.prefill_tokens + d.prefill_tokens
        self._log.info(
            f"decision {decision_id}: {status} {call['name'] if call else reason}; queued -> decide "
            f"{(started - queued_at) * 1e3:.0f} ms, budget left {(deadline_at - started) * 1e3:.0f} ms; since the last "
            f"decision {n_obs} observations, {n_tok - n_kept} tokens prefilled in {prefill_s * 1e3:.0f} ms"
            f"{f' ({prefill_s * 1e3 / (n_tok - n_kept):.1f} ms/token)' if n_tok > n_kept else ''}"
            f"{f' ({n_kept} more kept their KV)' if n_kept else ''}; decide ttft {d.ttft_s * 1e3:.0f} ms, "
            f"total {d.total_s * 1e3:.0f} ms, {d.forwards} forwards, {d.generated_tokens} generated + "
            f"{d.forced_tokens} forced tokens, context {self.context_tokens} tokens")
        return ModelResult(decision_id, status, call, reason, d.ttft_s or 0.0, d.total_s or 0.0, trace.as_dict())


def run_engine_node(name: str, make_node: Callable, errors: tuple[type[Exception], ...],
                    args: list[str] | None = None, help_text: str = "") -> int:
    """Body of a console entry point for a node that owns an EngineWorker (the agent, the market
    bridge): the engine's imports begun on a thread (`import_ahead`), the cyclic garbage collector
    off until the node's first configure ends (a node never configured runs without it), rclpy.init(args),
    `make_node()`, spin until Ctrl-C / SIGTERM / shutdown, then `node.close()` (returns False while
    the engine thread is inside a load or forward) and destroy it. The node's `startup` gets the
    process's start-up stages so far (`LoadStages`: process start to here, rclpy and the node);
    its first configure continues them.

    Returns 0 on a clean shutdown, 2 when the ROS arguments do not parse or make_node() or a
    callback (the autostart configure) raises one of `errors` (printed on stderr as "<name>:
    <error>"); with -h/--help before `--ros-args`
    it prints `help_text` and returns 0 without starting ROS. When the engine thread is still
    busy (Ctrl-C during start-up, or a forward in flight at shutdown), the process ends with
    status 0 at once: interpreter finalization would wait on it.
    """
    if help_requested(args):
        print(help_text)
        return 0
    # No cyclic collection until the first configure ends (`ManagedNode.on_configure` freezes what it
    # made and turns the collector back on): during the imports and the load each collection walks
    # the growing heap (torch's modules, the model), ~0.25 s of CPU in all, holding the GIL.
    gc.disable()
    startup = LoadStages()
    startup.add("process start to main (Python, the node's imports)", process_age_s(), time.process_time())
    imports = import_ahead(ENGINE_MODULES)
    # The deadline monitor's thread waits for the GIL while the engine thread runs Python code
    # (the decode loop between kernels): at most this long instead of CPython's default 5 ms.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        rclpy.init(args=args)
    except RuntimeError as e:   # rcl's RCLError: e.g. "-p model:=" (an override without a value)
        print(f"{name}: cannot parse the ROS arguments: {str(e).split(', at ')[0]}", file=sys.stderr)
        return _finish(2, imports)
    sys.unraisablehook = _quiet_interrupts
    try:
        node = make_node()
        startup.done("rclpy and the node")
        node.startup = startup
    except errors as e:
        print(f"{name}: {e}", file=sys.stderr)
        rclpy.try_shutdown()
        return _finish(2, imports)
    except KeyboardInterrupt:   # Ctrl-C while configuring: the engine thread may be mid-load
        _interrupted_at_startup(name)
    except Exception:
        if rclpy.ok():
            raise
        # rclpy's SIGINT / SIGTERM handler shut the context down while the node was being built:
        # its next create_* raised RCLError ("context is invalid")
        _interrupted_at_startup(name)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    status = 0
    try:
        while rclpy.ok():
            spin_once(executor, SPIN_TIMEOUT_S, node.get_logger())
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except errors as e:
        print(f"{name}: {e}", file=sys.stderr)
        status = 2
    except Exception:
        if rclpy.ok():
            raise       # else a take raced with the signal handler's shutdown of the context
    finally:
        stopped = node.close()
        node.destroy_node()
        rclpy.try_shutdown()
    if not stopped:    # the engine thread is mid-forward: skip interpreter finalization
        _exit_now(status)
    return _finish(status, imports)


def _finish(status: int, imports: threading.Thread) -> int:
    """`status`, or end the process with it at once while `imports` (import_ahead's thread) is
    still importing: interpreter finalization under a thread inside torch's import crashed the
    process (SIGSEGV, or "FATAL: exception not rethrown") in ~1 of 8 fast failures, e.g. a model
    path that does not exist."""
    if imports.is_alive():
        _exit_now(status)
    return status


def import_ahead(modules: tuple[str, ...]) -> threading.Thread:
    """Import `modules` in this order on a daemon thread, started now: a node's engine imports
    (torch: ~1 s) then overlap its start (rclpy, DDS discovery, the wait for configure) instead of
    following the configure request. An import the engine thread needs meanwhile waits for this
    one (Python's per-module import locks). An import that fails is left for the engine thread,
    which imports it again and reports why (the node's configure fails). A node that turns out to
    run no engine (a market bridge with agent false) has imported them for nothing (~1 s CPU once).
    Returns the thread."""
    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - reported by the engine thread's own import
                return

    thread = threading.Thread(target=run, name="tokenspeed-import-ahead", daemon=True)
    thread.start()
    return thread


def _interrupted_at_startup(name: str) -> None:
    """Ctrl-C / SIGTERM before the node spins: one line on stderr, then end the process with
    status 0 at once (the engine thread may be mid-load)."""
    print(f"{name}: interrupted during start-up", file=sys.stderr)
    rclpy.try_shutdown()
    _exit_now()


def _quiet_interrupts(unraisable) -> None:
    """`sys.unraisablehook` of an engine node: a KeyboardInterrupt that lands in a finalizer or a
    weakref callback (CPython's import locks use one) is the Ctrl-C the node is handling, not an
    error to print as "Exception ignored ... Traceback"; anything else goes to the default hook."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def _exit_now(status: int = 0) -> None:
    """End the process with `status` without interpreter finalization (which would wait for an
    engine thread inside a load or a forward), after flushing stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
