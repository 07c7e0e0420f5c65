"""ROS parameters of the TokenSpeed nodes: each node's parameters are one pydantic table.

`NodeParams` is the shared base: `declare(node)` declares every field as a ROS parameter with a
descriptor as generate_parameter_library writes one (fixed type, the field's range as an integer or
floating-point range, read_only for READ_ONLY fields, default and description) and returns the
validated values; every value is checked against its range (finite, bounded) before it is
applied, and a refusal is one line naming the parameter and its range. `load_tools()` reads the
node's tool list (the engine's reader, `tokenspeed.tools`). `AgentParams` is the agent's table (the market bridge's,
`MarketBridgeParams`, lives in market_bridge.py). `tokenspeed_ros/config/*.yaml` repeat the defaults for
users to edit, and the launch-file test checks that every key there is a field of the table.
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException

from tokenspeed.tools import TOOLS_DIR, ToolsFileError, load_tools

from tokenspeed_ros.launch_spec import config_dir

DEFAULT_SYSTEM_PROMPT = (
    "You control a Franka Panda robot arm above a table with a red, a green and a blue cube. "
    "Observations give joint angles (radians) and cube positions (x forward, y left, metres, "
    "robot base frame). Reply with exactly one tool call that moves the task forward."
)


MIN_PERIOD_S = 0.05     # shortest decision / diagnostics period a node accepts (s); 0 = off where allowed

# Python type of a field -> ROS parameter type (fixed: a value of another type is refused).
_ROS_TYPES = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
              float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING}


class AgentParamsError(ValueError):
    """A parameter value is out of range or inconsistent; the message names the parameter."""


def _bounds(field) -> tuple[float | None, bool, float | None, bool]:
    """(low, low inclusive, high, high inclusive) of a pydantic field's ge/gt/le/lt constraints."""
    low = high = None
    low_in = high_in = True
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            low = m.ge
        elif isinstance(m, annotated_types.Gt):
            low, low_in = m.gt, False
        elif isinstance(m, annotated_types.Le):
            high = m.le
        elif isinstance(m, annotated_types.Lt):
            high, high_in = m.lt, False
    return low, low_in, high, high_in


def range_text(field) -> str:
    """The field's range as text: "[0, 600]", "(0, 600]", "one of auto, int4", "" (free text)."""
    if get_origin(field.annotation) is Literal:
        return "one of " + ", ".join(map(str, get_args(field.annotation)))
    low, low_in, high, high_in = _bounds(field)
    if low is None and high is None:
        return ""
    return f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def _ros_type(field) -> int:
    if get_origin(field.annotation) is Literal:
        return ParameterType.PARAMETER_STRING
    if get_origin(field.annotation) is list:
        return ParameterType.PARAMETER_STRING_ARRAY
    return _ROS_TYPES[field.annotation]


def descriptor(name: str, field, read_only: bool = False) -> ParameterDescriptor:
    """The ROS ParameterDescriptor of a field: fixed type, description, the range as
    IntegerRange / FloatingPointRange and in additional_constraints (an open end is stored as its
    limit: the table refuses the limit itself), read_only."""
    d = ParameterDescriptor(name=name, type=_ros_type(field), description=field.description or "",
                            read_only=read_only)
    low, _, high, _ = _bounds(field)
    if low is not None and high is not None:
        d.additional_constraints = f"range {range_text(field)}"
        if d.type == ParameterType.PARAMETER_INTEGER:
            d.integer_range = [IntegerRange(from_value=int(low), to_value=int(high), step=1)]
        elif d.type == ParameterType.PARAMETER_DOUBLE:
            d.floating_point_range = [FloatingPointRange(from_value=float(low), to_value=float(high), step=0.0)]
    elif get_origin(field.annotation) is Literal:
        d.additional_constraints = range_text(field)
    return d


class NodeParams(BaseModel):
    """Base of a node's parameter table: frozen, no unknown keys, strict types (no bool -> 1.0),
    and the engine parameters every node with an EngineWorker has.

    Subclasses set NODE (the node name, used in error messages), DEFAULT_TOOLS (the engine's tool
    set, `tokenspeed/data/tools/<DEFAULT_TOOLS>`, used when the `tools_file` field is empty) and
    LIVE (the parameters a configured node applies while running; every other one is read at
    configure); READ_ONLY parameters are only read at start-up.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    NODE: ClassVar[str]
    DEFAULT_TOOLS: ClassVar[str]
    LIVE: ClassVar[frozenset[str]] = frozenset({"threads"})   # applied while configured (ManagedNode)
    READ_ONLY: ClassVar[frozenset[str]] = frozenset({"autostart"})   # only read at start-up: never set later

    # lifecycle
    autostart: bool = Field(True, description="configure and activate at start-up; false: stay unconfigured "
                                              "until a lifecycle transition (tokenspeed_launch drives them)")

    # deadline monitor (both nodes have one)
    monitor_thread_priority: int = Field(
        50, ge=0, le=99, description="SCHED_FIFO priority of the deadline monitor's thread (1-99, as "
        "ros2_control's thread_priority), so its fallbacks and heartbeat go out on time under CPU load; 0 = the "
        "default policy. Needs CAP_SYS_NICE or an rtprio limit (/etc/security/limits.conf); without it the node "
        "warns and runs in the default policy")

    # engine
    model: str = Field("", description='.gguf file, HF folder or "tiny-random"; empty = embedded SmolLM2-135M')
    threads: int = Field(1, ge=0, le=256, description="engine CPU threads; 0 = torch default. 1: the node shares the CPU with ROS callbacks (and the simulator), and torch's spinning thread pool stalls badly when oversubscribed")
    quantize: Literal["auto", "gguf", "int4", "int8", "none"] = Field(
        "auto", description="engine weights: auto (a quantized .gguf model's own blocks; other models the fastest "
        "format on this CPU that agrees with fp32, measured once and cached), gguf (a .gguf model's own blocks, read without an fp32 copy; CPU), int4 (4-bit groups "
        "re-derived from fp32), int8, or none (fp32)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="engine device: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="engine weights and KV cache: auto (bfloat16 on CUDA, float32 on the CPU) or a dtype")
    tools_file: str = Field("", description="OpenAI tool list (JSON); empty = the node's default tool set "
                                            "(tokenspeed/data/tools)")
    kv_budget_tokens: int = Field(
        1024, ge=64, le=1 << 20, description="hot KV cache of the session, tokens; older context is pruned by relevance")

    @classmethod
    def declare(cls, node):
        """Declare every field on `node` (an rclpy Node) with its descriptor (`descriptor`: fixed
        type, range, read_only) and return the validated values.

        Raises AgentParamsError naming the bad parameter (an override of the wrong type or out of
        range, e.g. `-p deadline_budget_s:=1`, an integer for a float).
        """
        for name, f in cls.model_fields.items():
            default = float(f.default) if f.annotation is float else f.default
            try:
                node.declare_parameter(name, default, descriptor(name, f, name in cls.READ_ONLY))
            except (InvalidParameterTypeException, InvalidParameterValueException) as e:   # an override
                rng = range_text(f)
                hint = " (write a float with a decimal point: 1.0)" if f.annotation is float and "INTEGER" in str(e) else ""
                raise AgentParamsError(f"{name} refused: {str(e).splitlines()[0]}{hint}"
                                       + (f"; range {rng}" if rng else "")) from None
        return cls.read(node)

    @classmethod
    def typed(cls, param):
        """A parameter being set (an rclpy Parameter) with its field's fixed type: an integer for a
        float field becomes that float (`ros2 param set ... deadline_budget_s 2`); other names
        and NOT_SET (rclpy's own refusal) pass unchanged.

        Raises AgentParamsError (one line naming the parameter, both types and its range) for a
        value of any other type, which rclpy's type check would refuse without the name."""
        from rclpy.parameter import Parameter

        field = cls.model_fields.get(param.name)
        if field is None or param.type_ == Parameter.Type.NOT_SET:
            return param
        expected = Parameter.Type(_ros_type(field))
        if param.type_ == expected:
            return param
        if expected == Parameter.Type.DOUBLE and param.type_ == Parameter.Type.INTEGER:
            return Parameter(param.name, Parameter.Type.DOUBLE, float(param.value))
        raise AgentParamsError(cls.refusal(param.name, param.value, f"{param.type_.name.lower()} given, "
                                                                    f"{expected.name.lower()} expected"))

    @classmethod
    def refusal(cls, name: str, value, why: str) -> str:
        """One line: "<name>=<value> refused: <why>; range <range>"."""
        field = cls.model_fields.get(name)
        rng = range_text(field) if field is not None else ""
        return f"{name}={value!r} refused: {why}" + (f"; range {rng}" if rng else "")

    @classmethod
    def read(cls, node):
        """The validated values of the fields as the node's parameters hold them now.
        Raises AgentParamsError naming the bad parameter(s)."""
        return cls.validated({name: node.get_parameter(name).value for name in cls.model_fields})

    @classmethod
    def validated(cls, values: dict):
        """`values` (field name -> value) as a validated table. Raises AgentParamsError naming the
        bad parameter(s)."""
        try:
            return cls(**values)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            name = str(first["loc"][0]) if first["loc"] else ""
            why = first["msg"].removeprefix("Value error, ")
            if name in cls.model_fields:
                raise AgentParamsError(cls.refusal(name, values.get(name), why)) from None
            raise AgentParamsError(why) from None

    @classmethod
    def help_text(cls) -> str:
        """`--help` of the node's console entry point: its ROS parameters with defaults and
        descriptions, and how to set them (`--ros-args -p name:=value`, `--params-file`)."""
        lines = [f"usage: {cls.NODE} [--help] [--ros-args [-p NAME:=VALUE] [--params-file FILE] "
                 "[-r __ns:=/NAMESPACE] ...]", "",
                 f"ROS parameters of {cls.NODE} (default file: {config_dir() / (cls.NODE.removeprefix('tokenspeed_') + '.yaml')}):"]
        for name, f in cls.model_fields.items():
            rng = range_text(f)
            lines.append(f"  {name} (default {f.default!r}{', ' + rng if rng else ''}): {f.description or ''}")
        return "\n".join(lines)

    def resolved_tools_file(self) -> Path:
        """The tool list to load: the `tools_file` field, or the engine's DEFAULT_TOOLS set."""
        return Path(self.tools_file) if self.tools_file else TOOLS_DIR / self.DEFAULT_TOOLS

    def load_tools(self) -> list[dict]:
        """The node's OpenAI tool list (`resolved_tools_file`), read with the engine's reader.
        Raises AgentParamsError naming tools_file and why."""
        try:
            return load_tools(self.resolved_tools_file())
        except ToolsFileError as e:
            raise AgentParamsError(f"tools_file refused: {e}") from None


class AgentParams(NodeParams):
    """Every parameter of `tokenspeed_agent`. Times in seconds, distances in metres, sizes in pixels."""

    NODE: ClassVar[str] = "tokenspeed_agent"
    DEFAULT_TOOLS: ClassVar[str] = "robot_tools.json"
    LIVE: ClassVar[frozenset[str]] = frozenset({
        "threads", "base_frame", "decision_period_s", "decide_on_goal", "decide_on_scene_change", "decide_without_task",
        "decide_while_executing", "observe_while_executing", "execution_timeout_s", "deadline_budget_s",
        "publish_margin_s", "fallback", "tool_choice", "tools_when_empty", "tools_when_holding",
        "restate_before_decisions", "joint_states_in_context", "restate_slack_tokens", "diagnostics_period_s", "decide_ahead",
        "stale_after_s", "max_future_s", "max_age_s", "max_goal_chars", "object_plane_z", "min_blob_area_px"})

    # topics (relative names: they follow the node's namespace)
    joint_states_topic: str = Field("joint_states", description="sensor_msgs/JointState input")
    image_topic: str = Field("camera/image_raw", description="sensor_msgs/Image input (rgb8 or bgr8)")
    camera_info_topic: str = Field("camera/camera_info", description="sensor_msgs/CameraInfo (intrinsics K)")
    camera_pose_topic: str = Field(
        "camera/pose", description="geometry_msgs/PoseStamped of the camera optical frame in the base frame (latched)")
    goal_topic: str = Field("", description="std_msgs/String task text (latched: transient local), a thin way in "
                                            "that never preempts a RunTask goal; empty (default) disables")
    action_topic: str = Field("agent/action", description="tokenspeed_msgs/ActionCommand output")
    deadline_status_topic: str = Field("agent/deadline_status", description="tokenspeed_msgs/DeadlineStatus output")
    observation_topic: str = Field("agent/observation", description="tokenspeed_msgs/Observation echoes")
    target_pose_topic: str = Field("agent/target_pose", description="geometry_msgs/PoseStamped for move_to/place calls")
    action_feedback_topic: str = Field(
        "sim/action_feedback", description="tokenspeed_msgs/ActionFeedback from the robot; empty disables")
    base_frame: str = Field("base", description="frame_id of target poses (robot base frame)")
    task_status_topic: str = Field(
        "sim/scenario_status", description="std_msgs/String JSON status of the robot cell ({\"success\": bool, ...}, "
        "latched): the completion tool task_done is offered and accepted only while it reports success; "
        "empty: task_done is accepted whenever the gripper is empty")
    run_task_action: str = Field("run_task", description="tokenspeed_msgs/action/RunTask server; empty disables")
    decide_service: str = Field("decide", description="tokenspeed_msgs/srv/Decide server (one decision on demand); "
                                                      "empty disables")

    # QoS
    sensor_reliability: Literal["best_effort", "reliable"] = Field(
        "best_effort", description="reliability of the sensor subscriptions (depth 1)")
    command_qos_depth: int = Field(10, ge=1, le=10_000, description="history depth of the command publisher")
    command_qos_deadline_s: float = Field(
        3.0, ge=0.0, le=3600.0, description="QoS deadline offered on agent/action (s); 0 disables; misses are counted")

    # decisions and the deadline monitor
    decision_period_s: float = Field(1.0, ge=0.0, le=3600.0, description=f"rate trigger period (s); 0 = events only, else at least {MIN_PERIOD_S} s")
    decide_on_goal: bool = Field(True, description="trigger a decision when a new goal arrives")
    decide_on_scene_change: bool = Field(True, description="trigger a decision when the seen objects change")
    decide_without_task: bool = Field(
        False, description="false: nothing decides (rate, scene, feedback) until the first task runs, so no "
                           "decision is cut short when one starts (a Decide request still decides); true: decide "
                           "from the sensors alone until then (a node used without RunTask or the goal topic). "
                           "After a task ends the agent holds either way")
    decide_while_executing: bool = Field(
        False, description="false: no rate/scene decisions while the robot executes the last model call; "
                           "its done/rejected/preempted feedback triggers the next one")
    observe_while_executing: bool = Field(
        False, description="false: joint and camera readings are held back while the robot executes a model "
                           "call (nothing decides then), so the engine is free when its feedback triggers a "
                           "decision; the newest readings go in after that decision")
    execution_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="an execution without done/rejected feedback for this long no longer blocks decisions (s)")
    deadline_budget_s: float = Field(
        2.0, gt=0.0, le=600.0, description="observation stamp -> action deadline (s)")
    publish_margin_s: float = Field(
        0.02, ge=0.0, le=10.0, description="the engine stops this long before the deadline to leave time to publish (s)")
    monitor_period_s: float = Field(0.01, ge=0.001, le=1.0, description="deadline monitor timer period (s)")
    fallback: Literal["hold", "stop", "last_valid"] = Field(
        "hold", description="safe action published when a decision misses its deadline or fails")
    tool_choice: str = Field("required", description='decide() tool_choice: "required", "auto" or the name of a '
                             'tool in the tool file (a decision must call a tool: "none" is refused)')
    tools_when_empty: list[str] = Field(
        ["pick", "move_to", "hold", "stop"], description="tools a decision may call while the gripper holds "
        "nothing (action masking by precondition, OpenAI allowed_tools); empty = every tool")
    tools_when_holding: list[str] = Field(
        ["place", "move_to", "hold", "stop"], description="tools a decision may call while the gripper holds a "
        "cube; empty = every tool")
    restate_before_decisions: bool = Field(
        True, description="observe a state line (objects, gripper, task) right before each decision, so the "
                          "model reads the state and the task last; the camera's objects and the goal then enter "
                          "the context only in the state line")
    joint_states_in_context: bool = Field(
        False, description="stream joint-state lines into the context (~57 tokens per changed reading); the tools "
                           "work in table coordinates, so by default joint states only keep the sensor check fresh")
    restate_slack_tokens: int = Field(
        64, ge=0, le=1 << 20, description="the state line is not prefilled again before a decision while at most this many "
                              "tokens of other observations followed it (tokens; a joint-state line is ~57)")
    decide_ahead: bool = Field(
        True, description="while the robot executes a pick, decide the next call on the state its success leads "
                          "to; published at once when the real state line matches, else decided as usual")
    diagnostics_period_s: float = Field(1.0, ge=MIN_PERIOD_S, le=3600.0, description="/diagnostics publish period (s)")

    # engine (model, threads, tools_file, kv_budget_tokens: see NodeParams)
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="system message of the session")

    # input checks
    stale_after_s: float = Field(2.0, gt=0.0, le=3600.0, description="a sensor topic silent this long counts as missing (s)")
    max_future_s: float = Field(0.5, ge=0.0, le=3600.0, description="stamps further ahead of the node clock are bad input (s)")
    max_age_s: float = Field(5.0, gt=0.0, le=86400.0, description="stamps older than this are bad input (s)")
    max_goal_chars: int = Field(1000, ge=1, le=100_000, description="longer goal texts are bad input")

    # perception (intrinsics from CameraInfo, pose of the optical frame from camera_pose_topic)
    object_plane_z: float = Field(0.025, ge=-10.0, le=10.0, description="height of cube centres above the base frame origin, metres")
    min_blob_area_px: int = Field(12, ge=1, le=100_000_000, description="smaller colour blobs are ignored, pixels")

    @model_validator(mode="after")
    def _check(self) -> "AgentParams":
        if self.publish_margin_s >= self.deadline_budget_s:
            raise ValueError("publish_margin_s must be smaller than deadline_budget_s")
        if 0 < self.decision_period_s < MIN_PERIOD_S:
            raise ValueError(f"decision_period_s={self.decision_period_s!r} refused: 0 (events only) "
                             f"or [{MIN_PERIOD_S}, 3600] s")
        for name in ("tools_when_empty", "tools_when_holding"):
            names = getattr(self, name)
            if len(set(names)) != len(names):
                raise ValueError(f"{name} lists a tool twice: {names}")
        return self

    def check_tool_names(self, known: list[str]) -> None:
        """Check tools_when_empty / tools_when_holding and tool_choice against the loaded tool
        names `known`.

        Raises AgentParamsError naming the parameter and the unknown tool.
        """
        for name in ("tools_when_empty", "tools_when_holding"):
            unknown = [t for t in getattr(self, name) if t not in known]
            if unknown:
                raise AgentParamsError(f"{name} names unknown tool {unknown[0]!r}; "
                                       f"tools in the tool file: {', '.join(known)}")
        if self.tool_choice not in ("required", "auto", *known):
            raise AgentParamsError(f"tool_choice={self.tool_choice!r} refused: one of required, auto, "
                                   f"{', '.join(known)}")
