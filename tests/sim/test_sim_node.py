"""The simulator node over real DDS: it publishes joint states, camera images, camera model, goal
and scenario status, executes an ActionCommand sent from this process and rejects bad ones, and
resets to a new task on sim/reset."""
import json

import numpy as np
import pybullet
from geometry_msgs.msg import PoseStamped
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CameraInfo, Image, JointState
from std_msgs.msg import String
from std_srvs.srv import Trigger
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback

from support import stop

LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)


def test_sim_node_publishes_sensors_and_executes_commands(sim_process, ros_node, spin):
    got = {"joints": [], "images": [], "feedback": []}
    ros_node.create_subscription(JointState, "joint_states", got["joints"].append, 10)
    ros_node.create_subscription(Image, "camera/image_raw", got["images"].append, 2)
    for topic, kind in (("camera/camera_info", CameraInfo), ("camera/pose", PoseStamped), ("goal", String),
                        ("sim/scenario_status", String)):
        ros_node.create_subscription(kind, topic, lambda m, t=topic: got.__setitem__(t, m), LATCHED)
    ros_node.create_subscription(ActionFeedback, "sim/action_feedback", got["feedback"].append, 50)
    commands = ros_node.create_publisher(ActionCommand, "agent/action", 10)

    assert spin(lambda: len(got["images"]) >= 2 and len(got["joints"]) >= 10 and "sim/scenario_status" in got
                and "camera/pose" in got and "goal" in got and commands.get_subscription_count() > 0, 30)
    js = got["joints"][-1]
    assert js.name[:7] == [f"panda_joint{i}" for i in range(1, 8)] and len(js.position) == 9
    assert js.header.frame_id == "base" and js.header.stamp.sec > 0
    status = json.loads(got["sim/scenario_status"].data)
    assert got["goal"].data == status["goal"] and "red cube" in status["goal"]

    # the image shows each cube where ground truth + the published camera model say it is
    img_msg, info, pose = got["images"][-1], got["camera/camera_info"], got["camera/pose"].pose
    assert (img_msg.encoding, img_msg.width, img_msg.height, img_msg.step) == ("rgb8", 320, 240, 960)
    img = np.frombuffer(bytes(img_msg.data), np.uint8).reshape(240, 320, 3)
    k = np.array(info.k).reshape(3, 3)
    r = np.array(pybullet.getMatrixFromQuaternion(
        [pose.orientation.x, pose.orientation.y, pose.orientation.z, pose.orientation.w])).reshape(3, 3)
    t = np.array([pose.position.x, pose.position.y, pose.position.z])
    for name, channel in (("red_cube", 0), ("green_cube", 1), ("blue_cube", 2)):
        uvw = k @ (r.T @ (np.array(status["objects"][name]) - t))
        u, v = (uvw[:2] / uvw[2]).round().astype(int)
        pixel = img[v, u].astype(int)
        assert pixel[channel] > 80 and pixel[channel] > 2 * np.delete(pixel, channel).max(), (name, pixel)

    def send(decision_id, tool, args):
        msg = ActionCommand(decision_id=decision_id, tool_name=tool, arguments_json=args, source="model")
        msg.header.stamp = ros_node.get_clock().now().to_msg()
        commands.publish(msg)

    send(1, "place", '{"x": 0.5, "y": 0.0}')                # holding nothing yet
    send(2, "pick", '{"object": "red_cube"')                # truncated JSON
    send(3, "pick", '{"object": "red_cube"}')
    assert spin(lambda: any(f.decision_id == 3 and f.state == "done" for f in got["feedback"]), 20)
    states = [(f.decision_id, f.state) for f in got["feedback"]]
    assert states == [(1, "rejected"), (2, "rejected"), (3, "applied"), (3, "done")]
    assert "not holding" in got["feedback"][0].detail and "not valid JSON" in got["feedback"][1].detail

    def lifted():   # the scenario status (2 Hz) shows the cube held and lifted
        status = json.loads(got["sim/scenario_status"].data)
        return status["holding"] == "red_cube" and status["objects"]["red_cube"][2] > 0.15
    assert spin(lifted, 5)
    assert json.loads(got["sim/scenario_status"].data)["commands_rejected"] == 2

    # sim/reset: the next task (green cube) in a new layout, announced on the goal topic; the arm is empty
    send(4, "move_to", '{"x": 0.4, "y": 0.0, "z": 0.3}')
    assert spin(lambda: any(f.decision_id == 4 and f.state == "applied" for f in got["feedback"]), 10)
    reset = ros_node.create_client(Trigger, "sim/reset")
    assert reset.wait_for_service(timeout_sec=10)
    future = reset.call_async(Trigger.Request())
    assert spin(future.done, 10) and future.result().success
    goal = future.result().message
    assert "green cube" in goal and goal != status["goal"]
    assert spin(lambda: got["goal"].data == goal and json.loads(got["sim/scenario_status"].data)["resets"] == 1, 10)
    assert any(f.decision_id == 4 and f.state == "preempted" and f.detail == "scene reset" for f in got["feedback"])
    status = json.loads(got["sim/scenario_status"].data)
    assert status["goal"] == goal and status["holding"] is None and not status["busy"]
    assert status["objects"]["red_cube"][2] < 0.03

    assert stop(sim_process) == 0                      # clean exit on SIGINT
    out = sim_process.stdout.read()
    assert "final status" in out and "Traceback" not in out
