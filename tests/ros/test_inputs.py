"""SensorGate: which reading a decision answers (its stamp), without a ROS graph."""
from rclpy.logging import get_logger
from rclpy.time import Time

from tokenspeed_ros.inputs import InputHealth, SensorGate


def test_a_decision_answers_the_newest_reading_that_feeds_the_context():
    """Joint states that stay out of the context keep their source fresh but do not stamp
    decisions: a decision on the camera's state line is stamped with the camera frame, and one
    that answers the robot's feedback with the feedback when that is newer."""
    gate = SensorGate(InputHealth(get_logger("test")), ("joint_states", "camera"), 0.0)
    assert gate.newest() is None
    gate.received("camera", Time(seconds=10), 10.0, 10.05)
    gate.received("joint_states", Time(seconds=10, nanoseconds=40_000_000), 10.04, 10.04, feeds=False)
    assert gate.latest_stamp == Time(seconds=10) and gate.missing(10.1, 2.0) == []
    assert gate.newest(Time(seconds=11)) == Time(seconds=11)          # the feedback came later
    assert gate.newest(Time(seconds=9)) == Time(seconds=10)
    gate.received("joint_states", Time(seconds=12), 12.0, 12.0)       # joint states in the context
    assert gate.newest() == Time(seconds=12)
