"""Helpers for the ROS tests: an rclpy probe node in the test process that publishes sensor data
and records what the agent publishes, and a synthetic camera."""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from support import ROOT, spin_until

AGENT_PARAMS = ROOT / "tokenspeed_ros" / "config" / "agent.yaml"

# A synthetic camera: 320x240, f = 200 px, 1 m above (0.5, 0) looking straight down; image right
# is the robot's right (-y), image down is towards the robot (-x).
WIDTH, HEIGHT, FOCAL = 320, 240, 200.0
CAMERA_POSITION = (0.5, 0.0, 1.0)
CAMERA_QUATERNION = (math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0)     # (x, y, z, w)
CUBE_Z = 0.025


class Probe:
    """An rclpy node in the test process with its own context: `listen` records messages per
    topic in `msgs`, `spin_until` spins until a predicate holds or a timeout passes."""

    def __init__(self):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor

        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx)
        self.node = rclpy.create_node("test_probe", context=self.ctx)
        self.executor = SingleThreadedExecutor(context=self.ctx)
        self.executor.add_node(self.node)
        self.msgs: dict[str, list] = defaultdict(list)

    def listen(self, msg_type, topic: str, qos=10) -> list:
        """Record every `msg_type` message on `topic`; returns the (live) list."""
        self.node.create_subscription(msg_type, topic, self.msgs[topic].append, qos)
        return self.msgs[topic]

    def spin_until(self, predicate, timeout: float) -> bool:
        """Spin until `predicate()` is true (returns True) or `timeout` seconds pass (False)."""
        return spin_until(self.executor, predicate, timeout)

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self.ctx.try_shutdown()


def camera_info():
    from sensor_msgs.msg import CameraInfo

    k = [FOCAL, 0.0, WIDTH / 2 - 0.5, 0.0, FOCAL, HEIGHT / 2 - 0.5, 0.0, 0.0, 1.0]
    return CameraInfo(width=WIDTH, height=HEIGHT, k=k)


def camera_pose():
    from geometry_msgs.msg import PoseStamped

    msg = PoseStamped()
    msg.header.frame_id = "base"
    p, o = msg.pose.position, msg.pose.orientation
    p.x, p.y, p.z = CAMERA_POSITION
    o.x, o.y, o.z, o.w = CAMERA_QUATERNION
    return msg


def render_cubes(cubes: dict[str, tuple[float, float]]) -> np.ndarray:
    """Synthetic RGB image [HEIGHT, WIDTH, 3] of the synthetic camera: grey table, a 5 cm
    square of each named cube's colour centred at its (x, y) in metres."""
    import cv2
    from tokenspeed_ros.perception import CameraModel

    model = CameraModel.from_msgs(camera_info(), camera_pose().pose)
    colours = {"red_cube": (220, 30, 30), "green_cube": (30, 180, 40), "blue_cube": (30, 50, 220)}
    img = np.full((HEIGHT, WIDTH, 3), 170, np.uint8)
    for name, (x, y) in cubes.items():
        corners = [model.project((x + dx, y + dy, CUBE_Z)) for dx in (-0.025, 0.025) for dy in (-0.025, 0.025)]
        us, vs = zip(*corners)
        cv2.rectangle(img, (round(min(us)), round(min(vs))), (round(max(us)), round(max(vs))), colours[name], -1)
    return img


class SensorFeed:
    """Publishes what the agent needs from a robot, from the probe node: the camera pose
    (latched, once), and at `rate_hz` fresh-stamped joint states, a camera image of `cubes`
    and CameraInfo. `joints` / `cubes` can be changed between spins."""

    def __init__(self, probe: Probe, rate_hz: float = 10.0):
        from geometry_msgs.msg import PoseStamped
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import CameraInfo, Image, JointState

        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.node = node = probe.node
        self.joints = [0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785, 0.04, 0.04]
        self.cubes = {"red_cube": (0.5, 0.1), "blue_cube": (0.4, -0.1)}
        self.joint_pub = node.create_publisher(JointState, "joint_states", 10)
        self.image_pub = node.create_publisher(Image, "camera/image_raw", 2)
        self.info_pub = node.create_publisher(CameraInfo, "camera/camera_info", 2)
        self.pose_pub = node.create_publisher(PoseStamped, "camera/pose", latched)
        pose = camera_pose()
        pose.header.stamp = node.get_clock().now().to_msg()
        self.pose_pub.publish(pose)
        self._JointState, self._Image = JointState, Image
        self.timer = node.create_timer(1.0 / rate_hz, self.publish)

    def publish(self) -> None:
        stamp = self.node.get_clock().now().to_msg()
        js = self._JointState(position=self.joints)
        js.header.stamp = stamp
        self.joint_pub.publish(js)
        rgb = render_cubes(self.cubes)
        img = self._Image(height=HEIGHT, width=WIDTH, encoding="rgb8", step=3 * WIDTH, data=rgb.tobytes())
        img.header.stamp = stamp
        self.image_pub.publish(img)
        info = camera_info()
        info.header.stamp = stamp
        self.info_pub.publish(info)


def delayed_agent(module: str, owner: str, method: str, seconds: float) -> str:
    """Python source of a tokenspeed_agent process in which `module`.`owner`.`method` first sleeps
    `seconds` s, for `start_agent(code=...)`: an injected fault (a slow load, a hung forward, a
    starved engine thread) for what nothing outside the process causes on cue."""
    return f"""
import sys, time
import {module} as target
real = target.{owner}.{method}
def delayed(self, *args, **kwargs):
    time.sleep({seconds!r})
    return real(self, *args, **kwargs)
target.{owner}.{method} = delayed
from tokenspeed_ros.agent_node import main
sys.exit(main())
"""


def realtime_allowed() -> bool:
    """Whether a thread of this process may take the SCHED_FIFO policy (root, CAP_SYS_NICE or an
    rtprio limit): tried on a scratch thread."""
    import os
    import threading

    allowed = []

    def attempt():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            allowed.append(True)
        except (OSError, AttributeError):
            pass

    t = threading.Thread(target=attempt)
    t.start()
    t.join()
    return bool(allowed)


def diagnostics(msg) -> dict[str, dict[str, str]]:
    """diagnostic_msgs/DiagnosticArray -> {status name: {key: value}}."""
    return {s.name: {kv.key: kv.value for kv in s.values} for s in msg.status}


class Lifecycle:
    """Lifecycle client of a managed node from the probe: `state()` and `change(transition)`
    (lifecycle_msgs/Transition ids) over its get_state / change_state services."""

    def __init__(self, probe: Probe, node: str = "tokenspeed_agent"):
        from lifecycle_msgs.srv import ChangeState, GetState

        self.probe = probe
        self._get = probe.node.create_client(GetState, f"/{node}/get_state")
        self._change = probe.node.create_client(ChangeState, f"/{node}/change_state")
        self._GetState, self._ChangeState = GetState, ChangeState

    def _call(self, client, request, timeout: float):
        assert self.probe.spin_until(client.service_is_ready, 60), "lifecycle services did not appear"
        future = client.call_async(request)
        assert self.probe.spin_until(future.done, timeout), "no answer"
        return future.result()

    def state(self) -> str:
        """The node's lifecycle state label ("unconfigured", "inactive", "active", ...)."""
        return self._call(self._get, self._GetState.Request(), 10).current_state.label

    def change(self, transition: int, timeout: float = 120.0) -> bool:
        """Request a transition; returns its success (configure waits for the model)."""
        from lifecycle_msgs.msg import Transition

        return self._call(self._change, self._ChangeState.Request(transition=Transition(id=transition)),
                          timeout).success
