"""ROS 2 node `tokenspeed_cobot_sim`: the PyBullet cobot scene (`tokenspeed_sim.cobot`) on topics.

Time: wall clock. Every stamp is the ROS system clock (`use_sim_time` stays false), so latencies
between processes (sensor capture -> observation -> decision -> action applied) are differences
of stamps taken on one host clock. Physics runs in real time: a timer steps the scene in fixed
steps of 1/`physics_rate_hz` seconds as many times as wall time has advanced (at most
`max_catchup_s` of physics per tick; time beyond that is dropped and counted as an overrun).

Published (all reliable; remap names with `--ros-args -r`):
- `joint_states` (sensor_msgs/JointState, `joint_state_rate_hz`): 7 arm joints (rad) and 2
  finger joints (m), frame `base`.
- `camera/image_raw` (sensor_msgs/Image, rgb8, `camera_rate_hz`, depth 2): stamp = the wall time
  of the scene state that was rendered. Rendering runs in a child process
  (`tokenspeed_sim.camera_process`), so it never delays commands or physics; the image is
  published when ready (render time later), and a frame is skipped if the last is not done.
- `camera/camera_info` (sensor_msgs/CameraInfo, with every image, same stamp; transient local):
  pinhole, no distortion, K = [f 0 cx; 0 f cy; 0 0 1] with pixel (0, 0) = centre of the top-left
  pixel, P = [K | 0], R = I. frame_id = `camera_optical`.
- `camera/pose` (geometry_msgs/PoseStamped, transient local, once): the pose of `camera_optical`
  (REP 103 optical frame: x right, y down, z forward) in the robot base frame `base`
  (x forward, y left, z up, origin at the robot's foot, table top at z = 0). With R the
  rotation of that quaternion and t its position, a pixel (u, v) looks along the base-frame ray
  t + s * R @ K^-1 [u, v, 1]; intersecting it with z = 0.025 (cube centres) gives a cube's x, y.
- `goal` (std_msgs/String, transient local, once): the task, e.g. "Put the red cube on the
  yellow target at x=0.53 y=0.11 ...".
- `sim/action_feedback` (tokenspeed_msgs/ActionFeedback): per command "applied" (execution
  started; stamp = when the sim switched to it), "done", "preempted" (another command took over)
  or "rejected" (unknown tool, bad JSON, arguments outside the tool schema, or impossible now,
  e.g. place while holding nothing; `detail` says why).
- `sim/scenario_status` (std_msgs/String, JSON, `status_rate_hz`, transient local): the ground
  truth of `CobotScene.scenario_status()` plus wall `stamp` and `overruns`.

Service `sim/reset` (std_srvs/Trigger): a new task in the same cell, for workloads that never
end (`tokenspeed_soak`): the arm goes home with open fingers, the cubes and the target are placed
anew from seed + the number of resets so far, and the target cube is the next one of red, green,
blue after the last. The executing command is "preempted" (detail "scene reset"); the new goal is
published on `goal` and returned as the response's `message`; `resets` in the scenario status
counts them.

Subscribed: `agent/action` (tokenspeed_msgs/ActionCommand): `tool_name` + `arguments_json` from
the tool file; `decision_id` is echoed in the feedback. `agent/action/heartbeat`
(std_msgs/Header): the agent's deadline monitor says it is alive (see `HEARTBEAT_SUFFIX` in
`tokenspeed_ros.deadline_monitor`).

Command timeout (ros2_control's `cmd_timeout`): once a heartbeat has been received, silence
on the heartbeat and the commands for `cmd_timeout_s` seconds (a killed or hung agent) stops the
arm where it is, as the `stop` tool would; the executing command gets "preempted" with detail
"command timeout", counted as `cmd_timeouts` in the scenario status. The next heartbeat re-arms
it. A peer that sends commands without a heartbeat (a test, a teleop script) is not watched.
`cmd_timeout_s` = 0 turns it off. A real robot needs the same watchdog in its driver or
controller (ros2_control: the controller's `cmd_timeout`; twist_mux: the topic timeout), fed by
the same heartbeat, so a dead agent can never leave the arm moving.
"""
from __future__ import annotations

import json
import time

import rclpy
from geometry_msgs.msg import PoseStamped
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CameraInfo, Image, JointState
from std_msgs.msg import Header, String
from std_srvs.srv import Trigger
from tokenspeed_msgs.msg import ActionCommand, ActionFeedback

from tokenspeed_ros.launch_spec import COBOT_SIM, help_requested, params_path
from tokenspeed_sim import ros_spin
from tokenspeed_sim.camera_process import CameraProcess
from tokenspeed_sim.cobot import CUBES, DEFAULT_TOOLS, CobotScene, CommandRejected, Event, SceneConfig

LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)


class CobotSimNode(Node):
    """The simulator as a ROS 2 node; parameters are declared in `__init__` with their defaults
    (the same values as tokenspeed_ros/config/cobot_sim.yaml)."""

    def __init__(self, **node_kwargs):
        super().__init__("tokenspeed_cobot_sim", **node_kwargs)
        d = SceneConfig()
        prm = {
            "seed": d.seed,
            "target_object": d.target_object,
            "success_tolerance": d.success_tolerance,
            "tools_file": "",                         # empty: the engine's tokenspeed/data/tools/robot_tools.json
            "physics_rate_hz": 1.0 / d.time_step,
            "tick_rate_hz": 100.0,                    # how often physics catches up with wall time
            "max_catchup_s": 0.25,
            "joint_state_rate_hz": 50.0,
            "camera_rate_hz": 5.0,
            "status_rate_hz": 2.0,
            "image_width": d.image_width,
            "image_height": d.image_height,
            "fov_deg": d.fov_deg,
            "camera_eye": list(d.camera_eye),
            "camera_target": list(d.camera_target),
            "cmd_timeout_s": 0.5,                     # stop the arm after this much agent silence; 0 = off
        }
        for name, default in prm.items():
            self.declare_parameter(name, default)
        v = {name: self.get_parameter(name).value for name in prm}
        for name in ("physics_rate_hz", "tick_rate_hz", "joint_state_rate_hz", "camera_rate_hz", "status_rate_hz"):
            if not v[name] > 0:
                raise ValueError(f"parameter {name} must be > 0, got {v[name]}")
        if not 0 <= v["cmd_timeout_s"] < float("inf"):
            raise ValueError(f"parameter cmd_timeout_s must be >= 0 and finite, got {v['cmd_timeout_s']}")
        self.cmd_timeout_s = v["cmd_timeout_s"]
        self._seed = v["seed"]
        self.cmd_timeouts = 0
        self._last_command: float | None = None   # monotonic time of the last heartbeat or command; None = unwatched
        self.scene = CobotScene(SceneConfig(
            seed=v["seed"], target_object=v["target_object"], success_tolerance=v["success_tolerance"],
            time_step=1.0 / v["physics_rate_hz"], image_width=v["image_width"], image_height=v["image_height"],
            fov_deg=v["fov_deg"], camera_eye=tuple(v["camera_eye"]), camera_target=tuple(v["camera_target"]),
            tools_file=v["tools_file"] or str(DEFAULT_TOOLS)))
        self._max_catchup_steps = max(1, int(v["max_catchup_s"] * v["physics_rate_hz"]))
        self.overruns = 0
        self.render_s: list[float] = []     # wall seconds snapshot -> image ready, for the log at shutdown
        self.frames_skipped = 0
        self.camera = CameraProcess(self.scene.config)
        self._frame: tuple | None = None     # (stamp, perf_counter) of the frame being rendered

        self.pub_joints = self.create_publisher(JointState, "joint_states", 10)
        self.pub_image = self.create_publisher(Image, "camera/image_raw", 2)
        self.pub_info = self.create_publisher(CameraInfo, "camera/camera_info", LATCHED)
        self.pub_pose = self.create_publisher(PoseStamped, "camera/pose", LATCHED)
        self.pub_goal = self.create_publisher(String, "goal", LATCHED)
        self.pub_feedback = self.create_publisher(ActionFeedback, "sim/action_feedback", 50)
        self.pub_status = self.create_publisher(String, "sim/scenario_status", LATCHED)
        self.create_subscription(ActionCommand, "agent/action", self._on_action, 10)
        self.create_subscription(Header, "agent/action/heartbeat", self._on_heartbeat, 10)
        self.resets = 0
        self.create_service(Trigger, "sim/reset", self._on_reset)

        self._t0 = time.monotonic()
        self._steps = 0
        self.create_timer(1.0 / v["tick_rate_hz"], self._tick)
        self.create_timer(1.0 / v["joint_state_rate_hz"], self._publish_joints)
        self.create_timer(1.0 / v["camera_rate_hz"], self._request_frame)
        self.create_timer(1.0 / v["status_rate_hz"], self.publish_status)
        self.pub_goal.publish(String(data=self.scene.goal_text()))
        self._publish_pose()
        self.get_logger().info(f"cobot sim ready: {self.scene.goal_text()}")

    # ------------------------------------------------------------------ physics and commands
    def _tick(self) -> None:
        self._check_cmd_timeout()
        due = int((time.monotonic() - self._t0) / self.scene.config.time_step) - self._steps
        if due > self._max_catchup_steps:
            self.overruns += 1
            self._steps += due - self._max_catchup_steps       # drop the time we cannot catch up
            due = self._max_catchup_steps
        if due > 0:
            self._publish_events(self.scene.step(due))
            self._steps += due
        self._publish_frame()

    def _on_reset(self, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        """`sim/reset`: the next task (see the module docstring); answers with its goal text."""
        self.resets += 1
        names = list(CUBES)
        target = names[(names.index(self.scene.config.target_object) + 1) % len(names)]
        self._publish_events(self.scene.reset(self._seed + self.resets, target))
        goal = self.scene.goal_text()
        self.pub_goal.publish(String(data=goal))
        self.publish_status()
        self.get_logger().info(f"scene reset {self.resets}: {goal}")
        response.success, response.message = True, goal
        return response

    def _on_heartbeat(self, _msg: Header) -> None:
        self._last_command = time.monotonic()

    def _check_cmd_timeout(self) -> None:
        """Stop the arm once the agent has been silent for cmd_timeout_s (then disarm until it
        speaks again)."""
        if (not self.cmd_timeout_s or self._last_command is None
                or time.monotonic() - self._last_command <= self.cmd_timeout_s):
            return
        self._last_command = None
        if not self.scene.busy:
            return
        self.cmd_timeouts += 1
        events = [Event(e.tag, e.tool, e.state, "command timeout: no command or heartbeat for "
                        f"{self.cmd_timeout_s} s" if e.state == "preempted" else e.detail)
                  for e in self.scene.execute("stop", {}, tag=0)]
        self.get_logger().warning(f"command timeout: agent silent for {self.cmd_timeout_s} s, arm stopped")
        self._publish_events(events)

    def _on_action(self, msg: ActionCommand) -> None:
        if self._last_command is not None:
            self._last_command = time.monotonic()
        try:
            events = self.scene.execute(msg.tool_name, msg.arguments_json, tag=msg.decision_id)
        except CommandRejected as e:
            events = [Event(msg.decision_id, msg.tool_name, "rejected", str(e))]
            self.get_logger().warning(f"rejected decision {msg.decision_id}: {e}")
        except Exception as e:   # a simulator bug must not take the robot down: reject and say so
            events = [Event(msg.decision_id, msg.tool_name, "rejected", f"internal error: {type(e).__name__}: {e}")]
            self.get_logger().error(f"decision {msg.decision_id} ({msg.tool_name}) failed in the simulator: {e!r}")
        self._publish_events(events)

    def _publish_events(self, events: list[Event]) -> None:
        for e in events:
            fb = ActionFeedback(decision_id=e.tag, tool_name=e.tool, state=e.state, detail=e.detail)
            fb.header.stamp = self.get_clock().now().to_msg()
            fb.header.frame_id = "base"
            self.pub_feedback.publish(fb)

    # ------------------------------------------------------------------ sensors
    def _publish_joints(self) -> None:
        names, pos, vel, eff = self.scene.joint_state()
        msg = JointState(name=names, position=pos.tolist(), velocity=vel.tolist(), effort=eff.tolist())
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.header.frame_id = "base"
        self.pub_joints.publish(msg)

    def _request_frame(self) -> None:
        """Camera timer: snapshot the scene now (the image's stamp) and hand it to the renderer;
        a frame is skipped while the previous one is still rendering."""
        if self.camera.busy:
            self.frames_skipped += 1
            return
        self._frame = (self.get_clock().now().to_msg(), time.perf_counter())
        self.camera.request(self.scene.snapshot())

    def _publish_frame(self) -> None:
        rgb = self.camera.poll()
        if rgb is None:
            return
        stamp, t = self._frame
        self.render_s.append(time.perf_counter() - t)
        h, w, _ = rgb.shape
        img = Image(height=h, width=w, encoding="rgb8", is_bigendian=0, step=w * 3, data=rgb.tobytes())
        img.header.stamp = stamp
        img.header.frame_id = "camera_optical"
        self.pub_image.publish(img)
        self.pub_info.publish(self._camera_info(stamp))

    def _camera_info(self, stamp) -> CameraInfo:
        cfg, k = self.scene.config, self.scene.camera_matrix
        info = CameraInfo(height=cfg.image_height, width=cfg.image_width, distortion_model="plumb_bob",
                          d=[0.0] * 5, k=k.flatten().tolist(), r=[1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0],
                          p=[k[0, 0], 0.0, k[0, 2], 0.0, 0.0, k[1, 1], k[1, 2], 0.0, 0.0, 0.0, 1.0, 0.0])
        info.header.stamp = stamp
        info.header.frame_id = "camera_optical"
        return info

    def _publish_pose(self) -> None:
        pos, quat = self.scene.camera_pose()
        msg = PoseStamped()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.header.frame_id = "base"
        msg.pose.position.x, msg.pose.position.y, msg.pose.position.z = map(float, pos)
        o = msg.pose.orientation
        o.x, o.y, o.z, o.w = quat
        self.pub_pose.publish(msg)

    def publish_status(self) -> dict:
        """Publish the scenario ground truth on `sim/scenario_status`; returns it as a dict."""
        status = self.scene.scenario_status()
        status["stamp"] = self.get_clock().now().nanoseconds * 1e-9
        status["overruns"] = self.overruns
        status["cmd_timeouts"] = self.cmd_timeouts
        status["resets"] = self.resets
        self.pub_status.publish(String(data=json.dumps(status)))
        return status

    def destroy_node(self) -> None:
        # SIGINT can arrive while the constructor still runs (a short launch on a busy machine), and
        # rclpy's shutdown then destroys a node that has no camera yet: close what was opened.
        for part in ("camera", "scene"):
            if hasattr(self, part):
                getattr(self, part).close()
        super().destroy_node()


def main(args: list[str] | None = None) -> None:
    """Console entry point `tokenspeed_cobot_sim`: spin the node until SIGINT/SIGTERM, then print
    the final scenario status and the camera/physics timing. With -h/--help before `--ros-args`:
    print the parameter file (defaults with their meaning) and exit without starting the node."""
    if help_requested(args):
        print("usage: tokenspeed_cobot_sim [--help] [--ros-args [-p NAME:=VALUE] [--params-file FILE] ...]\n\n"
              f"ROS parameters of tokenspeed_cobot_sim ({params_path(COBOT_SIM)}):\n{params_path(COBOT_SIM).read_text()}")
        return
    ros_spin.init(args)
    node = None
    try:
        try:
            node = CobotSimNode()
        except KeyboardInterrupt:   # Ctrl-C while the scene and the camera process start
            print("[tokenspeed_cobot_sim] interrupted during start-up", flush=True)
            return
        with ros_spin.Spinner(node) as spinner:
            spinner.spin()
    finally:
        if node is not None:
            renders = node.render_s
            mean_ms = 1e3 * sum(renders) / len(renders) if renders else float("nan")
            final = node.scene.scenario_status()
            print(f"[tokenspeed_cobot_sim] final status: {json.dumps(final)}\n"
                  f"[tokenspeed_cobot_sim] {len(renders)} camera renders, snapshot -> image mean {mean_ms:.1f} ms, "
                  f"{node.frames_skipped} frames skipped; {node.overruns} physics overruns", flush=True)
            node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
