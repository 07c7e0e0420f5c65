"""Input checks and encoders: ROS sensor messages -> validated arrays and compact text.

Every check raises `BadInput(kind, detail)`; the node counts each kind in `InputHealth`, logs
the first occurrence of each kind, drops the message and keeps running. `SensorGate` knows when
each sensor last gave a valid reading and which is the newest (the stamp a decision answers).
"""
from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np

ENCODINGS = {"rgb8": False, "bgr8": True}   # accepted image encodings -> channels need reversing
MAX_IMAGE_SIDE = 8192                         # pixels
# Perception costs ~40 ns per pixel on one core: an image above this many pixels (1920 x 1080 and
# a little more) is refused ("image_too_large") instead of holding the executor for seconds.
MAX_IMAGE_PIXELS = 1 << 21
MAX_JOINTS = 64                               # positions per JointState
MAX_JOINT_ABS = 1e3                           # |position| above this (rad or m) is not a reading


class BadInput(ValueError):
    """A message the node cannot use. `kind` is a short counter name, e.g. "joint_nonfinite"."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class InputHealth:
    """Counts bad input per kind and logs each kind once (first occurrence) at WARN.

    `logger` is an rclpy logger. Not thread-safe: call from the ROS executor thread.
    """

    def __init__(self, logger):
        self._logger = logger
        self.counts: Counter[str] = Counter()

    def report(self, err: BadInput, topic: str) -> None:
        """Count `err` and log it if it is the first of its kind."""
        self.counts[err.kind] += 1
        if self.counts[err.kind] == 1:
            self._logger.warning(f"bad input on {topic}: {err} (counted in /diagnostics; "
                                 f"further '{err.kind}' reports are not logged)")


class SensorGate:
    """The sensors a decision needs (`sources`), when each last gave a valid reading, and the
    newest reading's stamp. Times `now_s` are seconds of the node's clock; stamps are the node's
    rclpy Time (only compared and kept here). Not thread-safe: the executor thread.

    `latest_stamp`: the newest valid stamp of a reading that feeds the context (a decision answers
    it; None before the first); `latest_times`: (received, perceived) wall-clock seconds of its message.
    """

    def __init__(self, health: InputHealth, sources: tuple[str, ...], started_s: float):
        self.health = health
        self.sources = sources
        self._started_s = started_s
        self.last_rx: dict[str, float] = {}     # source -> node time of its last valid reading
        self.latest_stamp = None
        self.latest_times = (0.0, 0.0)

    def received(self, source: str, stamp, now_s: float, received: float, feeds: bool = True) -> None:
        """A valid reading stamped `stamp`, whose message arrived at `received` (wall clock, s),
        is processed (perception done); feeds: it enters the context (else it only keeps its
        source fresh, e.g. joint states that are not in the context)."""
        self.last_rx[source] = now_s
        if feeds and (self.latest_stamp is None or stamp > self.latest_stamp):
            self.latest_stamp = stamp
            self.latest_times = (received, time.time())

    def newest(self, stamp=None):
        """The newer of `stamp` (e.g. the robot's feedback a decision answers; None: none) and
        `latest_stamp`; None when neither is known."""
        return stamp if self.latest_stamp is None or (stamp is not None and stamp > self.latest_stamp) \
            else self.latest_stamp

    def missing(self, now_s: float, stale_after_s: float) -> list[str]:
        """The sources with no valid reading within `stale_after_s` seconds (each silent one is
        counted in `health` as "missing_<source>")."""
        missing = []
        for source in self.sources:
            last = self.last_rx.get(source)
            silent_s = now_s - (self._started_s if last is None else last)
            if silent_s > stale_after_s:
                self.health.report(BadInput(f"missing_{source}", f"no valid data for {silent_s:.1f} s"), source)
            if last is None or silent_s > stale_after_s:
                missing.append(source)
        return missing


def stamp_seconds(stamp) -> float:
    """builtin_interfaces/Time -> float seconds."""
    return stamp.sec + stamp.nanosec * 1e-9


def check_stamp(stamp, now_s: float, max_future_s: float, max_age_s: float) -> float:
    """Validate a header stamp against the node clock `now_s` (seconds); return it in seconds.

    Raises BadInput "stamp_missing" (zero stamp), "stamp_future" or "stamp_old".
    """
    t = stamp_seconds(stamp)
    if t == 0.0:
        raise BadInput("stamp_missing", "header stamp is zero")
    if t > now_s + max_future_s:
        raise BadInput("stamp_future", f"stamp {t - now_s:+.3f} s ahead of the node clock")
    if t < now_s - max_age_s:
        raise BadInput("stamp_old", f"stamp {now_s - t:.3f} s old (limit {max_age_s} s)")
    return t


def joint_state_text(msg) -> str:
    """sensor_msgs/JointState -> compact text, e.g. "joints q=[0.00,-0.79,...] (rad)".

    Positions are rounded to 0.01 rad so that jitter does not make a new observation.
    Raises BadInput "joint_empty", "joint_too_many" (more than MAX_JOINTS), "joint_size_mismatch",
    "joint_nonfinite" or "joint_out_of_range" (|position| > MAX_JOINT_ABS).
    """
    q = list(msg.position)
    if not q:
        raise BadInput("joint_empty", "no positions")
    if len(q) > MAX_JOINTS:
        raise BadInput("joint_too_many", f"{len(q)} positions (at most {MAX_JOINTS})")
    if msg.name and len(msg.name) != len(q):
        raise BadInput("joint_size_mismatch", f"{len(msg.name)} names but {len(q)} positions")
    if not all(math.isfinite(v) for v in q):
        raise BadInput("joint_nonfinite", f"non-finite position in {q}")
    if max(abs(v) for v in q) > MAX_JOINT_ABS:
        raise BadInput("joint_out_of_range", f"|position| {max(abs(v) for v in q):.3g} > {MAX_JOINT_ABS}")
    return "joints q=[" + ",".join(f"{v:.2f}" for v in q) + "] (rad)"


def image_to_rgb(msg) -> np.ndarray:
    """sensor_msgs/Image (rgb8 or bgr8) -> uint8 array [height, width, 3], RGB, a copy.

    Raises BadInput "image_encoding" (anything else), "image_size" (zero/huge sides, step too
    small), "image_too_large" (more than MAX_IMAGE_PIXELS pixels) or "image_corrupt" (data
    length does not match height * step).
    """
    if msg.encoding not in ENCODINGS:
        raise BadInput("image_encoding", f"encoding {msg.encoding!r} is not one of {sorted(ENCODINGS)}")
    h, w, step = msg.height, msg.width, msg.step
    if not (0 < h <= MAX_IMAGE_SIDE and 0 < w <= MAX_IMAGE_SIDE) or step < 3 * w:
        raise BadInput("image_size", f"{w}x{h} with step {step}")
    if h * w > MAX_IMAGE_PIXELS:
        raise BadInput("image_too_large", f"{w}x{h} = {w * h} pixels (at most {MAX_IMAGE_PIXELS}: "
                                          "downscale it in the camera driver)")
    if len(msg.data) != h * step:
        raise BadInput("image_corrupt", f"{len(msg.data)} bytes, expected {h} * {step}")
    rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(h, step)
    img = rows[:, : 3 * w].reshape(h, w, 3)
    return np.ascontiguousarray(img[:, :, ::-1] if ENCODINGS[msg.encoding] else img)
