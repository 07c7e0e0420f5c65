"""The latency harness in its own process, listening to the real simulator node and to a scripted
agent peer (this test) over DDS: it matches every decision's stamps and writes JSON + PNG."""
import json
import subprocess
import sys
import time

import pytest
from rclpy.time import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from sensor_msgs.msg import Image
from std_msgs.msg import String
from tokenspeed_msgs.msg import ActionCommand, DeadlineStatus, Observation

from support import BIN, ROOT, spin_until, stop
from tokenspeed_ros.managed_node import DIAGNOSTICS_QOS
from tokenspeed_sim.harness import LatencyHarness, percentiles, startup_stages


def test_percentiles():
    assert percentiles([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    st = percentiles([float(v) for v in range(1, 101)])
    assert st["n"] == 100 and st["p50"] == pytest.approx(50.5) and st["p90"] == pytest.approx(90.1)
    assert st["p99"] == pytest.approx(99.01) and st["max"] == 100.0 and st["mean"] == pytest.approx(50.5)


def test_engine_ready_brings_the_agents_start_up_stages_into_the_report(ros_node):
    """The agent's "startup: ..." values on its engine status (as EngineNode.startup_values sends
    them) become the report's start-up stages, in order, with its process start on the harness's
    clock; an engine status without them reports none."""
    assert startup_stages([KeyValue(key="state", value="ready")], 0.0) is None
    harness = LatencyHarness()
    try:
        values = [KeyValue(key="state", value="ready"),
                  KeyValue(key="startup: process started", value=f"{harness.started + 0.25:.3f}"),
                  KeyValue(key="startup: process start to main (Python, the node's imports)", value="0.800 0.700"),
                  KeyValue(key="startup: engine imports (torch; begun at process start)", value="1.100 0.900")]
        harness._on_diagnostics(DiagnosticArray(status=[DiagnosticStatus(name="/tokenspeed_agent: engine",
                                                                         values=values)]))
        up = harness.report()["startup"]
    finally:
        harness.destroy_node()
    assert up["process_started_s"] == pytest.approx(0.25, abs=2e-3)
    assert up["stages"] == [{"stage": "process start to main (Python, the node's imports)", "wall_s": 0.8, "cpu_s": 0.7},
                            {"stage": "engine imports (torch; begun at process start)", "wall_s": 1.1, "cpu_s": 0.9}]


def test_the_task_waits_for_the_agent_to_say_it_is_active(ros_node):
    """An engine status "ready" but not "active" (configure ended, activate not yet) sends no goal:
    the agent would reject it, and the harness would resend it only TASK_RESEND_S later. The
    agent's status saying "active" (published as it activates) lets the goal go."""
    def engine(active: str) -> DiagnosticArray:
        return DiagnosticArray(status=[DiagnosticStatus(name="/tokenspeed_agent: engine", values=[
            KeyValue(key="state", value="ready"), KeyValue(key="active", value=active)])])

    harness = LatencyHarness()
    try:
        harness._on_goal(String(data="Put the red cube on the yellow target."))
        harness._on_diagnostics(engine("false"))
        assert harness.engine_ready_at is not None and not harness.agent_active
        assert not harness.send_task() and harness.run_task is None
        harness._on_diagnostics(engine("true"))
        assert harness.agent_active
        harness._on_diagnostics(engine("false"))        # deactivated: the latest status counts
        assert not harness.agent_active
    finally:
        harness.destroy_node()


def test_a_harness_that_joins_late_places_engine_ready_at_the_agents_ready_time(ros_node, ros_env, tmp_path):
    """The real agent (tiny-random) in its own process, /diagnostics only every 60 s: in this test
    only the status published when configure ends says "ready". A harness that starts listening
    well after that still hears it (the agent's /diagnostics is latched, transient-local) and puts
    the engine's ready time where the agent's own log says the engine became ready, not when the
    status arrived. (In the demo the harness listens from the start, but DDS discovery can match
    it only after the agent's first "ready" went out, which a volatile topic loses.)"""
    import re

    from rclpy.executors import SingleThreadedExecutor

    log = tmp_path / "agent.log"
    agent = subprocess.Popen([str(BIN / "tokenspeed_agent"), "--ros-args", "--params-file",
                              str(ROOT / "tokenspeed_ros" / "config" / "agent.yaml"), "-p", "model:=tiny-random",
                              "-p", "diagnostics_period_s:=60.0"], env=ros_env, cwd=ROOT, stdout=open(log, "w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    harness = executor = None
    try:
        deadline = time.monotonic() + 60
        while "engine ready in" not in log.read_text() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = re.search(r"\[INFO\] \[(\d+\.\d+)\] \[tokenspeed_agent\]: engine ready in", log.read_text())
        assert ready, log.read_text()
        time.sleep(1.5)
        harness = LatencyHarness()
        executor = SingleThreadedExecutor()
        executor.add_node(harness)
        assert spin_until(executor, lambda: harness.engine_ready_at is not None, 20), log.read_text()
        heard = time.time()
    finally:
        if executor is not None:
            executor.shutdown()
        stop(agent)
    assert harness.started > float(ready.group(1)) + 1.0 and heard - harness.started < 20     # long before the next period
    # the engine's own "ready at" is taken just before its log line
    assert harness.engine_ready_at == pytest.approx(float(ready.group(1)), abs=0.05)
    assert harness.report()["engine_ready_after_s"] < -1.0
    harness.destroy_node()


def test_hit_rate_leaves_out_task_done_and_start_up_holds(ros_node):
    """The model's own task_done, a no_sensor_data hold before the agent's first observation and a
    decision superseded by a new task whose hold went out by its deadline are neither met nor
    missed; a no_sensor_data hold after the first observation (a sensor outage) and a superseded
    decision whose hold came after its deadline are misses. The messages are fed straight to the
    harness's callbacks in this process, in the order DDS would deliver them."""
    harness = LatencyHarness()
    try:
        def decide(i, source, reason, late=False):
            cmd = ActionCommand(decision_id=i, source=source, tool_name="hold" if source == "fallback" else "move_to")
            harness._on_action(cmd)
            status = DeadlineStatus(decision_id=i, met=reason == "ok", fallback_used=source == "fallback", reason=reason)
            status.header.stamp.sec, status.deadline.sec = 10, 11 if not late else 9
            harness._on_deadline(status)
            time.sleep(0.002)

        decide(1, "fallback", "no_sensor_data")          # start-up: nothing in the context yet
        harness._on_observation(Observation(source="joint_states", text="joints 0 0 0"))
        time.sleep(0.002)
        decide(2, "model", "ok")
        decide(3, "fallback", "no_sensor_data")          # an outage after the first reading: a miss
        decide(4, "fallback", "task_done")               # the model ended the task
        decide(5, "fallback", "superseded")              # a new task began; the hold went out in time
        decide(6, "fallback", "superseded", late=True)   # ... after the deadline: a miss
        dl = harness.report()["deadline"]
    finally:
        harness.destroy_node()
    assert dl == {"statuses": 3, "met": 1, "missed": 2, "hit_rate": pytest.approx(1 / 3), "fallback_used": 2,
                  "reasons": {"ok": 1, "no_sensor_data": 1, "superseded": 1},
                  "not_decisions": {"no_sensor_data": 1, "task_done": 1, "superseded": 1}}


def test_live_lines_say_why_a_fallback_went_out(ros_node, capsys):
    """A model call's line is printed when it arrives; a fallback's once its DeadlineStatus says
    why (a task_done hold is the model's call: "model task_done -> hold({})", next to RunTask's "the
    model called task_done"), whichever of the two DDS delivers first, and once."""
    harness = LatencyHarness(live=True)
    try:
        harness._on_action(ActionCommand(decision_id=1, source="model", tool_name="pick",
                                         arguments_json='{"object": "red_cube"}'))
        first = capsys.readouterr().out
        harness._on_action(ActionCommand(decision_id=2, source="fallback", tool_name="hold", arguments_json="{}"))
        waiting = capsys.readouterr().out
        harness._on_deadline(DeadlineStatus(decision_id=2, fallback_used=True, reason="task_done"))
        harness._on_deadline(DeadlineStatus(decision_id=1, met=True, reason="ok"))
        harness._on_deadline(DeadlineStatus(decision_id=3, fallback_used=True, reason="deadline_missed"))
        harness._on_action(ActionCommand(decision_id=3, source="fallback", tool_name="hold", arguments_json="{}"))
        later = capsys.readouterr().out.splitlines()
    finally:
        harness.destroy_node()
    assert 'decision 1    model    pick({"object": "red_cube"})  sensor->published' in first and waiting == ""
    assert len(later) == 2 and "decision 2    model    task_done -> hold({})  sensor->published" in later[0]
    assert "decision 3    fallback hold({}) (deadline_missed)" in later[1]


def test_harness_reports_a_short_closed_loop_run(sim_process, ros_node, spin, ros_env, tmp_path):
    harness = subprocess.Popen([sys.executable, "-m", "tokenspeed_sim.harness", "--duration", "6",
                                "--wait-engine", "30", "--out", str(tmp_path)], env=ros_env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        images = []
        ros_node.create_subscription(Image, "camera/image_raw", images.append, 2)
        obs_pub = ros_node.create_publisher(Observation, "agent/observation", 10)
        act_pub = ros_node.create_publisher(ActionCommand, "agent/action", 10)
        dl_pub = ros_node.create_publisher(DeadlineStatus, "agent/deadline_status", 10)
        diag_pub = ros_node.create_publisher(DiagnosticArray, "/diagnostics", DIAGNOSTICS_QOS)    # as agents publish it
        # the sim and the harness both listen to agent/action; the harness to the other three
        assert spin(lambda: act_pub.get_subscription_count() >= 2 and obs_pub.get_subscription_count() >= 1
                    and dl_pub.get_subscription_count() >= 1 and diag_pub.get_subscription_count() >= 1 and images, 30)
        # while the "engine loads": a fallback, not part of the measured window
        cmd = ActionCommand(decision_id=100, observation_stamp=images[-1].header.stamp, source="fallback",
                            tool_name="hold", arguments_json="{}")
        cmd.header.stamp = ros_node.get_clock().now().to_msg()
        act_pub.publish(cmd)
        dl_pub.publish(DeadlineStatus(decision_id=100, fallback_used=True, fallback="hold", reason="engine_loading"))
        spin(lambda: False, 0.5)
        diag_pub.publish(DiagnosticArray(status=[DiagnosticStatus(
            name="tokenspeed_agent: engine", values=[KeyValue(key="state", value="ready")])]))
        spin(lambda: False, 0.5)
        for i in range(1, 7):        # a scripted agent: observe the latest image, decide, publish
            n_images = len(images)
            assert spin(lambda: len(images) > n_images, 5)
            stamp = images[-1].header.stamp
            echo = Observation(source="camera", text="red cube at 0.5 0.1")   # stamp via float seconds,
            echo.header.stamp = Time(nanoseconds=round((stamp.sec + stamp.nanosec * 1e-9) * 1e9)).to_msg()  # as agents do
            obs_pub.publish(echo)
            spin(lambda: False, 0.1)                                   # "prefill + decode"
            fallback = i % 3 == 0
            cmd = ActionCommand(decision_id=i, observation_stamp=stamp, ttft_s=0.0 if fallback else 0.02,
                                source="fallback" if fallback else "model",
                                tool_name="hold" if fallback else "move_to",
                                arguments_json="{}" if fallback else json.dumps({"x": 0.5, "y": 0.1 * (-1) ** i, "z": 0.3}))
            cmd.header.stamp = ros_node.get_clock().now().to_msg()
            act_pub.publish(cmd)
            dl_pub.publish(DeadlineStatus(decision_id=i, observation_stamp=stamp, met=not fallback,
                                          fallback_used=fallback, fallback="hold" if fallback else "",
                                          reason="deadline_missed" if fallback else "ok"))
        out, _ = harness.communicate(timeout=30)
    finally:
        stop(harness)
    assert harness.returncode == 0, out
    assert "closed-loop latency" in out and "task:" in out

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["before_window"] == {"decisions": 1, "fallbacks": 1, "reasons": {"engine_loading": 1}}
    assert 0 < report["engine_ready_after_s"] < 30
    assert report["decisions"] == 6 and report["model_decisions"] == 4 and report["fallbacks"] == 2
    assert report["deadline"] == {"statuses": 6, "met": 4, "missed": 2, "hit_rate": pytest.approx(4 / 6),
                                  "fallback_used": 2, "reasons": {"ok": 4, "deadline_missed": 2}, "not_decisions": {}}
    for stage in ("capture_to_context_s", "ttft_s", "capture_to_published_s", "published_to_applied_s", "end_to_end_s"):
        st = report["stages"][stage]
        assert st["n"] == 4 and 0 <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"], (stage, st)
    assert report["stages"]["ttft_s"]["max"] == pytest.approx(0.02)
    assert report["fallback_end_to_end_s"]["n"] == 2
    for row in report["per_decision"][1:]:
        assert row["in_window"] and row["applied"] is not None and row["outcome"] in ("applied", "done", "preempted")
        assert row["end_to_end_s"] == pytest.approx(row["capture_to_published_s"] + row["published_to_applied_s"])
        assert row["capture_to_context_s"] <= row["capture_to_published_s"] + 0.05
    assert report["feedback"]["applied"] == 6
    assert report["task"]["target_object"] == "red_cube" and report["task"]["success"] is False
    png = (tmp_path / "latency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
