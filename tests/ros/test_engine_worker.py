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
