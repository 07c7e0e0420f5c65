"""rosbag2 record and replay of a cobot run (MCAP storage, written and read with `rosbags`, a pure
Python rosbag2 library: no ros2 CLI needed).

- `Recorder`: records TOPICS as they go over DDS (serialized CDR, unchanged) into a rosbag2 folder
  that `ros2 bag play` / Foxglove read as well, under their fully qualified names and with the
  QoS profile of each topic (`offered_qos_profiles`: latched topics are transient local);
  `tokenspeed_demo --record DIR` uses it.
- `tokenspeed_replay BAG`: checks the bag first (every message decodes, receive times within
  MAX_SPAN_S of each other: a corrupt message or an impossible stamp is a clean error, exit 2),
  starts the agent (`tokenspeed_launch agent`, with --model / --set to try another model or
  setting; the recorded goal topic is listened to), replays the bag's sensor inputs (INPUTS)
  into it as if live (original timing and QoS, header stamps moved to now), records what it
  decides, and compares the replayed run with the recorded one decision by decision. The robot's
  feedback (FEEDBACK), from which the agent learns what its calls did (a pick done: the gripper
  holds the cube), answers the replayed agent's calls: the recorded feedback on a call goes to
  the replayed agent's earliest call with the same tool and arguments not yet answered (its
  decision id), as long after that call as it came after the recorded one; feedback on a
  recorded call the replayed agent does not make is left out (counted in the report).

Never imports `tokenspeed` internals; the agent is a separate process reached over DDS.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message
from rclpy.signals import SignalHandlerOptions

TOPICS = {          # recorded topic (relative) -> ROS type
    "joint_states": "sensor_msgs/msg/JointState",
    "camera/image_raw": "sensor_msgs/msg/Image",
    "camera/camera_info": "sensor_msgs/msg/CameraInfo",
    "camera/pose": "geometry_msgs/msg/PoseStamped",
    "goal": "std_msgs/msg/String",
    "sim/scenario_status": "std_msgs/msg/String",
    "sim/action_feedback": "tokenspeed_msgs/msg/ActionFeedback",
    "agent/action": "tokenspeed_msgs/msg/ActionCommand",
    "agent/deadline_status": "tokenspeed_msgs/msg/DeadlineStatus",
    "agent/observation": "tokenspeed_msgs/msg/Observation",
}
INPUTS = ("joint_states", "camera/image_raw", "camera/camera_info", "camera/pose", "goal", "sim/scenario_status")
FEEDBACK = "sim/action_feedback"
LATCHED_TOPICS = ("camera/pose", "goal", "sim/scenario_status")
LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
MAX_SPAN_S = 7 * 24 * 3600.0     # receive times further apart than this are impossible in one recording (s)


class BagError(RuntimeError):
    """A bag folder cannot be written or read; the message says which and why."""


def message_class(ros_type: str):
    """The rclpy message class of "pkg/msg/Name"."""
    pkg, _, name = ros_type.split("/")
    return getattr(importlib.import_module(f"{pkg}.msg"), name)


def typestore():
    """A rosbags typestore of ROS 2 Kilted plus tokenspeed_msgs (from its installed .msg files)."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    share = Path(sys.prefix) / "share" / "tokenspeed_msgs" / "msg"
    types = {}
    for path in sorted(share.glob("*.msg")):
        types.update(get_types_from_msg(path.read_text(), f"tokenspeed_msgs/msg/{path.stem}"))
    if not types:
        raise BagError(f"no tokenspeed_msgs .msg files in {share}: build the interfaces (make msgs)")
    store.register(types)
    return store


def _qos(topic: str) -> QoSProfile:
    """The profile a topic is recorded and replayed with (relative name)."""
    return LATCHED if topic in LATCHED_TOPICS else QoSProfile(depth=100)


def bag_qos(profile: QoSProfile):
    """rclpy QoSProfile -> rosbags Qos (rosbag2's offered_qos_profiles entry)."""
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

    def span(d) -> QosTime:
        sec, nsec = divmod(d.nanoseconds, 1_000_000_000)
        return QosTime(sec, nsec)
    return Qos(QosHistory(profile.history.value), profile.depth, QosReliability(profile.reliability.value),
               QosDurability(profile.durability.value), span(profile.deadline), span(profile.lifespan),
               QosLiveliness(profile.liveliness.value), span(profile.liveliness_lease_duration), False)


def rclpy_qos(qos) -> QoSProfile:
    """rosbags Qos -> rclpy QoSProfile (history, depth, reliability, durability)."""
    from rclpy.qos import HistoryPolicy

    return QoSProfile(history=HistoryPolicy(qos.history.value), depth=max(qos.depth, 1),
                      reliability=ReliabilityPolicy(qos.reliability.value),
                      durability=DurabilityPolicy(qos.durability.value))


class Recorder:
    """Records TOPICS into a new rosbag2 folder `path` (MCAP),
    from an rclpy node of its own context spun in a background thread. `close()` ends the bag;
    `counts` says how many messages each topic had. Raises BagError when `path` exists."""

    def __init__(self, path: Path):
        from rosbags.rosbag2 import StoragePlugin, Writer

        if path.exists():
            raise BagError(f"{path} exists; rosbag2 writes a new folder")
        self.path = path
        self.counts: Counter[str] = Counter()
        self._writer = Writer(path, version=9, storage_plugin=StoragePlugin.MCAP)
        self._writer.open()
        store = typestore()
        self._ctx = rclpy.Context()
        rclpy.init(context=self._ctx, signal_handler_options=SignalHandlerOptions.NO)
        self._node = rclpy.create_node("tokenspeed_bag_recorder", context=self._ctx)
        self._connections = {t: self._writer.add_connection(self._node.resolve_topic_name(t), ros_type, typestore=store,
                                                            offered_qos_profiles=[bag_qos(_qos(t))])
                             for t, ros_type in TOPICS.items()}
        for topic, ros_type in TOPICS.items():
            self._node.create_subscription(message_class(ros_type), topic,
                                           lambda raw, t=topic: self._write(t, raw), _qos(topic), raw=True)
        self._executor = SingleThreadedExecutor(context=self._ctx)
        self._executor.add_node(self._node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="bag-recorder", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set():
            self._executor.spin_once(timeout_sec=0.05)

    def _write(self, topic: str, raw: bytes) -> None:
        self._writer.write(self._connections[topic], time.time_ns(), raw)
        self.counts[topic] += 1

    def close(self) -> dict[str, int]:
        """Stop recording and finish the bag; returns the message count per topic."""
        self._stop.set()
        self._thread.join(5.0)
        self._executor.shutdown()
        self._node.destroy_node()
        self._ctx.try_shutdown()
        self._writer.close()
        return dict(self.counts)


def read_bag(path: Path) -> list[tuple[int, str, bytes]]:
    """(receive time ns, topic, CDR bytes) of every message of the bag, in time order; topics
    relative to the root namespace ("/joint_states" -> "joint_states", as TOPICS names them).
    Raises BagError when it cannot be read."""
    from rosbags.rosbag2 import Reader

    try:
        with Reader(path) as reader:
            return [(t, conn.topic.lstrip("/"), bytes(raw)) for conn, t, raw in reader.messages()]
    except Exception as e:     # rosbags raises its own error types for a missing or broken bag
        raise BagError(f"cannot read bag {path}: {e}") from e


def offered_qos(path: Path) -> dict[str, QoSProfile]:
    """Relative topic -> the QoS profile the bag recorded for it (topics without one are left out).
    Raises BagError when the bag cannot be read."""
    from rosbags.rosbag2 import Reader

    try:
        with Reader(path) as reader:
            return {c.topic.lstrip("/"): rclpy_qos(c.ext.offered_qos_profiles[0])
                    for c in reader.connections if c.ext.offered_qos_profiles}
    except Exception as e:
        raise BagError(f"cannot read bag {path}: {e}") from e


def check_messages(messages: list[tuple[int, str, bytes]]) -> None:
    """Refuse a bag that cannot be replayed: a message of a known topic that does not decode,
    or receive times more than MAX_SPAN_S apart (a stamp no recording can have). Raises BagError
    naming the message (index, topic, receive time in ns)."""
    if messages:
        first = min(t for t, _, _ in messages)
        for i, (t, topic, _) in enumerate(messages):
            if (t - first) * 1e-9 > MAX_SPAN_S:
                raise BagError(f"impossible receive time: message {i} on {topic} at {t} ns is "
                               f"{(t - first) * 1e-9:.3g} s after the first (at most {MAX_SPAN_S:g} s)")
    for i, (t, topic, raw) in enumerate(messages):
        if topic in TOPICS:
            try:
                deserialize_message(raw, message_class(TOPICS[topic]))
            except Exception as e:  # noqa: BLE001 - rclpy raises RMWError (and others) for bad CDR
                raise BagError(f"corrupt message {i} on {topic} at {t} ns: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from None


def compare(recorded: list, replayed: list, recorded_obs: list, replayed_obs: list) -> dict:
    """Recorded vs replayed model decisions (ActionCommands) and camera observations
    (Observation echoes): counts, tools in order, latency medians (s)."""
    def model(cmds):
        return [c for c in cmds if c.source == "model"]

    rec, rep = model(recorded), model(replayed)
    pairs = list(zip(rec, rep))
    cams_rec = {o.text for o in recorded_obs if o.source in ("camera", "state")}
    cams_rep = {o.text for o in replayed_obs if o.source in ("camera", "state")}
    objects = {t.split(";")[0] for t in cams_rec}
    return {
        "recorded": {"decisions": len(recorded), "model": len(rec), "tools": dict(Counter(c.tool_name for c in rec)),
                     "latency_p50_s": float(np.median([c.decision_latency_s for c in rec])) if rec else None},
        "replayed": {"decisions": len(replayed), "model": len(rep), "tools": dict(Counter(c.tool_name for c in rep)),
                     "latency_p50_s": float(np.median([c.decision_latency_s for c in rep])) if rep else None},
        "same_tool_in_order": sum(a.tool_name == b.tool_name for a, b in pairs),
        "same_call_in_order": sum((a.tool_name, a.arguments_json) == (b.tool_name, b.arguments_json) for a, b in pairs),
        "compared": len(pairs),
        "observed_scenes_recorded": len(objects),
        "observed_scenes_replayed_seen_in_recording": sum(t.split(";")[0] in objects for t in cams_rep),
        "observed_scenes_replayed": len(cams_rep),
    }


class _Replayer:
    """Publishes INPUTS from a bag as if live, answers the agent's calls with the bag's FEEDBACK
    (see the module docstring) and records the agent's outputs."""

    def __init__(self, messages: list[tuple[int, str, bytes]], qos: dict[str, QoSProfile]):
        self._ctx = rclpy.Context()
        rclpy.init(context=self._ctx, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node("tokenspeed_replay", context=self._ctx)
        self.executor = SingleThreadedExecutor(context=self._ctx)
        self.executor.add_node(self.node)
        self.messages = [(t, topic, raw) for t, topic, raw in messages if topic in INPUTS]
        self._types = {topic: message_class(TOPICS[topic]) for topic in (*INPUTS, FEEDBACK)}
        self._pubs = {topic: self.node.create_publisher(self._types[topic], topic, qos.get(topic, _qos(topic)))
                      for topic in self._types}
        calls = {}      # recorded decision id -> (receive time ns, (tool, arguments))
        for t, topic, raw in messages:
            if topic == "agent/action":
                c = deserialize_message(raw, message_class(TOPICS[topic]))
                calls[c.decision_id] = (t, (c.tool_name, c.arguments_json))
        # (recorded decision id, its call, seconds after the call, feedback) not published yet
        self.feedback_waiting = [(fb.decision_id, calls[fb.decision_id][1], (t - calls[fb.decision_id][0]) * 1e-9, fb)
                                 for t, topic, raw in messages if topic == FEEDBACK
                                 for fb in [deserialize_message(raw, self._types[FEEDBACK])] if fb.decision_id in calls]
        self.feedback_replayed = 0
        self._onto: dict[int, int] = {}       # recorded decision id -> the replayed agent's same call
        self._seen: dict[int, float] = {}     # replayed decision id -> when its call arrived (monotonic s)
        self.actions, self.observations = [], []
        self.node.create_subscription(message_class(TOPICS["agent/action"]), "agent/action", self._on_action, 100)
        self.node.create_subscription(message_class(TOPICS["agent/observation"]), "agent/observation",
                                      self.observations.append, 100)

    def _on_action(self, msg) -> None:
        self.actions.append(msg)
        self._seen.setdefault(msg.decision_id, time.monotonic())

    def spin_for(self, seconds: float, until=None) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if until is not None and until():
                return True
            self.executor.spin_once(timeout_sec=0.01)
            self._publish_feedback()
        return until is not None and until()

    def play(self, stop) -> int:
        """Publish the inputs at their recorded pace, stamps moved to now; returns how many."""
        if not self.messages:
            return 0
        t0_bag, t0 = self.messages[0][0], time.monotonic()
        shift_ns = self.node.get_clock().now().nanoseconds - t0_bag
        sent = 0
        for t, topic, raw in self.messages:
            if stop():
                break
            self.spin_for(max(0.0, (t - t0_bag) * 1e-9 - (time.monotonic() - t0)))
            msg = deserialize_message(raw, self._types[topic])
            header = getattr(msg, "header", None)
            if header is not None and (header.stamp.sec or header.stamp.nanosec):
                ns = header.stamp.sec * 1_000_000_000 + header.stamp.nanosec + shift_ns
                header.stamp.sec, header.stamp.nanosec = divmod(ns, 1_000_000_000)
            self._pubs[topic].publish(msg)
            sent += 1
        return sent

    def _publish_feedback(self) -> None:
        """Publish the recorded feedback that is due: onto the replayed agent's call with the
        recorded call's tool and arguments (the earliest not answered by other recorded feedback),
        as long after it as the recording had it after the recorded call, stamped now."""
        now, waiting, self.feedback_waiting = time.monotonic(), self.feedback_waiting, []
        for item in waiting:
            recorded_id, call, after_s, msg = item
            replayed_id = self._onto.get(recorded_id)
            if replayed_id is None:
                taken = set(self._onto.values())
                replayed_id = next((a.decision_id for a in self.actions
                                    if a.decision_id not in taken and (a.tool_name, a.arguments_json) == call), None)
                if replayed_id is not None:
                    self._onto[recorded_id] = replayed_id
            if replayed_id is None or now < self._seen[replayed_id] + after_s:
                self.feedback_waiting.append(item)
                continue
            msg.decision_id = replayed_id
            msg.header.stamp = self.node.get_clock().now().to_msg()
            self._pubs[FEEDBACK].publish(msg)
            self.feedback_replayed += 1

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self._ctx.try_shutdown()


def replay(bag: Path, out_dir: Path, *, model: str = "", overrides: list[str] = (), ready_timeout_s: float = 300.0,
           tail_s: float = 3.0) -> dict:
    """Re-decide a recorded run: start the agent, wait for it to be up, play the bag's inputs,
    compare (see module docstring). Writes replay.json and launch.log into out_dir; returns the
    comparison. Raises BagError for an unreadable bag or an agent that does not come up."""
    messages = read_bag(bag)
    check_messages(messages)
    by_topic = {}
    for _, topic, raw in messages:
        by_topic.setdefault(topic, []).append(raw)
    recorded = [deserialize_message(r, message_class(TOPICS["agent/action"])) for r in by_topic.get("agent/action", [])]
    recorded_obs = [deserialize_message(r, message_class(TOPICS["agent/observation"]))
                    for r in by_topic.get("agent/observation", [])]
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tokenspeed_ros.launcher", "agent"]
    cmd += ["--model", model] if model else []
    for o in ["tokenspeed_agent.goal_topic=goal", *overrides]:     # the recorded goal reaches the agent
        cmd += ["--set", o]
    replayer = _Replayer(messages, offered_qos(bag))
    with open(out_dir / "launch.log", "w") as log:
        launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            up = replayer.spin_for(ready_timeout_s, until=lambda: launcher.poll() is not None or (
                replayer.node.count_subscribers("joint_states") > 0 and "activated" in (out_dir / "launch.log").read_text()))
            if not up or launcher.poll() is not None:
                raise BagError(f"the agent did not come up (see {out_dir / 'launch.log'})")
            sent = replayer.play(stop=lambda: launcher.poll() is not None)
            replayer.spin_for(tail_s)
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
            replayer.close()
    result = {"bag": str(bag), "inputs_replayed": sent, "feedback_replayed": replayer.feedback_replayed,
              "feedback_left_out": len(replayer.feedback_waiting), "model": model, "overrides": list(overrides),
              **compare(recorded, replayer.actions, recorded_obs, replayer.observations)}
    (out_dir / "replay.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_replay`."""
    ap = argparse.ArgumentParser(prog="tokenspeed_replay", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("bag", type=Path, help="rosbag2 folder recorded with tokenspeed_demo --record")
    ap.add_argument("--model", default="", help="model of the replayed agent ('' = its parameter file's)")
    ap.add_argument("--set", action="append", default=[], metavar="NODE.PARAM=VALUE",
                    help="agent parameter override passed to tokenspeed_launch (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("out/replay"), help="folder for replay.json and launch.log")
    args = ap.parse_args(argv)
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    try:
        result = replay(args.bag, args.out, model=args.model, overrides=args.set)
    except BagError as e:
        print(f"tokenspeed_replay: {e}", file=sys.stderr)
        return 2
    rec, rep = result["recorded"], result["replayed"]

    def p50(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:.0f} ms"
    print(f"replayed {result['inputs_replayed']} inputs and {result['feedback_replayed']} robot feedback messages "
          f"from {args.bag} ({result['feedback_left_out']} on calls the replayed agent did not make left out)\n"
          f"recorded: {rec['model']} model decisions {rec['tools']}, latency p50 {p50(rec['latency_p50_s'])}\n"
          f"replayed: {rep['model']} model decisions {rep['tools']}, latency p50 {p50(rep['latency_p50_s'])}\n"
          f"same tool in order: {result['same_tool_in_order']}/{result['compared']}, same call: "
          f"{result['same_call_in_order']}/{result['compared']}\nreport: {args.out / 'replay.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
