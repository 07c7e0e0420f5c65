"""EngineWorker with the real engine (tiny-random): readings that arrive faster than the engine
prefills them are coalesced (the backlog never exceeds one per source), decisions run on the
engine thread, and a load failure leaves a usable worker in state "fault"."""
import json
import threading
import time

from rclpy.logging import get_logger

from support import ROOT
from tokenspeed_ros.deadline_monitor import ModelResult
from tokenspeed_ros.engine_worker import EngineWorker, Observed

TOOLS = json.loads((ROOT / "engine" / "data" / "tools" / "robot_tools.json").read_text())


def make_worker(model: str, woke: threading.Event) -> EngineWorker:
    return EngineWorker(model=model, threads=0, system="You control a robot arm.", tools=TOOLS,
                        tool_choice={"name": "hold"}, kv_budget=1024, notify=woke.set, logger=get_logger("test"))


def collect(worker: EngineWorker, woke: threading.Event, until, timeout: float) -> list:
    out, end = [], time.monotonic() + timeout
    while time.monotonic() < end and not until(out):
        woke.wait(0.1)
        woke.clear()
        out += worker.drain()
    return out


def test_readings_coalesce_and_decisions_run_on_the_engine_thread():
    woke = threading.Event()
    worker = make_worker("tiny-random", woke)
    worker.start()
    try:
        assert collect(worker, woke, lambda _: worker.state != "loading", 120) == []
        assert worker.state == "ready", worker.fault
        texts = [f"joints q=[{i / 100:.2f},0.00] (rad)" for i in range(60)]
        for i, text in enumerate(texts):
            worker.observe("joint_states", text, stamp_s=float(i))
        worker.observe("goal", "goal: hold still", stamp_s=60.0, kind="text")
        worker.decide(7, time.monotonic() + 60.0)
        out = collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 120)
    finally:
        assert worker.close(timeout=30.0)
    seen = [o for o in out if isinstance(o, Observed) and o.source == "joint_states"]
    assert 1 <= len(seen) < len(texts)
    assert seen[-1].text == texts[-1] and seen[-1].stamp_s == 59.0 and seen[-1].tokens > 0
    assert worker.coalesced == len(texts) - len(seen)
    result = next(o for o in out if isinstance(o, ModelResult))
    assert (result.decision_id, result.status, result.tool_call) == (7, "ok", {"name": "hold", "arguments": {}})
    assert out.index(result) > out.index(seen[-1])         # the decision saw the latest reading


def test_load_failure_gives_engine_fault_results():
    woke = threading.Event()
    worker = make_worker("/nonexistent/model.gguf", woke)
    worker.start()
    try:
        collect(worker, woke, lambda _: worker.state != "loading", 30)
        assert worker.state == "fault" and "ModelLoadError" in worker.fault
        worker.observe("camera", "objects none visible", stamp_s=1.0)
        worker.decide(1, time.monotonic() + 1.0)
        out = collect(worker, woke, lambda items: len(items) >= 2, 10)
    finally:
        assert worker.close()
    assert out[0] == Observed("camera", "objects none visible", 1.0, 0)
    assert out[1].status == "engine_fault" and "ModelLoadError" in out[1].reason


def test_calls_outside_the_tool_schema_are_caught():
    from tokenspeed_ros.engine_worker import CallChecker

    check = CallChecker(TOOLS).problem
    assert check({"name": "place", "arguments": {"x": 0.5, "y": 0.0}}) is None
    assert check({"name": "hold", "arguments": {}}) is None
    assert "x" in check({"name": "place", "arguments": {"x": 2.0, "y": 0.0}})          # beyond maximum 0.7
    assert "required" in check({"name": "place", "arguments": {"x": 0.5}})
    assert check({"name": "pick", "arguments": {"object": "purple_cube"}}) is not None
    assert check({"name": "fly", "arguments": {}}) == "unknown tool 'fly'"


def test_a_decisions_state_line_jumps_the_queue_and_is_not_prefilled_twice():
    """A decision request with a restated state line: only that line is prefilled before the
    decision, queued readings follow it; restating the same line again, with at most
    repeat_slack tokens of readings after it, prefills nothing (echo with 0 tokens)."""
    woke = threading.Event()
    worker = EngineWorker(model="tiny-random", threads=0, system="You control a robot arm.", tools=TOOLS,
                          tool_choice={"name": "hold"}, kv_budget=1024, notify=woke.set, logger=get_logger("test"),
                          repeat_slack=64)
    worker.start()
    try:
        assert collect(worker, woke, lambda _: worker.state != "loading", 120) == []
        worker.observe("goal", "goal: hold still", stamp_s=1.0, kind="text")
        worker.observe("camera", "objects red_cube=(0.50,0.10)", stamp_s=2.0)
        worker.decide(1, time.monotonic() + 60.0, restate=("state", "gripper empty; task: hold still", 3.0))
        worker.observe("robot", "robot: hold done (decision 1)", stamp_s=4.0)   # these three: < 64 tokens
        out = collect(worker, woke, lambda items: sum(isinstance(i, Observed) for i in items) >= 4, 120)
        worker.decide(2, time.monotonic() + 60.0, restate=("state", "gripper empty; task: hold still", 5.0))
        out += collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 120)
    finally:
        assert worker.close(timeout=30.0)
    order = [(o.source, o.tokens > 0) if isinstance(o, Observed) else o.decision_id for o in out]
    # the goal may have been taken up before the request arrived; everything else follows the decision
    assert order[order.index(("state", True)) + 1] == 1
    assert {("camera", True), ("robot", True)} <= set(order[order.index(1):])
    assert order[-2:] == [("state", False), 2]


def test_a_new_episode_stops_the_decision_in_progress():
    """A new episode (the node's new task) that begins while a decision is in progress stops it
    before its next forward: answered "superseded" (never a call for the new task), the context
    back at the system prompt and tools; the next decision runs as usual."""
    woke = threading.Event()
    armed = []

    def notify():      # on the engine thread: the decision's state line is in, its decide() is next
        woke.set()
        if armed and worker.context_tokens > armed[0]:
            armed.clear()
            worker.new_episode()

    worker = EngineWorker(model="tiny-random", threads=0, system="You control a robot arm.", tools=TOOLS,
                          tool_choice={"name": "hold"}, kv_budget=1024, notify=notify, logger=get_logger("test"))
    worker.start()
    try:
        assert collect(worker, woke, lambda _: worker.state != "loading", 120) == []
        base = worker.context_tokens
        armed.append(base)
        worker.decide(1, time.monotonic() + 60.0, restate=("state", "gripper empty; task: hold still", 1.0))
        first = collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 120)
        worker.decide(2, time.monotonic() + 60.0, restate=("state", "gripper empty; task: hold still", 2.0))
        second = collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 120)
    finally:
        assert worker.close(timeout=30.0)
    stopped = next(i for i in first if isinstance(i, ModelResult))
    assert stopped.status == "superseded" and stopped.tool_call is None
    result = next(i for i in second if isinstance(i, ModelResult))
    assert result.status == "ok" and result.tool_call["name"] == "hold"
    assert result.trace["context_tokens"] == base + result.trace["prefill_tokens"]     # a fresh episode


def test_a_new_episode_starts_again_from_the_system_prompt_and_tools():
    """new_episode(): the last episode's readings and calls leave the context, and a reading
    identical to one of the last episode is prefilled again."""
    woke = threading.Event()
    worker = make_worker("tiny-random", woke)
    worker.start()
    try:
        assert collect(worker, woke, lambda _: worker.state != "loading", 120) == []
        base = worker.context_tokens
        worker.observe("goal", "goal: pick the red cube", stamp_s=1.0, kind="text")
        worker.observe("camera", "objects red_cube=(0.50,0.10)", stamp_s=2.0)
        worker.decide(1, time.monotonic() + 60.0)
        collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 120)
        assert worker.context_tokens > base
        worker.new_episode()
        worker.observe("goal", "goal: pick the red cube", stamp_s=3.0, kind="text")
        out = collect(worker, woke, lambda items: any(isinstance(i, Observed) for i in items), 120)
    finally:
        assert worker.close(timeout=30.0)
    assert [(o.source, o.stamp_s) for o in out] == [("goal", 3.0)]
    assert out[0].tokens > 0 and worker.context_tokens == base + out[0].tokens


def test_a_call_decided_ahead_is_the_fresh_greedy_decision_and_a_changed_state_discards_it():
    """The embedded model (SmolLM2-135M), the demo's tools, system prompt and state lines. While
    the robot executes pick(red_cube), the next call is decided ahead on the state line pick's
    success leads to. Hit: the real line is that line, so the stored call is answered at once, and
    it and the whole context (cached plus pending ids) are exactly what a fresh greedy decision gives (the place on
    the target). Miss: another line (the pick grasped another cube) rolls the prediction back and
    decides as usual, again exactly as a fresh decision. The same for a task's first call, decided
    ahead on the newest frame's state line right after the goal (as the node does): the next
    frame's identical line is a hit equal to the fresh decision; moved cubes are a miss, decided
    afresh exactly as a fresh decision on them. A miss keeps the KV of the predicted line up to its
    first differing token and prefills only the rest: fewer tokens than the fresh decision, which
    prefills the whole line."""
    from tokenspeed_ros.context_policy import predicted_state, state_line
    from tokenspeed_ros.params import AgentParams
    from tokenspeed_ros.task import TASK_DONE_TOOL

    def allowed(names):
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": n}} for n in names]}}

    p = AgentParams()
    goal = ("Put the red cube on the yellow target at x=0.53 y=0.11 (metres, robot base frame): "
            "pick it, then place it there.")
    empty, holding = allowed(p.tools_when_empty), allowed(p.tools_when_holding)
    first = ("state", state_line("objects blue_cube=(0.59,0.21) green_cube=(0.36,-0.24) red_cube=(0.54,-0.12)",
                                 None, goal, False), 1.0)
    predicted = ("state", predicted_state("pick", {"object": "red_cube"}, None, goal)[0], 0.0)
    changed = ("state", state_line("", "blue_cube", goal, False), 0.0)
    moved = ("state", state_line("objects blue_cube=(0.59,0.21) green_cube=(0.36,-0.24) red_cube=(0.50,-0.12)",
                                 None, goal, False), 2.0)
    woke = threading.Event()
    worker = EngineWorker(model="", threads=1, system=p.system_prompt, tools=TOOLS + [TASK_DONE_TOOL],
                          tool_choice="required", kv_budget=p.kv_budget_tokens, notify=woke.set,
                          logger=get_logger("test"), repeat_slack=p.restate_slack_tokens, replace_sources=("state",))

    def decide(decision_id, tool_choice, restate):
        worker.decide(decision_id, time.monotonic() + 120.0, tool_choice, restate)
        out = collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 180)
        return next(i for i in out if isinstance(i, ModelResult))

    def episode(ahead: bool, second):
        """Pick, then (decided ahead on the predicted line or not) the decision on `second`:
        (pick result, second result, the context's token ids)."""
        worker.new_episode()
        pick = decide(1, empty, first)
        if ahead:
            worker.decide_ahead(predicted, holding)
            wait_ahead()
        result = decide(2, holding, second)
        # The engine thread is idle: safe to read. The context is the cached ids plus the pending
        # ones: speculation's adaptive chain length (timing-dependent) decides whether a call's
        # last grammar-forced (jump-forward) ids entered the KV cache in its last forward or wait
        # for the next prefill.
        return pick, result, worker._session.tokens + worker._session.pending

    def wait_ahead():
        end = time.monotonic() + 180
        while worker.decided_ahead is None and time.monotonic() < end:
            time.sleep(0.05)
        assert worker.decided_ahead is not None, worker.ahead_counts

    def first_call(ahead: bool, line, streamed: bool = True):
        """A new episode whose first frame's state line is streamed in (the node's _queue_state;
        not when `streamed` is False), decided ahead on it or not, then the decision on the next
        frame's `line`."""
        worker.new_episode()
        if streamed:
            worker.observe(*first)
            collect(worker, woke, lambda items: any(isinstance(i, Observed) for i in items), 180)
        if ahead:
            worker.decide_ahead(first, empty)
            wait_ahead()
        result = decide(3, empty, line)
        return result, worker._session.tokens + worker._session.pending

    worker.start()
    try:
        assert collect(worker, woke, lambda _: worker.state != "loading", 180) == []
        assert worker.state == "ready", worker.fault
        first_hit, first_hit_tokens = first_call(True, first)
        first_fresh, first_fresh_tokens = first_call(False, first)
        first_miss, first_miss_tokens = first_call(True, moved)
        first_fresh_moved, first_fresh_moved_tokens = first_call(False, moved, streamed=False)
        pick, hit, hit_tokens = episode(True, predicted)
        _, fresh, fresh_tokens = episode(False, predicted)
        _, miss, miss_tokens = episode(True, changed)
        _, fresh_changed, fresh_changed_tokens = episode(False, changed)
    finally:
        assert worker.close(timeout=60.0)
    assert pick.tool_call == {"name": "pick", "arguments": {"object": "red_cube"}}
    assert hit.trace["ahead"] == "hit" and fresh.trace["ahead"] == ""
    assert hit.tool_call == fresh.tool_call == {"name": "place", "arguments": {"x": 0.53, "y": 0.11}}
    assert hit_tokens == fresh_tokens
    assert miss.trace["ahead"] == "miss" and miss.tool_call == fresh_changed.tool_call
    assert miss_tokens == fresh_changed_tokens
    assert 0 < miss.trace["kept_tokens"] and fresh_changed.trace["kept_tokens"] == 0
    assert miss.trace["prefill_tokens"] + miss.trace["kept_tokens"] == fresh_changed.trace["prefill_tokens"]
    assert first_hit.trace["ahead"] == "hit" and first_hit.trace["prefill_tokens"] == 0
    assert first_hit.tool_call == first_fresh.tool_call == {"name": "pick", "arguments": {"object": "red_cube"}}
    assert first_hit_tokens == first_fresh_tokens
    assert first_miss.trace["ahead"] == "miss" and first_miss.tool_call == first_fresh_moved.tool_call
    assert first_miss_tokens == first_fresh_moved_tokens
    assert 0 < first_miss.trace["kept_tokens"] and first_fresh_moved.trace["kept_tokens"] == 0
    assert first_miss.trace["prefill_tokens"] + first_miss.trace["kept_tokens"] == \
        first_fresh_moved.trace["prefill_tokens"]
    assert worker.ahead_counts["hit"] == 2 and worker.ahead_counts["miss"] == 2


def test_an_unanswered_state_line_is_replaced_by_the_next_one():
    """replace_sources: a state line that is still the context's last observation, with no
    decision after it (none was asked, or it missed its deadline and was rolled back), is rolled
    back when the next state line comes: missed decisions leave no trail of stale states. After
    another reading or an answered decision the next state line is appended."""
    woke = threading.Event()
    worker = EngineWorker(model="tiny-random", threads=0, system="You control a robot arm.", tools=TOOLS,
                          tool_choice={"name": "hold"}, kv_budget=1024, notify=woke.set, logger=get_logger("test"),
                          replace_sources=("state",))

    def observed(source, text, stamp_s):
        worker.observe(source, text, stamp_s)
        return collect(worker, woke, lambda items: any(isinstance(i, Observed) for i in items), 120)[0].tokens

    worker.start()
    try:
        assert collect(worker, woke, lambda _: worker.state != "loading", 120) == []
        base = worker.context_tokens
        observed("state", "objects red_cube=(0.50,0.10); gripper empty", 1.0)
        b = observed("state", "objects red_cube=(0.51,0.10); gripper empty", 2.0)
        assert worker.context_tokens == base + b                   # the first line was replaced
        worker.decide(1, time.monotonic() - 1.0, restate=("state", "objects red_cube=(0.52,0.10); gripper empty", 3.0))
        out = collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 120)
        c = next(o.tokens for o in out if isinstance(o, Observed))
        assert next(o for o in out if isinstance(o, ModelResult)).status == "deadline_missed"
        assert worker.context_tokens == base + c                   # a missed decision answers nothing
        r = observed("robot", "robot: hold done (decision 1)", 4.0)
        d = observed("state", "objects red_cube=(0.53,0.10); gripper empty", 5.0)
        assert worker.context_tokens == base + c + r + d           # after another reading: appended
    finally:
        assert worker.close(timeout=30.0)


def test_a_dead_engine_thread_is_a_fault_never_ready(monkeypatch):
    """The engine thread dies after the load (injected: torch refusing a thread count, which the
    parameter ranges no longer let a user cause): the queued decision is answered engine_fault,
    and the worker says "fault" with the reason - /diagnostics reports it as an error."""
    import torch

    woke = threading.Event()
    worker = make_worker("tiny-random", woke)
    worker.start()
    try:
        collect(worker, woke, lambda _: worker.state != "loading", 120)
        assert worker.state == "ready", worker.fault

        def refuse(n):
            raise RuntimeError(f"cannot use {n} threads")
        monkeypatch.setattr(torch, "set_num_threads", refuse)
        worker.set_threads(3)
        worker.decide(9, time.monotonic() + 60.0)
        out = collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 30)
    finally:
        worker.close(timeout=30.0)
    result = next(o for o in out if isinstance(o, ModelResult))
    assert (result.decision_id, result.status) == (9, "engine_fault") and "thread died" in result.reason
    assert worker.state == "fault" and "cannot use 3 threads" in worker.fault


def test_a_call_not_executed_leaves_the_context_and_what_followed_it_is_observed_again():
    """not_executed (the node's deadline monitor did not publish the call): the session goes back
    to before the call, its state line unanswered again, and the reading observed after the call
    enters again: the context is token for token the one without the decision. The decision's
    call is not taken back once a later decision answered."""
    woke = threading.Event()
    worker = make_worker("tiny-random", woke)
    line, reading = ("state", "objects red_cube=(0.50,0.10); gripper empty", 1.0), ("robot", "robot: note", 2.0)

    def observed(source, text, stamp_s):
        worker.observe(source, text, stamp_s)
        collect(worker, woke, lambda items: any(isinstance(i, Observed) for i in items), 120)

    def decided(decision_id):
        worker.decide(decision_id, time.monotonic() + 60.0, restate=line)
        out = collect(worker, woke, lambda items: any(isinstance(i, ModelResult) for i in items), 120)
        return next(i for i in out if isinstance(i, ModelResult))

    worker.start()
    try:
        assert collect(worker, woke, lambda _: worker.state != "loading", 120) == []
        assert decided(1).status == "ok"
        observed(*reading)
        worker.not_executed(1)
        collect(worker, woke, lambda items: any(isinstance(i, Observed) for i in items), 120)   # the reading again
        taken_back = worker._session.tokens + worker._session.pending
        worker.new_episode()
        observed(*line)
        observed(*reading)
        fresh = worker._session.tokens + worker._session.pending
        assert decided(2).status == "ok" and decided(3).status == "ok"
        answered = worker._session.tokens + worker._session.pending
        worker.not_executed(2)          # decision 3 answered since: nothing changes
        observed("robot", "robot: another note", 3.0)
        after = worker._session.tokens + worker._session.pending
    finally:
        assert worker.close(timeout=30.0)
    assert taken_back == fresh
    assert after[:len(answered)] == answered and len(after) > len(answered)
