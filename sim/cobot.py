"""Cobot scene: a Franka Panda on a table with three coloured cubes, a target zone and a fixed
camera, simulated headless with PyBullet.

Why PyBullet: its PyPI wheel (3.2.7, cp311) bundles a real Franka Panda model
(`pybullet_data/franka_panda/panda.urdf`, with meshes), runs headless in DIRECT mode, and renders
camera images on the CPU with TinyRenderer, so no OpenGL or GPU is needed. MuJoCo's PyPI packages
ship no Panda model (mujoco-menagerie downloads it at run time, which these machines cannot do).

Frames and units: the world frame is the robot base frame (origin at the bottom of `panda_link0`,
x forward, y left, z up); metres, radians, seconds. The table top is the plane z = 0.

Grasping is by friction only: `pick` closes both fingers on the cube (position control with the
URDF's 20 N finger force limit, friction 1.5 on the fingers and 1.0 on the cubes) and checks that
both fingers touch it; no constraint glues the cube to the hand, so a cube can slip or drop as it
would on a real gripper. A cube is "held" while both fingers touch it.

Tools are the ones in `tokenspeed/data/tools/robot_tools.json` (OpenAI function format). Arguments are
validated against the tool's JSON schema; invalid commands raise `CommandRejected` and never
change the robot's motion.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace

import jsonschema
import numpy as np
import pybullet as p
import pybullet_data

from tokenspeed.tools import TOOLS_DIR, load_tools

CUBES = {"red_cube": (0.85, 0.1, 0.1), "green_cube": (0.1, 0.7, 0.15), "blue_cube": (0.1, 0.2, 0.85)}
"""Cube names and RGB colours (0..1)."""
CUBE_HALF = 0.025            # cube half extent, metres
TARGET_HALF = 0.05           # target zone half extent, metres
TARGET_RGB = (0.95, 0.85, 0.1)
TABLE_RGB = (0.7, 0.7, 0.7)
WORKSPACE_X = (0.35, 0.65)   # where cubes and the target are placed, metres
WORKSPACE_Y = (-0.25, 0.25)
MIN_SEPARATION = 0.11        # between any two of cubes and target centre, metres

ARM_JOINTS = list(range(7))  # panda_joint1..7
FINGER_JOINTS = [9, 10]      # panda_finger_joint1/2, each 0..0.04 m
EE_LINK = 11                 # panda_grasptarget: between the fingertips
HOME = [0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785]
FINGER_OPEN = 0.04           # per finger, metres
APPROACH_Z = 0.15            # gripper height above the table for approach/retreat, metres
LIFT_Z = 0.20                # gripper height after a pick, metres
EE_SPEED = 0.30              # Cartesian speed of the commanded gripper point, m/s
REACH_TOL = 0.01             # a move is done when the gripper is this close, metres
SETTLE_S = 1.0               # extra time a move may take to converge after its path ends, seconds
GRIPPER_S = 0.4              # time given to open/close the fingers, seconds

DEFAULT_TOOLS = TOOLS_DIR / "robot_tools.json"      # the engine's robot tool set (tokenspeed.tools: no torch)


class CommandRejected(ValueError):
    """A robot command that the simulator refuses to execute; the message says why."""


@dataclass
class SceneConfig:
    """Scene parameters. Lengths in metres, angles in degrees, times in seconds, sizes in pixels."""

    seed: int = 0
    target_object: str = "red_cube"
    success_tolerance: float = 0.05      # cube centre to target centre, metres (xy)
    time_step: float = 1.0 / 240.0       # physics step, seconds
    image_width: int = 320
    image_height: int = 240
    fov_deg: float = 60.0                # vertical field of view
    camera_eye: tuple[float, float, float] = (1.10, 0.0, 0.70)
    camera_target: tuple[float, float, float] = (0.45, 0.0, 0.0)
    tools_file: str = str(DEFAULT_TOOLS)


@dataclass
class Event:
    """Something the robot did with a command: state is "applied", "done" or "preempted"."""

    tag: int          # the caller's command tag (ActionCommand.decision_id)
    tool: str
    state: str
    detail: str


@dataclass
class _Motion:
    """A queued command: its segments are executed in order by `CobotScene.step`."""

    tool: str
    arguments: dict
    tags: list[int]
    segments: list[tuple]
    seg_t: float = 0.0                   # seconds spent in the current segment
    path: tuple[np.ndarray, np.ndarray] | None = None   # (start, goal) of the current Cartesian segment
    log: list[str] = field(default_factory=list)


def _quat_from_matrix(r: np.ndarray) -> tuple[float, float, float, float]:
    """Rotation matrix [3, 3] -> unit quaternion (x, y, z, w)."""
    w = math.sqrt(max(0.0, 1.0 + r[0, 0] + r[1, 1] + r[2, 2])) / 2
    x = math.copysign(math.sqrt(max(0.0, 1.0 + r[0, 0] - r[1, 1] - r[2, 2])) / 2, r[2, 1] - r[1, 2])
    y = math.copysign(math.sqrt(max(0.0, 1.0 - r[0, 0] + r[1, 1] - r[2, 2])) / 2, r[0, 2] - r[2, 0])
    z = math.copysign(math.sqrt(max(0.0, 1.0 - r[0, 0] - r[1, 1] + r[2, 2])) / 2, r[1, 0] - r[0, 1])
    return (x, y, z, w)


class CobotScene:
    """One headless PyBullet world: Panda, table, three cubes, a target zone and a camera.

    Not thread-safe: call it from one thread. Each instance owns its own PyBullet client, so
    several scenes can live in one process. Use as a context manager or call `close()`.
    """

    def __init__(self, config: SceneConfig | None = None):
        self.config = cfg = config or SceneConfig()
        if cfg.target_object not in CUBES:
            raise ValueError(f"target_object {cfg.target_object!r} is not one of {sorted(CUBES)}")
        if cfg.image_width < 16 or cfg.image_height < 16:
            raise ValueError(f"image size {cfg.image_width}x{cfg.image_height} too small (min 16x16)")
        self.tools = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
                      for t in load_tools(cfg.tools_file)}     # name -> arguments' JSON schema
        self._validators = {n: jsonschema.Draft202012Validator(s) for n, s in self.tools.items()}
        self._c = p.connect(p.DIRECT)
        self.sim_time = 0.0
        self._steps = 0
        self._motion: _Motion | None = None
        self._yaw = 0.0                       # commanded gripper yaw, radians
        self.accepted = self.rejected = 0
        self._build(np.random.default_rng(cfg.seed))
        self._setup_camera()

    # ------------------------------------------------------------------ scene construction
    def _build(self, rng: np.random.Generator) -> None:
        c = self._c
        p.setAdditionalSearchPath(pybullet_data.getDataPath(), physicsClientId=c)
        p.setGravity(0, 0, -9.81, physicsClientId=c)
        p.setTimeStep(self.config.time_step, physicsClientId=c)
        top = p.createCollisionShape(p.GEOM_BOX, halfExtents=[0.75, 0.5, 0.025], physicsClientId=c)
        top_vis = p.createVisualShape(p.GEOM_BOX, halfExtents=[0.75, 0.5, 0.025],
                                      rgbaColor=[*TABLE_RGB, 1], physicsClientId=c)
        self.table = p.createMultiBody(0, top, top_vis, basePosition=[0.45, 0, -0.025], physicsClientId=c)
        self.robot = p.loadURDF("franka_panda/panda.urdf", [0, 0, 0], useFixedBase=True,
                                flags=p.URDF_USE_INERTIA_FROM_FILE, physicsClientId=c)
        for j, q in zip(ARM_JOINTS, HOME):
            p.resetJointState(self.robot, j, q, physicsClientId=c)
        for j in FINGER_JOINTS:
            p.resetJointState(self.robot, j, FINGER_OPEN, physicsClientId=c)
            p.changeDynamics(self.robot, j, lateralFriction=1.5, physicsClientId=c)
        info = [p.getJointInfo(self.robot, j, physicsClientId=c) for j in ARM_JOINTS]
        self._lower = [i[8] for i in info]
        self._upper = [i[9] for i in info]
        self._ranges = [u - l for l, u in zip(self._lower, self._upper)]
        self._max_force = [i[10] for i in info]
        self.joint_names = [p.getJointInfo(self.robot, j, physicsClientId=c)[1].decode()
                            for j in ARM_JOINTS + FINGER_JOINTS]

        vis = p.createVisualShape(p.GEOM_BOX, halfExtents=[TARGET_HALF, TARGET_HALF, 0.0005],
                                  rgbaColor=[*TARGET_RGB, 1], physicsClientId=c)
        self.target = p.createMultiBody(0, -1, vis, physicsClientId=c)
        box = p.createCollisionShape(p.GEOM_BOX, halfExtents=[CUBE_HALF] * 3, physicsClientId=c)
        self.cubes: dict[str, int] = {}
        for name, rgb in CUBES.items():
            vis = p.createVisualShape(p.GEOM_BOX, halfExtents=[CUBE_HALF] * 3, rgbaColor=[*rgb, 1],
                                      physicsClientId=c)
            body = p.createMultiBody(0.1, box, vis, physicsClientId=c)
            p.changeDynamics(body, -1, lateralFriction=1.0, physicsClientId=c)
            self.cubes[name] = body
        self._place_objects(rng)
        self._hold_joints()

    def _place_objects(self, rng: np.random.Generator) -> None:
        """Cubes (random yaw) and the target zone at random, well-separated spots, at rest."""
        c = self._c
        centres = self._sample_positions(rng, len(CUBES) + 1)
        self.target_xy = centres[-1]
        p.resetBasePositionAndOrientation(self.target, [*self.target_xy, 0.0006], [0, 0, 0, 1], physicsClientId=c)
        for body, xy in zip(self.cubes.values(), centres):
            yaw = float(rng.uniform(-math.pi / 4, math.pi / 4))
            p.resetBasePositionAndOrientation(body, [*xy, CUBE_HALF], p.getQuaternionFromEuler([0, 0, yaw]),
                                              physicsClientId=c)
            p.resetBaseVelocity(body, [0, 0, 0], [0, 0, 0], physicsClientId=c)

    def reset(self, seed: int, target_object: str) -> list[Event]:
        """Start a new task in the same world: the arm back home with open fingers, the cubes and
        the target zone placed anew from `seed`, the goal now for `target_object`. The command
        executing (if any) is "preempted" (returned events); counters and sim time go on.
        Raises ValueError for a target_object not in CUBES (nothing changes)."""
        if target_object not in CUBES:
            raise ValueError(f"target_object {target_object!r} is not one of {sorted(CUBES)}")
        events = [] if self._motion is None else [
            Event(t, self._motion.tool, "preempted", "scene reset") for t in self._motion.tags]
        self._motion = None
        self.config = replace(self.config, seed=seed, target_object=target_object)
        c = self._c
        for j, q in zip(ARM_JOINTS, HOME):
            p.resetJointState(self.robot, j, q, 0.0, physicsClientId=c)
        for j in FINGER_JOINTS:
            p.resetJointState(self.robot, j, FINGER_OPEN, 0.0, physicsClientId=c)
            p.setJointMotorControl2(self.robot, j, p.POSITION_CONTROL, targetPosition=FINGER_OPEN, force=20,
                                    physicsClientId=c)
        self._yaw = 0.0
        self._place_objects(np.random.default_rng(seed))
        self._hold_joints()
        p.performCollisionDetection(physicsClientId=c)     # contacts (what is "held") of the new layout
        return events

    @staticmethod
    def _sample_positions(rng: np.random.Generator, n: int) -> list[tuple[float, float]]:
        """n points in the workspace, pairwise at least MIN_SEPARATION apart (rejection sampling)."""
        pts: list[tuple[float, float]] = []
        while len(pts) < n:
            q = (float(rng.uniform(*WORKSPACE_X)), float(rng.uniform(*WORKSPACE_Y)))
            if all(math.dist(q, o) >= MIN_SEPARATION for o in pts):
                pts.append(q)
        return pts

    def _setup_camera(self) -> None:
        cfg = self.config
        w, h = cfg.image_width, cfg.image_height
        self._view = p.computeViewMatrix(cfg.camera_eye, cfg.camera_target, [0, 0, 1], physicsClientId=self._c)
        self._proj = p.computeProjectionMatrixFOV(cfg.fov_deg, w / h, 0.05, 4.0, physicsClientId=self._c)
        f = (h / 2) / math.tan(math.radians(cfg.fov_deg) / 2)
        self.camera_matrix = np.array([[f, 0, w / 2 - 0.5], [0, f, h / 2 - 0.5], [0, 0, 1]])
        eye, tgt = np.array(cfg.camera_eye, float), np.array(cfg.camera_target, float)
        z = (tgt - eye) / np.linalg.norm(tgt - eye)          # optical axis (forward)
        x = np.cross(z, [0, 0, 1.0])
        if np.linalg.norm(x) < 1e-6:
            raise ValueError("camera must not look straight up or down (optical axis parallel to z)")
        x /= np.linalg.norm(x)                                # image right
        y = np.cross(z, x)                                    # image down
        self.camera_rotation = np.stack([x, y, z], axis=1)    # columns: optical axes in base frame
        self.camera_position = eye

    # ------------------------------------------------------------------ observation
    def joint_state(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """Arm and finger joints: (names, positions [9] rad/m, velocities [9] rad/s or m/s,
        efforts [9] N·m or N), float64."""
        states = p.getJointStates(self.robot, ARM_JOINTS + FINGER_JOINTS, physicsClientId=self._c)
        pos, vel, _, eff = (np.array(v, dtype=np.float64) for v in zip(*states))
        return self.joint_names, pos, vel, eff

    def render(self) -> np.ndarray:
        """Camera image rendered with TinyRenderer (CPU): uint8 array [height, width, 3], RGB,
        row 0 at the top."""
        cfg = self.config
        _, _, rgba, _, _ = p.getCameraImage(cfg.image_width, cfg.image_height, self._view, self._proj,
                                            renderer=p.ER_TINY_RENDERER, shadow=0,
                                            flags=p.ER_NO_SEGMENTATION_MASK, physicsClientId=self._c)
        return np.asarray(rgba, dtype=np.uint8).reshape(cfg.image_height, cfg.image_width, 4)[:, :, :3]

    def camera_pose(self) -> tuple[np.ndarray, tuple[float, float, float, float]]:
        """Pose of the camera's optical frame (REP 103: x right, y down, z forward) in the base
        frame: (position [3] metres, quaternion (x, y, z, w)). A base-frame point P maps to the
        camera frame as R.T @ (P - position); pixel = K @ that / depth."""
        return self.camera_position.copy(), _quat_from_matrix(self.camera_rotation)

    def snapshot(self) -> dict:
        """Everything a camera sees, as plain data: robot joint positions (rad / m), cube poses
        (position [3] metres, quaternion xyzw) and the target zone's centre (x, y metres).
        `restore()` puts a scene of the same tool file and image settings there."""
        joints = [s[0] for s in p.getJointStates(self.robot, range(p.getNumJoints(self.robot, physicsClientId=self._c)),
                                                 physicsClientId=self._c)]
        cubes = {n: p.getBasePositionAndOrientation(b, physicsClientId=self._c) for n, b in self.cubes.items()}
        return {"joints": joints, "cubes": cubes, "target_xy": tuple(self.target_xy)}

    def restore(self, snapshot: dict) -> None:
        """Set joint positions and cube poses from `snapshot()` output (no dynamics, no stepping).
        Raises KeyError/ValueError for a snapshot of a different scene."""
        if len(snapshot["joints"]) != p.getNumJoints(self.robot, physicsClientId=self._c):
            raise ValueError("snapshot has a different number of robot joints")
        for j, q in enumerate(snapshot["joints"]):
            p.resetJointState(self.robot, j, q, physicsClientId=self._c)
        for name, (pos, orn) in snapshot["cubes"].items():
            p.resetBasePositionAndOrientation(self.cubes[name], pos, orn, physicsClientId=self._c)
        self.target_xy = tuple(snapshot["target_xy"])
        p.resetBasePositionAndOrientation(self.target, [*self.target_xy, 0.0006], [0, 0, 0, 1], physicsClientId=self._c)

    def object_positions(self) -> dict[str, tuple[float, float, float]]:
        """Ground-truth cube centres in the base frame, metres."""
        return {n: tuple(p.getBasePositionAndOrientation(b, physicsClientId=self._c)[0])
                for n, b in self.cubes.items()}

    def gripper_position(self) -> np.ndarray:
        """Position of the point between the fingertips (base frame, metres), shape [3]."""
        return np.array(p.getLinkState(self.robot, EE_LINK, physicsClientId=self._c)[4])

    @property
    def held(self) -> str | None:
        """Name of the cube both fingers touch (the grasped cube), or None."""
        for name, body in self.cubes.items():
            links = {c[3] for c in p.getContactPoints(self.robot, body, physicsClientId=self._c)}
            if set(FINGER_JOINTS) <= links:
                return name
        return None

    @property
    def busy(self) -> bool:
        """True while a command is executing."""
        return self._motion is not None

    def scenario_status(self) -> dict:
        """Ground truth of the scenario as a JSON-ready dict: goal text, target, whether the goal
        is met (target cube resting on the target within `success_tolerance`), cube positions,
        command counts and sim time (seconds)."""
        cfg = self.config
        objects = self.object_positions()
        cube = objects[cfg.target_object]
        dist = math.dist(cube[:2], self.target_xy)
        held = self.held
        resting = cube[2] < CUBE_HALF + 0.01 and held != cfg.target_object
        return {
            "goal": self.goal_text(),
            "target_object": cfg.target_object,
            "target_xy": [round(v, 4) for v in self.target_xy],
            "tolerance_m": cfg.success_tolerance,
            "distance_m": round(dist, 4),
            "success": bool(dist <= cfg.success_tolerance and resting),
            "holding": held,
            "busy": self.busy,
            "objects": {n: [round(v, 4) for v in xyz] for n, xyz in objects.items()},
            "commands_accepted": self.accepted,
            "commands_rejected": self.rejected,
            "sim_time_s": round(self.sim_time, 3),
        }

    def goal_text(self) -> str:
        """The task in words, with the target position (metres, base frame)."""
        x, y = self.target_xy
        name = self.config.target_object.replace("_", " ")
        return (f"Put the {name} on the yellow target at x={x:.2f} y={y:.2f} "
                f"(metres, robot base frame): pick it, then place it there.")

    # ------------------------------------------------------------------ commands
    def execute(self, tool: str, arguments: dict | str, tag: int = 0) -> list[Event]:
        """Validate a tool call and start executing it now (the first joint targets are set
        before this returns; physics advances in `step()`).

        tool: a name from the tool file; arguments: dict or JSON object text; tag: the caller's id
        for the command, echoed in the `Event`s. `hold` and `stop` freeze the arm where it is; a
        new motion command preempts the one executing, except that repeating the executing
        command (same tool and arguments) just continues it. Returns the events this caused
        ("preempted" for the old command, "applied", and "done" for instant tools). Raises
        CommandRejected (unknown tool, bad JSON, arguments outside the schema, pick while
        holding, place while empty); a rejected command changes nothing.
        """
        try:
            new = self._plan(tool, arguments, tag)
        except CommandRejected:
            self.rejected += 1
            raise
        self.accepted += 1
        cur, events = self._motion, []
        if cur is not None and (cur.tool, cur.arguments) == (new.tool, new.arguments):
            cur.tags.append(tag)
            return [Event(tag, tool, "applied", f"continues decision {cur.tags[0]}")]
        if cur is not None:
            events += [Event(t, cur.tool, "preempted", f"preempted by {tool} (decision {tag})") for t in cur.tags]
        self._motion = new
        events.append(Event(tag, tool, "applied", f"executing {tool} {json.dumps(new.arguments)}"))
        self._control(events)
        return events

    def _plan(self, tool: str, arguments: dict | str, tag: int) -> _Motion:
        if tool not in self.tools:
            raise CommandRejected(f"unknown tool {tool!r}; known: {', '.join(self.tools)}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (json.JSONDecodeError, RecursionError) as e:
                raise CommandRejected(f"{tool}: arguments are not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise CommandRejected(f"{tool}: arguments must be a JSON object, got {type(arguments).__name__}")
        err = jsonschema.exceptions.best_match(self._validators[tool].iter_errors(arguments))
        if err is not None:
            where = "/".join(map(str, err.absolute_path)) or "arguments"
            raise CommandRejected(f"{tool}: {where}: {err.message}")
        for k, v in arguments.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise CommandRejected(f"{tool}: {k} is not a finite number")
        held = self.held
        if tool == "pick":
            name = arguments["object"]
            if held is not None:
                raise CommandRejected(f"pick: already holding {held}; place it first")
            if name not in self.cubes:
                raise CommandRejected(f"pick: no object {name!r} in the scene")
            segs = [("grip", FINGER_OPEN), ("approach", name), ("descend", name), ("grip", 0.0),
                    ("check_grasp", name), ("move", None, LIFT_Z)]
        elif tool == "place":
            if held is None:
                raise CommandRejected("place: not holding a cube; pick one first")
            x, y = float(arguments["x"]), float(arguments["y"])
            segs = [("move", (x, y), APPROACH_Z), ("move", (x, y), CUBE_HALF + 0.003),
                    ("grip", FINGER_OPEN), ("move", (x, y), APPROACH_Z)]
        elif tool == "move_to":
            segs = [("move", (float(arguments["x"]), float(arguments["y"])), float(arguments["z"]))]
        else:  # hold, stop, and any other argument-free tool of the file: freeze where we are
            segs = [("freeze", None)]
        return _Motion(tool, arguments, [tag], segs)

    # ------------------------------------------------------------------ stepping
    def step(self, n: int = 1) -> list[Event]:
        """Advance physics by n steps of `config.time_step` seconds, running the motion
        controller before each; returns the command events that happened."""
        events: list[Event] = []
        for _ in range(n):
            if self._motion is not None:
                self._control(events)
            p.stepSimulation(physicsClientId=self._c)
            self._steps += 1
            self.sim_time = self._steps * self.config.time_step
        return events

    def _control(self, events: list[Event]) -> None:
        """One controller tick for the head segment of the current motion."""
        m = self._motion
        dt = self.config.time_step
        kind, arg, *rest = m.segments[0]
        done = False
        if kind == "freeze":
            self._hold_joints()
            done = True
        elif kind == "grip":
            for j in FINGER_JOINTS:
                p.setJointMotorControl2(self.robot, j, p.POSITION_CONTROL, targetPosition=arg, force=20,
                                        maxVelocity=0.2, physicsClientId=self._c)
            done = m.seg_t >= GRIPPER_S
        elif kind == "check_grasp":
            if self.held != arg:
                m.log.append(f"grasp of {arg} failed")
                m.segments[1:] = [("grip", FINGER_OPEN), ("move", None, LIFT_Z)]
            done = True
        else:  # approach / descend / move: a straight Cartesian path of the gripper point
            if m.path is None:
                m.path = (self.gripper_position(), self._segment_goal(kind, arg, rest))
            start, goal = m.path
            length = float(np.linalg.norm(goal - start))
            s = min(1.0, m.seg_t * EE_SPEED / length) if length > 1e-6 else 1.0
            self._move_ee(start + s * (goal - start), self._grasp_yaw(kind, arg))
            err = float(np.linalg.norm(self.gripper_position() - goal))
            done = s >= 1.0 and (err < REACH_TOL or m.seg_t * EE_SPEED > length + SETTLE_S * EE_SPEED)
            if done and err >= REACH_TOL:
                m.log.append(f"{kind} ended {err * 100:.1f} cm from its goal")
        m.seg_t += dt
        if done:
            m.segments.pop(0)
            m.seg_t, m.path = 0.0, None
            if not m.segments:
                detail = "; ".join(m.log) or "ok"
                for t in m.tags:
                    events.append(Event(t, m.tool, "done", detail))
                self._motion = None

    def _segment_goal(self, kind: str, arg, rest) -> np.ndarray:
        if kind in ("approach", "descend"):
            x, y, _ = self.object_positions()[arg]
            return np.array([x, y, APPROACH_Z if kind == "approach" else CUBE_HALF])
        xy = self.gripper_position()[:2] if arg is None else arg
        return np.array([xy[0], xy[1], rest[0]])

    def _grasp_yaw(self, kind: str, arg) -> float:
        """Gripper yaw (radians) that lines the fingers up with a cube's faces; 0 otherwise."""
        if kind not in ("approach", "descend"):
            return self._yaw
        q = p.getBasePositionAndOrientation(self.cubes[arg], physicsClientId=self._c)[1]
        yaw = p.getEulerFromQuaternion(q)[2]
        self._yaw = (yaw + math.pi / 4) % (math.pi / 2) - math.pi / 4
        return self._yaw

    def _move_ee(self, pos: np.ndarray, yaw: float) -> None:
        orn = p.getQuaternionFromEuler([math.pi, 0.0, yaw])
        q = p.calculateInverseKinematics(self.robot, EE_LINK, pos.tolist(), orn, self._lower, self._upper,
                                         self._ranges, HOME, maxNumIterations=50, residualThreshold=1e-4,
                                         physicsClientId=self._c)
        p.setJointMotorControlArray(self.robot, ARM_JOINTS, p.POSITION_CONTROL, targetPositions=q[:7],
                                    forces=self._max_force, physicsClientId=self._c)

    def _hold_joints(self) -> None:
        q = [s[0] for s in p.getJointStates(self.robot, ARM_JOINTS, physicsClientId=self._c)]
        p.setJointMotorControlArray(self.robot, ARM_JOINTS, p.POSITION_CONTROL, targetPositions=q,
                                    forces=self._max_force, physicsClientId=self._c)

    def close(self) -> None:
        """Disconnect the PyBullet client (idempotent)."""
        if self._c is not None:
            p.disconnect(physicsClientId=self._c)
            self._c = None

    def __enter__(self) -> "CobotScene":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def benchmark(seconds: float = 2.0, config: SceneConfig | None = None) -> dict[str, float]:
    """Time physics steps (with the IK controller running a pick) and camera renders on this
    machine; returns mean milliseconds per step and per render."""
    with CobotScene(config) as scene:
        scene.execute("pick", {"object": scene.config.target_object})
        n = int(seconds / scene.config.time_step)
        t0 = time.perf_counter()
        scene.step(n)
        step_ms = (time.perf_counter() - t0) / n * 1e3
        t0 = time.perf_counter()
        for _ in range(10):
            scene.render()
        render_ms = (time.perf_counter() - t0) / 10 * 1e3
    return {"step_ms": step_ms, "render_ms": render_ms}


def main(argv: list[str] | None = None) -> None:
    """`python -m tokenspeed_sim.cobot`: time physics steps and renders on this machine, and
    optionally save one camera image as PNG."""
    import argparse

    import cv2

    ap = argparse.ArgumentParser(description="Time the cobot scene: physics step (with IK) and TinyRenderer camera.")
    ap.add_argument("--width", type=int, default=320, help="image width, pixels")
    ap.add_argument("--height", type=int, default=240, help="image height, pixels")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds of sim time to step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--png", help="also write the first camera image here")
    args = ap.parse_args(argv)
    cfg = SceneConfig(seed=args.seed, image_width=args.width, image_height=args.height)
    if args.png:
        with CobotScene(cfg) as scene:
            cv2.imwrite(args.png, cv2.cvtColor(scene.render(), cv2.COLOR_RGB2BGR))
    t = benchmark(args.seconds, cfg)
    print(f"{args.width}x{args.height}: physics step (with IK) {t['step_ms']:.3f} ms, render {t['render_ms']:.1f} ms")


if __name__ == "__main__":
    main()
