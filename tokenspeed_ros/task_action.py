"""The agent's RunTask action server: a goal becomes a `Task`, its feedback is one message per
decision, and it is answered when its task ends (see `task`)."""
from __future__ import annotations

import math
from collections.abc import Callable

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from tokenspeed_msgs.action import RunTask

from tokenspeed_ros.task import DONE, Task


class TaskActionServer:
    """The RunTask action server of the agent node `node` (an rclpy node), named `name`.

    A goal is accepted when its task text is 1..max_chars characters, its timeout_s finite and
    >= 0, and `refusal(tools)` (the node: None when it can decide with those tools now, else why
    not: inactive, unknown tools, none callable) says nothing; it starts a Task through
    `start(task)` (the node makes it current). The goal is answered when its task ends; a cancel
    request for the current task calls `cancel(task)` (the node publishes the safe fallback and
    ends it). Executor thread only.
    """

    def __init__(self, node, name: str, *, max_chars: Callable[[], int], refusal: Callable[[list[str]], str | None],
                 start: Callable[[Task], None], cancel: Callable[[Task], None], current: Callable[[], Task | None]):
        self._node = node
        self._max_chars, self._refusal, self._start, self._cancel, self._current = (
            max_chars, refusal, start, cancel, current)
        self._handles: dict[int, object] = {}   # id(task) -> its goal handle, until answered
        # goals are executed through goal_handle.execute(callback) when their task ends (see
        # _on_accepted); rclpy requires a default callback, which is never used
        self._server: ActionServer | None = ActionServer(
            node, RunTask, name, execute_callback=lambda _: None, goal_callback=self._on_goal,
            cancel_callback=self._on_cancel, handle_accepted_callback=self._on_accepted)

    def owns(self, task: Task | None) -> bool:
        """True when `task` came from a RunTask goal not yet answered."""
        return task is not None and id(task) in self._handles

    def feedback(self, task: Task, fields: dict) -> None:
        """Publish one decision of `task` as its goal's feedback (RunTask.Feedback fields)."""
        handle = self._handles.get(id(task))
        if handle is not None:
            handle.publish_feedback(RunTask.Feedback(**fields))

    def destroy(self) -> None:
        """Remove the action server (goals still open are not answered)."""
        if self._server is not None:
            self._server.destroy()
            self._server = None

    def _on_goal(self, goal: RunTask.Goal) -> GoalResponse:
        """Accept a valid goal while the node can act on it (as nav2 does: an inactive node rejects goals)."""
        text = goal.task.strip()
        refusal = self._refusal(list(goal.tools))
        if (not text or len(text) > self._max_chars() or refusal
                or not math.isfinite(goal.timeout_s) or goal.timeout_s < 0):
            self._node.get_logger().warning(
                f"RunTask goal rejected: {len(text)} characters, timeout_s {goal.timeout_s}"
                + (f"; {refusal}" if refusal else ""))
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _on_accepted(self, goal_handle) -> None:
        """Start the goal's task. The goal is answered when the task ends: only then does it go
        through execute (ACCEPTED -> EXECUTING -> SUCCEEDED / ABORTED, or CANCELING -> CANCELED),
        so no coroutine waits in the executor meanwhile (rclpy polls pending coroutines in a busy
        loop); feedback flows from the first decision on."""
        g = goal_handle.request
        task = Task(g.task.strip(), self._node.get_clock().now(), list(g.tools), g.timeout_s, g.max_decisions,
                    on_finish=lambda t: self._answer(goal_handle, t))
        self._handles[id(task)] = goal_handle
        self._start(task)

    def _answer(self, goal_handle, task: Task) -> None:
        """Send the goal through execute to its result; skipped once the context is shut down
        (Ctrl-C: nothing can be published, the client sees the server go away). A shutdown that
        lands between that check and the status publish (rcl: "feedback publisher is invalid")
        is logged, not raised: the node is going away, and so is the goal."""
        if not (self._node.context.ok() and self._server is not None):
            return
        try:
            goal_handle.execute(lambda gh: self._result(task, gh))
        except RuntimeError as e:  # rcl's RCLError
            if "invalid" not in str(e):
                raise
            self._node.get_logger().warning(f"RunTask goal not answered: the action server went away ({e})")

    def _result(self, task: Task, goal_handle) -> RunTask.Result:
        self._handles.pop(id(task), None)
        if task.outcome == DONE:
            goal_handle.succeed()
        elif goal_handle.is_cancel_requested:
            goal_handle.canceled()
        else:
            goal_handle.abort()
        return RunTask.Result(outcome=task.outcome, evidence=task.evidence, decisions=task.decisions,
                              duration_s=(self._node.get_clock().now() - task.started).nanoseconds * 1e-9)

    def _on_cancel(self, goal_handle) -> CancelResponse:
        """Cancel mid-task: the node's cancel (the safe fallback goes out, the agent stops acting)."""
        task = self._current()
        if task is not None and task.running and self._handles.get(id(task)) is goal_handle:
            self._cancel(task)
        return CancelResponse.ACCEPT
