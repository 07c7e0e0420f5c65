"""The real `tokenspeed_agent` process over DDS: model decisions with the real engine, the
deadline fallback with an impossible budget, engine faults, and bad input of every kind."""
import json

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CameraInfo, Image, JointState
from std_msgs.msg import String
from tokenspeed_msgs.msg import ActionCommand, DeadlineStatus, Observation

from agent_support import HEIGHT, WIDTH, SensorFeed, camera_info, diagnostics, realtime_allowed

LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
ENGINE_TIMEOUT = 90.0          # process start + model load on a busy 2-core machine, seconds


def listen_all(probe):
    return (probe.listen(ActionCommand, "agent/action"), probe.listen(DeadlineStatus, "agent/deadline_status"),
            probe.listen(Observation, "agent/observation"), probe.listen(DiagnosticArray, "/diagnostics"))


def test_model_decisions_with_the_real_engine(probe, start_agent):
    """tiny-random model, tool forced to "hold" (the grammar fixes every token): the call is
    valid and on time, so it goes out as a model command; observations are echoed with tokens."""
    actions, statuses, observations, diags = listen_all(probe)
    traces = probe.listen(String, "agent/action/trace")
    goal = probe.node.create_publisher(String, "goal", LATCHED)
    goal.publish(String(data="Hold the arm still."))
    SensorFeed(probe)
    agent = start_agent(goal_topic="goal", model="tiny-random", tool_choice="hold", deadline_budget_s=30.0, decision_period_s=0.5,
                        joint_states_in_context="true", restate_before_decisions="false")
    assert probe.spin_until(lambda: any(a.source == "model" for a in actions), ENGINE_TIMEOUT), agent.log_path.read_text()
    model = next(a for a in actions if a.source == "model")
    assert (model.tool_name, json.loads(model.arguments_json)) == ("hold", {})
    assert model.decision_latency_s > 0 and model.ttft_s >= 0    # every token is forced: no sampled first token
    assert probe.spin_until(lambda: any(s.met and s.decision_id == model.decision_id for s in statuses), 5)
    # the echoes were published before the command, but topics are not ordered with each other
    assert probe.spin_until(lambda: {"camera", "goal", "joint_states"} <= {o.source for o in observations}, 5)
    seen = {o.source: o for o in observations}
    assert seen["camera"].text == "objects blue_cube=(0.40,-0.10) red_cube=(0.50,0.10)"
    assert seen["camera"].tokens > 0 and seen["goal"].text == "goal: Hold the arm still."
    assert seen["joint_states"].text.startswith("joints q=[0.00,-0.79,")
    assert probe.spin_until(lambda: diags and int(diagnostics(diags[-1])["/tokenspeed_agent: decisions"].get("met", 0)) > 0, 5)
    values = diagnostics(diags[-1])
    assert "latency_p50_ms" in values["/tokenspeed_agent: decisions"]
    # the monitor's thread in the real-time policy (the default monitor_thread_priority) where allowed
    assert values["/tokenspeed_agent: decisions"]["thread_scheduling"] == (
        "SCHED_FIFO 50" if realtime_allowed() else "SCHED_OTHER (SCHED_FIFO 50 refused)")
    assert values["/tokenspeed_agent: engine"]["state"] == "ready"
    assert {"decided_ahead_hit", "decided_ahead_miss", "trace_ttft_p50_ms"} <= set(values["/tokenspeed_agent: engine"])
    # every stage of the model's decision, from the sensor stamp to the publish, in order
    assert probe.spin_until(lambda: any(json.loads(t.data)["decision_id"] == model.decision_id for t in traces), 5)
    trace = next(json.loads(t.data) for t in traces if json.loads(t.data)["decision_id"] == model.decision_id)
    times = trace["times"]
    order = ["capture", "received", "perceived", "queued", "prefill_start", "prefill_end", "decide_start",
             "first_token", "end", "published"]
    assert [times[k] for k in order] == sorted(times[k] for k in order), times
    assert trace["tool"] == "hold" and trace["tokens_in"] > 0 and trace["context_tokens"] > 0
    assert all(v is not None and v >= 0 for v in trace["stages_ms"].values())
    assert agent.poll() is None


def test_impossible_budget_gives_the_configured_fallback(probe, start_agent):
    """The real engine cannot answer within 1 ms: every decision is a "stop" fallback with
    reason deadline_missed; no model command reaches the robot."""
    actions, statuses, _, _ = listen_all(probe)
    SensorFeed(probe)
    agent = start_agent(model="tiny-random", deadline_budget_s=0.001, publish_margin_s=0.0,
                        fallback="stop", decision_period_s=0.2, decide_without_task="true")
    assert probe.spin_until(lambda: sum(s.reason == "deadline_missed" for s in statuses) >= 3, ENGINE_TIMEOUT), \
        agent.log_path.read_text()
    missed = [s for s in statuses if s.reason == "deadline_missed"]
    assert all(not s.met and s.fallback_used and s.fallback == "stop" for s in missed)
    fallback_ids = {a.decision_id for a in actions if a.source == "fallback" and a.tool_name == "stop"}
    assert probe.spin_until(lambda: {s.decision_id for s in missed} <= {a.decision_id for a in actions}, 5)
    assert {s.decision_id for s in missed} <= fallback_ids | {a.decision_id for a in actions if a.tool_name == "stop"}
    assert all(a.source == "fallback" for a in actions)
    assert agent.poll() is None


# The one injected fault: every decide() raises inside the engine. A user can no longer cause it
# (a tool_choice naming no tool, which did, is refused at configure and live).
FAULTY_DECIDE = r'''
import sys
import tokenspeed.session as s
def decide(self, *a, **k):
    raise RuntimeError("injected fault inside decide()")
s.Session.decide = decide
from tokenspeed_ros.agent_node import main
sys.exit(main())
'''


def test_engine_faults_keep_the_node_publishing_fallbacks(probe, start_agent):
    """Every decide() raises: fallbacks with reason engine_fault. (A model that does not load
    fails configure instead: test_lifecycle.py; so does a tool_choice naming no tool.)"""
    refused = start_agent(model="tiny-random", tool_choice="no_such_tool")
    assert refused.wait(ENGINE_TIMEOUT) == 2
    assert "tool_choice='no_such_tool' refused: one of required, auto, pick" in refused.log_path.read_text()
    actions, statuses, _, diags = listen_all(probe)
    SensorFeed(probe)
    agent = start_agent(code=FAULTY_DECIDE, decision_period_s=0.2, model="tiny-random", decide_without_task="true")
    assert probe.spin_until(lambda: sum(s.reason == "engine_fault" for s in statuses) >= 2, ENGINE_TIMEOUT), \
        agent.log_path.read_text()
    assert probe.spin_until(lambda: any(a.source == "fallback" and a.tool_name == "hold" for a in actions), 5)
    assert all(a.source == "fallback" for a in actions)
    assert probe.spin_until(lambda: diags and diagnostics(diags[-1])["/tokenspeed_agent: engine"]["state"] == "ready", 5)
    assert agent.poll() is None


def test_bad_input_is_counted_and_never_crashes_the_node(probe, start_agent):
    """NaN/inf joints, wrong sizes, corrupt images, unknown encodings, stamps from the future,
    the far past and zero, a broken CameraInfo, an empty goal: each counted in /diagnostics;
    with no valid sensor data the robot gets fallbacks (no_sensor_data)."""
    actions, statuses, _, diags = listen_all(probe)
    node = probe.node
    joints = node.create_publisher(JointState, "joint_states", 10)
    images = node.create_publisher(Image, "camera/image_raw", 10)
    infos = node.create_publisher(CameraInfo, "camera/camera_info", 10)
    goals = node.create_publisher(String, "goal", LATCHED)
    agent = start_agent(goal_topic="goal", model="tiny-random", decision_period_s=0.2, stale_after_s=0.5,
                        decide_without_task="true")
    assert probe.spin_until(lambda: node.count_subscribers("joint_states") >= 1
                            and node.count_subscribers("camera/image_raw") >= 1
                            and node.count_subscribers("goal") >= 1, 30), agent.log_path.read_text()
    assert probe.spin_until(lambda: diags, ENGINE_TIMEOUT)      # configured (model loaded) and spinning

    def stamped(msg, offset_s=0.0):
        now_ns = node.get_clock().now().nanoseconds + int(offset_s * 1e9)
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now_ns, 10**9)
        return msg

    good = dict(height=HEIGHT, width=WIDTH, step=3 * WIDTH, encoding="rgb8")
    bad_info = camera_info()
    bad_info.k = [float("nan")] * 9
    sends = [
        (joints, stamped(JointState(position=[0.0, float("nan")]))),
        (joints, stamped(JointState(position=[float("inf"), 0.0]))),
        (joints, stamped(JointState(name=["a"], position=[0.0, 1.0]))),
        (joints, stamped(JointState(position=[0.1, 0.2]), offset_s=60.0)),        # from the future
        (joints, stamped(JointState(position=[0.1, 0.2]), offset_s=-3600.0)),     # far past
        (joints, JointState(position=[0.1, 0.2])),                                # no stamp
        (images, stamped(Image(**good, data=b"\x00" * 100))),                     # corrupt length
        (images, stamped(Image(**{**good, "encoding": "mono16"}, data=b"\x00" * (2 * WIDTH * HEIGHT)))),
        (images, stamped(Image(height=0, width=0, step=0, encoding="rgb8"))),
        (infos, stamped(bad_info)),
        (goals, String(data="   ")),
    ]
    expected = {"joint_nonfinite": 2, "joint_size_mismatch": 1, "stamp_future": 1, "stamp_old": 1,
                "stamp_missing": 1, "image_corrupt": 1, "image_encoding": 1, "image_size": 1,
                "goal_invalid": 1}

    def counts():
        if not diags:
            return {}
        inputs = diagnostics(diags[-1])["/tokenspeed_agent: inputs"]
        return {k.removeprefix("bad_"): int(v) for k, v in inputs.items() if k.startswith("bad_")}

    def all_counted():
        return all(counts().get(k, 0) >= n for k, n in expected.items()) and counts().get("missing_joint_states", 0) > 0

    for _ in range(20):             # repeat the batch: the first one may race endpoint matching
        for pub, msg in sends:
            pub.publish(msg)
            probe.spin_until(lambda: False, 0.02)
        if probe.spin_until(all_counted, 1.5):
            break
    assert all_counted(), (sorted(counts().items()), agent.log_path.read_text())
    # the invalid CameraInfo is only checked together with a camera pose; no image was valid
    assert probe.spin_until(lambda: sum(s.reason == "no_sensor_data" for s in statuses) >= 2, 10)
    assert probe.spin_until(lambda: any(a.source == "fallback" and a.tool_name == "hold" for a in actions), 5)
    assert agent.poll() is None
    log = agent.log_path.read_text()
    assert sum("joint_nonfinite" in line for line in log.splitlines()) == 1     # logged once per kind
    assert "Traceback" not in log


def test_robot_executing_a_call_pauses_rate_decisions_until_its_feedback(probe, start_agent):
    """While the robot reports a model call as applied and not done, rate triggers wait; its
    "done" feedback triggers the next decision at once; a failed one becomes an observation."""
    from tokenspeed_msgs.msg import ActionFeedback

    actions, _, observations, diags = listen_all(probe)
    feedback = probe.node.create_publisher(ActionFeedback, "sim/action_feedback", 10)
    SensorFeed(probe)
    agent = start_agent(model="tiny-random", tool_choice="hold", decision_period_s=0.2, decide_without_task="true")
    assert probe.spin_until(lambda: len(actions) >= 2 and feedback.get_subscription_count() >= 1, 30), \
        agent.log_path.read_text()

    def skipped():
        return int(diagnostics(diags[-1])["/tokenspeed_agent: engine"]["triggers_skipped_executing"]) if diags else 0

    executing = actions[-1].decision_id
    feedback.publish(ActionFeedback(decision_id=executing, tool_name="pick", state="applied"))
    assert probe.spin_until(lambda: skipped() >= 3, 10)
    n = len(actions)
    probe.spin_until(lambda: False, 0.6)
    assert len(actions) == n                          # rate triggers skipped while executing
    feedback.publish(ActionFeedback(decision_id=executing, tool_name="pick", state="done"))
    assert probe.spin_until(lambda: len(actions) > n, 10)
    # a call done as asked is not a line of its own (its effect is in the state line); one that
    # failed is told to the model
    executing = actions[-1].decision_id
    feedback.publish(ActionFeedback(decision_id=executing, tool_name="pick", state="applied"))
    feedback.publish(ActionFeedback(decision_id=executing, tool_name="pick", state="done",
                                    detail="grasp of red_cube failed"))
    assert probe.spin_until(lambda: any(o.source == "robot" for o in observations), 5)
    assert [o.text for o in observations if o.source == "robot"] == [
        f"robot: pick done (grasp of red_cube failed) (decision {executing})"]
    assert agent.poll() is None

