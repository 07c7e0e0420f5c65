"""The agent's task: what it works on, when it is done, and the completion tool.

A task starts from a RunTask action goal or a message on the goal topic. The model ends it by
calling the completion tool `task_done`, which the agent only offers once the robot's scenario
status reports the goal achieved (action masking by precondition, as for pick/place) and checks
again when the call comes back; then the agent stops acting (the arm holds) until the next task.
A task also ends "failed" when its time or decision budget runs out, and "cancelled" on request.
No ROS here (the context policy uses it; the action server is `task_action`).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rclpy.time import Time

TASK_DONE = "task_done"
TASK_DONE_TOOL = {"type": "function", "function": {
    "name": TASK_DONE,
    "description": "Report the task complete once the robot reports it achieved; the robot then holds.",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
DONE, FAILED, CANCELLED = "done", "failed", "cancelled"


@dataclass
class Task:
    """One task. tools: names the task may call ([] = the node's configured subsets);
    timeout_s: 0 = no limit (s); max_decisions: 0 = no limit; on_finish(task): called once when
    it ends (e.g. to answer its RunTask goal). `outcome` is "" while it runs, then DONE, FAILED or
    CANCELLED with `evidence` saying why."""

    text: str
    started: Time
    tools: list[str] = field(default_factory=list)
    timeout_s: float = 0.0
    max_decisions: int = 0
    decisions: int = 0
    outcome: str = ""
    evidence: str = ""
    on_finish: Callable[["Task"], None] | None = None

    @property
    def running(self) -> bool:
        return not self.outcome

    def finish(self, outcome: str, evidence: str) -> None:
        """End the task (once; later calls are ignored)."""
        if self.running:
            self.outcome, self.evidence = outcome, evidence
            if self.on_finish is not None:
                self.on_finish(self)

    def over_budget(self, now: Time) -> str | None:
        """Why the task has run out of time or decisions, or None."""
        elapsed_s = (now - self.started).nanoseconds * 1e-9
        if self.timeout_s > 0 and elapsed_s > self.timeout_s:
            return f"not done within timeout_s {self.timeout_s:g} s ({self.decisions} decisions)"
        if self.max_decisions > 0 and self.decisions >= self.max_decisions:
            return f"not done within max_decisions {self.max_decisions}"
        return None


def achieved(status: dict | None) -> str | None:
    """Evidence that the scenario status (the robot's JSON status: "success", "target_object",
    "distance_m", "tolerance_m") reports the goal achieved, or None when it does not."""
    if not status or not status.get("success"):
        return None
    return (f"robot status: success, {status.get('target_object', 'object')} "
            f"{100 * float(status.get('distance_m', 0.0)):.1f} cm from the target "
            f"(tolerance {100 * float(status.get('tolerance_m', 0.0)):.1f} cm)")


def parse_status(text: str) -> dict | None:
    """The JSON object of a status message, or None when it is not one."""
    try:
        status = json.loads(text)
    except json.JSONDecodeError:
        return None
    return status if isinstance(status, dict) else None

