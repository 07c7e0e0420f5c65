"""rosbag2 record and replay: `tokenspeed_demo --record` writes a real MCAP bag of the project's
own simulator and agent (tiny random model) over DDS; `tokenspeed_replay` plays its inputs into a
fresh agent process as if live, with the robot's recorded feedback answering the replayed agent's
same calls, and the replayed run decides on the same observations."""
import json
import subprocess
import sys

import pytest
from rclpy.serialization import deserialize_message
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback

from support import BIN, ROOT
from tokenspeed_sim.bag import INPUTS, BagError, Recorder, offered_qos, read_bag, typestore


def write_bag(path, messages):
    """A rosbag2 (MCAP) folder of `messages`: (receive time ns, relative topic, ROS type, CDR bytes)."""
    from rosbags.rosbag2 import StoragePlugin, Writer

    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        store, conns = typestore(), {}
        for t, topic, ros_type, raw in messages:
            if topic not in conns:
                conns[topic] = writer.add_connection("/" + topic, ros_type, typestore=store)
            writer.write(conns[topic], t, raw)


def joint_state_cdr() -> bytes:
    from rclpy.serialization import serialize_message
    from sensor_msgs.msg import JointState

    msg = JointState(name=["a", "b"], position=[0.1, 0.2])
    msg.header.stamp.sec = 1_700_000_000
    return serialize_message(msg)


@pytest.mark.parametrize("case", ["corrupt_message", "impossible_receive_time"])
def test_replay_refuses_a_damaged_bag_with_its_clean_exit_code(case, tmp_path):
    """A bag with one truncated message, or one receive time 1e18 ns (31 years) after the others:
    `tokenspeed_replay` says which message and exits 2, before any agent starts (it used to end
    with an RMWError traceback, or to wait for 31 years)."""
    t0, good = 1_700_000_000 * 10 ** 9, joint_state_cdr()
    bad = (good[:12], t0 + 10 ** 8) if case == "corrupt_message" else (good, t0 + 10 ** 18)
    write_bag(tmp_path / "bag", [(t0, "joint_states", "sensor_msgs/msg/JointState", good),
                                 (bad[1], "joint_states", "sensor_msgs/msg/JointState", bad[0]),
                                 (t0 + 2 * 10 ** 8, "joint_states", "sensor_msgs/msg/JointState", good)])
    out = subprocess.run([str(BIN / "tokenspeed_replay"), str(tmp_path / "bag"), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert ("corrupt message 1 on joint_states" if case == "corrupt_message"
            else "impossible receive time: message 2 on joint_states") in out.stderr, out.stderr


def test_recorded_bag_names_topics_fully_and_keeps_their_qos(ros_env, tmp_path):
    """The recorder writes fully qualified topic names and each topic's QoS profile, which the
    replay publishes with again (a latched topic stays transient local)."""
    from rclpy.qos import DurabilityPolicy
    from rosbags.rosbag2 import Reader

    Recorder(tmp_path / "bag").close()
    with Reader(tmp_path / "bag") as reader:
        topics = {c.topic for c in reader.connections}
    assert "/camera/pose" in topics and "/joint_states" in topics and all(t.startswith("/") for t in topics)
    qos = offered_qos(tmp_path / "bag")
    assert qos["camera/pose"].durability == DurabilityPolicy.TRANSIENT_LOCAL and qos["camera/pose"].depth == 1
    assert qos["joint_states"].durability == DurabilityPolicy.VOLATILE and qos["joint_states"].depth == 100


def test_unreadable_bag_is_a_clear_error(tmp_path):
    with pytest.raises(BagError, match="cannot read bag"):
        read_bag(tmp_path / "missing")
    out = subprocess.run([str(BIN / "tokenspeed_replay"), str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot read bag" in out.stderr


def test_record_a_demo_run_then_replay_it_into_a_new_agent(ros_env, tmp_path):
    bag = tmp_path / "bag"
    rec = subprocess.run([sys.executable, "-m", "tokenspeed_sim.demo", "--duration", "5", "--record", str(bag),
                          "--out", str(tmp_path / "demo"), "--set", "tokenspeed_agent.model=tiny-random"],
                         env=ros_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rec.returncode == 0, rec.stdout[-3000:] + rec.stderr[-3000:]
    assert (bag / "metadata.yaml").is_file() and list(bag.glob("*.mcap"))
    topics = {topic for _, topic, _ in read_bag(bag)}
    assert set(INPUTS) | {"agent/action", "agent/observation", "sim/action_feedback"} <= topics

    out = subprocess.run([str(BIN / "tokenspeed_replay"), str(bag), "--model", "tiny-random",
                          "--set", "tokenspeed_agent.tool_choice=hold", "--out", str(tmp_path / "replay")],
                         env=ros_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert result["inputs_replayed"] > 100 and result["replayed"]["model"] >= 1
    assert result["replayed"]["tools"] == {"hold": result["replayed"]["model"]}      # the new setting
    # the robot's recorded feedback on each recorded call answered the replayed agent's same call or is counted out
    messages = read_bag(bag)
    calls = {deserialize_message(raw, ActionCommand).decision_id for _, topic, raw in messages
             if topic == "agent/action"}
    answered = sum(deserialize_message(raw, ActionFeedback).decision_id in calls
                   for _, topic, raw in messages if topic == "sim/action_feedback")
    assert answered >= 1 and result["feedback_replayed"] + result["feedback_left_out"] == answered
    # the replayed agent saw the recorded scenes (perception of the replayed camera images); under
    # load a replayed frame can land between two recorded ones, so not every scene need match
    assert result["observed_scenes_replayed"] >= 1
    assert result["observed_scenes_replayed_seen_in_recording"] >= 1
