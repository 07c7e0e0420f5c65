"""The simulator's command timeout (ros2_control's `cmd_timeout`) over real DDS: an agent process
that is killed with SIGKILL mid-pick leaves the arm stopped within the timeout, not finishing
the motion unattended.

The agent process runs the real command path (a rclpy node with the real DeadlineMonitor, its
heartbeat and its command publisher); the model's decision is replaced by a scripted `pick`
resolved through the monitor, because the test is about what happens after the agent dies.
"""
import json
import signal
import subprocess
import sys
import time

from rclpy.time import Time
from std_msgs.msg import String
from tokenspeed_msgs.msg import ActionFeedback

from support import ROOT

AGENT = r'''
import rclpy
from rclpy.executors import SingleThreadedExecutor
from tokenspeed_ros.deadline_monitor import DeadlineMonitor, ModelResult

rclpy.init()
node = rclpy.create_node("tokenspeed_agent")
monitor = DeadlineMonitor(node, action_topic="agent/action", status_topic="agent/deadline_status",
                          budget_s=5.0, fallback="hold", period_s=0.01)
executor = SingleThreadedExecutor()
executor.add_node(node)
while node.count_subscribers("agent/action") < 1:
    executor.spin_once(timeout_sec=0.1)
executor.spin_once(timeout_sec=1.0)   # heartbeats flowing, the subscriber matched
d = monitor.open(node.get_clock().now())
monitor.resolve(ModelResult(d.decision_id, "ok", {"name": "pick", "arguments": {"object": "red_cube"}}))
print("picked", flush=True)
executor.spin()
'''


def test_a_killed_agent_leaves_the_arm_stopped(sim_process, ros_node, spin, ros_env):
    feedback = []
    ros_node.create_subscription(ActionFeedback, "sim/action_feedback", feedback.append, 50)
    assert spin(lambda: ros_node.count_publishers("sim/action_feedback") > 0, 30)
    agent = subprocess.Popen([sys.executable, "-c", AGENT], env=ros_env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert spin(lambda: any(f.state == "applied" and f.tool_name == "pick" for f in feedback), 30)
        time.sleep(0.5)                                   # mid-pick (a pick takes ~3 s)
        agent.send_signal(signal.SIGKILL)
        killed_at = time.time()
        assert spin(lambda: any(f.state == "preempted" for f in feedback), 5)
    finally:
        agent.kill()
        agent.wait()
    pick = [f for f in feedback if f.tool_name == "pick"]
    assert [f.state for f in pick] == ["applied", "preempted"] and "command timeout" in pick[-1].detail
    # when the simulator stopped the arm (its feedback's stamp, system time), not when this busy
    # test process got round to reading it
    stopped_after = Time.from_msg(pick[-1].header.stamp).nanoseconds / 1e9 - killed_at
    assert 0.3 < stopped_after < 0.5 + 0.5    # cmd_timeout_s in cobot_sim.yaml after the last heartbeat, plus the sim's tick
    status = {}
    ros_node.create_subscription(String, "sim/scenario_status", lambda m: status.update(json.loads(m.data)), 1)
    spin(lambda: False, 3.0)                  # the pick would have finished by now
    assert not any(f.state == "done" and f.tool_name == "pick" for f in feedback)
    assert status["cmd_timeouts"] == 1 and not status["busy"]
