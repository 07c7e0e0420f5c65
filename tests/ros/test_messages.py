"""tokenspeed_msgs round trip between processes over DDS: a relay process republishes what it
receives, and every field comes back unchanged."""
import subprocess
import sys

from builtin_interfaces.msg import Time
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback, DeadlineStatus, Observation

from support import stop

RELAY = """
import rclpy
from rclpy.executors import ExternalShutdownException
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback, DeadlineStatus, Observation
rclpy.init()
node = rclpy.create_node("relay")
for msg_type in (ActionCommand, DeadlineStatus, Observation, ActionFeedback):
    pub = node.create_publisher(msg_type, "rt/out/" + msg_type.__name__, 10)
    node.create_subscription(msg_type, "rt/in/" + msg_type.__name__, pub.publish, 10)
try:
    rclpy.spin(node)
except (KeyboardInterrupt, ExternalShutdownException):
    pass
"""


def sample_messages():
    stamp = Time(sec=1_700_000_000, nanosec=123_456_789)
    cmd = ActionCommand(decision_id=42, tool_name="place", arguments_json='{"x": 0.5, "y": -0.1}',
                        source=ActionCommand.SOURCE_MODEL, observation_stamp=stamp,
                        decision_latency_s=0.123, ttft_s=0.045)
    cmd.header.stamp, cmd.header.frame_id = stamp, "base"
    status = DeadlineStatus(decision_id=42, observation_stamp=stamp, deadline=Time(sec=1_700_000_002),
                            met=False, fallback_used=True, fallback="hold", reason="late_result_dropped",
                            latency_s=2.5)
    obs = Observation(source="camera", text="objects red_cube=(0.50,0.10) ünïcode", tokens=17)
    obs.header.stamp = stamp
    feedback = ActionFeedback(decision_id=42, tool_name="place", state="done", detail="ok")
    return [cmd, status, obs, feedback]


def test_messages_round_trip_through_another_process(probe, ros_env):
    relay = subprocess.Popen([sys.executable, "-c", RELAY], env=ros_env, start_new_session=True)
    try:
        sent = sample_messages()
        received = {type(m).__name__: probe.listen(type(m), "rt/out/" + type(m).__name__) for m in sent}
        pubs = {type(m).__name__: probe.node.create_publisher(type(m), "rt/in/" + type(m).__name__, 10) for m in sent}
        for _ in range(100):          # publish until the relay is matched and everything came back
            for m in sent:
                if not received[type(m).__name__]:
                    pubs[type(m).__name__].publish(m)
            if probe.spin_until(lambda: all(received.values()), 0.3):
                break
        for m in sent:
            assert received[type(m).__name__][0] == m
    finally:
        assert stop(relay) == 0
