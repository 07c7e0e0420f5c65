"""The decision protocol shared by the robot agent and the market bridge, written once.

A decision is opened in the `DeadlineMonitor` (its deadline = the observation stamp + budget), is
answered at once with the fallback when the engine cannot take it (no agent, engine loading or
faulted, no time left: the reason says which), and otherwise goes to the `EngineWorker`, one at
a time. While the engine
works on one, a caller may leave one request waiting (`defer`): a newer request replaces it (the
replaced one is told, e.g. to answer "superseded"), and it runs when the engine is free again.
`on_engine_output` (the worker's guard-condition callback) drains the worker, hands prefilled
observations to the node, resolves results in the monitor and then runs the waiting request. A
valid call the monitor did not publish (it came after the deadline, e.g. a call decided ahead
taken late, or after a stop) is taken back out of the context (`EngineWorker.not_executed`), so
that the context never says it ran.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from rclpy.time import Time

from tokenspeed_ros.deadline_monitor import DeadlineMonitor, Decision, ModelResult
from tokenspeed_ros.engine_worker import DecidedAhead, EngineWorker, Observed

TURNS_KEPT = 10_000     # engine turns kept for the percentiles


class DecisionLoop:
    """One outstanding decision between a node, its deadline monitor and its engine thread.

    monitor: the node's DeadlineMonitor; worker: its EngineWorker, or None for a node without an
    agent (every decision then falls back with reason "no_agent"); clock: the node's rclpy Clock;
    publish_margin_s: the engine stops this long before the deadline (seconds);
    on_observed(Observed): an observation entered the session; on_decided_ahead(DecidedAhead): a
    call decided ahead is ready; check_result(ModelResult) ->
    ModelResult: the node's last word on a result before the monitor sees it; on_resolved(ModelResult,
    ActionCommand | None): the monitor resolved a result (the command when the model's call was
    published). `engine_turn_s`: seconds from handing a decision to the engine to its result, late
    ones included. Not thread-safe: call everything from the node's executor thread.
    """

    def __init__(self, monitor: DeadlineMonitor, worker: EngineWorker | None, clock, *, publish_margin_s: float,
                 on_observed: Callable[[Observed], None] | None = None,
                 on_decided_ahead: Callable[[DecidedAhead], None] | None = None,
                 check_result: Callable[[ModelResult], ModelResult] | None = None,
                 on_resolved: Callable[[ModelResult, object], None] | None = None):
        self.monitor = monitor
        self.worker = worker
        self.publish_margin_s = publish_margin_s
        self._clock = clock
        self._on_observed = on_observed
        self._on_decided_ahead = on_decided_ahead
        self._check_result = check_result
        self._on_resolved = on_resolved
        self.outstanding: int | None = None      # decision id the engine is working on
        self._dispatched_at = 0.0                # time.monotonic() of the last dispatch
        self._waiting: tuple[Callable[[], None], Callable[[], None] | None] | None = None
        self.engine_turn_s: deque[float] = deque(maxlen=TURNS_KEPT)

    @property
    def busy(self) -> bool:
        """True while the engine works on a decision."""
        return self.outstanding is not None

    def unavailable(self) -> str | None:
        """Why the engine cannot decide now ("no_agent", "engine_loading", "engine_fault"), or None."""
        if self.worker is None:
            return "no_agent"
        return {"ready": None, "fault": "engine_fault"}.get(self.worker.state, "engine_loading")

    def open(self, observation_stamp: Time) -> Decision:
        """Open a decision answering the observation stamped `observation_stamp` in the monitor."""
        return self.monitor.open(observation_stamp)

    def dispatch(self, d: Decision, tool_choice=None, restate: tuple[str, str, float] | None = None,
                 prefill: tuple[str, str, float] | None = None) -> bool:
        """Hand the open decision `d` to the engine (which must be free), to finish
        `publish_margin_s` before its deadline. restate: see EngineWorker.decide; prefill:
        (source, text, stamp_s) observed just before the decision. Returns False (nothing sent)
        when `d` is no longer open, or when it fell back at once: the engine is unavailable (the
        reason from `unavailable()`) or no time is left ("deadline_missed"). Raises RuntimeError
        when a decision is outstanding."""
        if self.outstanding is not None:
            raise RuntimeError(f"decision {self.outstanding} is still outstanding")
        if not self.monitor.is_pending(d.decision_id):
            return False
        reason = self.unavailable()
        if reason is not None:
            self.monitor.resolve(ModelResult(d.decision_id, reason))
            return False
        remaining_s = (d.deadline - self._clock.now()).nanoseconds * 1e-9 - self.publish_margin_s
        if remaining_s <= 0:
            self.monitor.resolve(ModelResult(d.decision_id, "deadline_missed", reason="no time left to decide"))
            return False
        self.outstanding = d.decision_id
        self._dispatched_at = time.monotonic()
        if prefill is not None:
            self.worker.observe(*prefill)
        self.worker.decide(d.decision_id, self._dispatched_at + remaining_s, tool_choice, restate)
        return True

    def defer(self, run: Callable[[], None], replaced: Callable[[], None] | None = None) -> None:
        """Leave `run` to be called once the engine is free (after the outstanding result is
        resolved). A request already waiting is dropped, and its `replaced` is called."""
        if self._waiting is not None and self._waiting[1] is not None:
            self._waiting[1]()
        self._waiting = (run, replaced)

    def on_engine_output(self) -> None:
        """Guard-condition callback of the worker: pass observations on, resolve results, then
        run the waiting request when the engine is free."""
        for item in self.worker.drain():
            if isinstance(item, Observed):
                if self._on_observed is not None:
                    self._on_observed(item)
                continue
            if isinstance(item, DecidedAhead):
                if self._on_decided_ahead is not None:
                    self._on_decided_ahead(item)
                continue
            if item.decision_id == self.outstanding:
                self.outstanding = None
                self.engine_turn_s.append(time.monotonic() - self._dispatched_at)
            if self._check_result is not None:
                item = self._check_result(item)
            cmd = self.monitor.resolve(item)
            if cmd is None and item.status == "ok":     # a call that never reached the robot leaves the context
                self.worker.not_executed(item.decision_id)
            if self._on_resolved is not None:
                self._on_resolved(item, cmd)
        if self.outstanding is None and self._waiting is not None:
            (run, _), self._waiting = self._waiting, None
            run()

    def stop(self, stamp: Time, reason: str) -> None:
        """Stop deciding: the waiting request is dropped, and the safe fallback goes out with
        `reason` for the decision in progress (its result will be dropped as late), or on its
        own when none is open (observation stamp `stamp`)."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None and waiting[1] is not None:
            waiting[1]()
        if self.outstanding is not None and self.monitor.is_pending(self.outstanding):
            self.monitor.resolve(ModelResult(self.outstanding, reason))
        else:
            self.monitor.fail_now(stamp, reason)

