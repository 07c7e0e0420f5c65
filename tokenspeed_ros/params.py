"""ROS parameters of the TokenSpeed nodes: each node's parameters are one pydantic table.

`NodeParams` is the shared base: `declare(node)` declares every field as a ROS parameter (default
and description from the field) and returns the validated values; `resolved_tools_file()` finds
the node's tool list. `AgentParams` is the agent's table (the market bridge's,
`MarketBridgeParams`, lives in market_bridge.py). `tokenspeed_ros/config/*.yaml` repeat the defaults for
users to edit, and the launch-file test checks that every key there is a field of the table.
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rcl_interfaces.msg import ParameterDescriptor

from tokenspeed_ros.launch_spec import config_dir

DEFAULT_SYSTEM_PROMPT = (
    "You control a Franka Panda robot arm above a table with a red, a green and a blue cube. "
    "Observations give joint angles (radians) and cube positions (x forward, y left, metres, "
    "robot base frame). Reply with exactly one tool call that moves the task forward."
)


class AgentParamsError(ValueError):
    """A parameter value is out of range or inconsistent; the message names the parameter."""


class NodeParams(BaseModel):
    """Base of a node's parameter table: frozen, no unknown keys, strict types (no bool -> 1.0),
    and the engine parameters every node with an EngineWorker has.

    Subclasses set NODE (the node name, used in error messages), DEFAULT_TOOLS (the tool list
    in the config directory used when the `tools_file` field is empty) and LIVE (the parameters a
    configured node applies while running; every other one is read at configure).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    NODE: ClassVar[str]
    DEFAULT_TOOLS: ClassVar[str]
    LIVE: ClassVar[frozenset[str]] = frozenset({"threads"})   # applied while configured (ManagedNode)

    # lifecycle
    autostart: bool = Field(True, description="configure and activate at start-up; false: stay unconfigured "
                                              "until a lifecycle transition (tokenspeed_launch drives them)")

    # engine
    model: str = Field("", description='.gguf file, HF folder or "tiny-random"; empty = embedded SmolLM2-135M')
    threads: int = Field(1, ge=0, description="engine CPU threads; 0 = torch default. 1: the node shares the CPU with ROS callbacks (and the simulator), and torch's spinning thread pool stalls badly when oversubscribed")
    quantize: Literal["auto", "int4", "int8", "none"] = Field(
        "auto", description="engine weights: auto (the fastest format on this CPU that agrees with fp32, measured "
        "once and cached), int4 (the GGUF's Q4_1 codes), int8, or none (fp32)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="engine device: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="engine weights and KV cache: auto (bfloat16 on CUDA, float32 on the CPU) or a dtype")
    tools_file: str = Field("", description="OpenAI tool list (JSON); empty = the node's default in tokenspeed_ros/config")
    kv_budget_tokens: int = Field(
        1024, ge=64, description="hot KV cache of the session, tokens; older context is pruned by relevance")

    @classmethod
    def declare(cls, node):
        """Declare every field on `node` (an rclpy Node) and return the validated values.

        Parameters are declared with dynamic typing and validated here (strictly, except that an
        integer is accepted for a float), so a wrong type gets a message naming the parameter.
        Raises AgentParamsError naming the bad parameter(s).
        """
        node.declare_parameters("", [
            (name, f.default, ParameterDescriptor(description=f.description or "", dynamic_typing=True))
            for name, f in cls.model_fields.items()
        ])
        return cls.read(node)

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
            raise AgentParamsError(f"bad {cls.NODE} parameters: {e}") from None

    @classmethod
    def help_text(cls) -> str:
        """`--help` of the node's console entry point: its ROS parameters with defaults and
        descriptions, and how to set them (`--ros-args -p name:=value`, `--params-file`)."""
        lines = [f"usage: {cls.NODE} [--help] [--ros-args [-p NAME:=VALUE] [--params-file FILE] "
                 "[-r __ns:=/NAMESPACE] ...]", "",
                 f"ROS parameters of {cls.NODE} (default file: {config_dir() / (cls.NODE.removeprefix('tokenspeed_') + '.yaml')}):"]
        for name, f in cls.model_fields.items():
            lines.append(f"  {name} (default {f.default!r}): {f.description or ''}")
        return "\n".join(lines)

    def resolved_tools_file(self) -> Path:
        """The tool list to load: the `tools_file` field, or DEFAULT_TOOLS in the package's
        config directory (launch_spec.config_dir)."""
        return Path(self.tools_file) if self.tools_file else config_dir() / self.DEFAULT_TOOLS


class AgentParams(NodeParams):
    """Every parameter of `tokenspeed_agent`. Times in seconds, distances in metres, sizes in pixels."""

    NODE: ClassVar[str] = "tokenspeed_agent"
    DEFAULT_TOOLS: ClassVar[str] = "robot_tools.json"
    LIVE: ClassVar[frozenset[str]] = frozenset({
        "threads", "base_frame", "decision_period_s", "decide_on_goal", "decide_on_scene_change",
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
    goal_topic: str = Field("goal", description="std_msgs/String task text (latched: transient local); empty disables")
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
    command_qos_depth: int = Field(10, ge=1, description="history depth of the command publisher")
    command_qos_deadline_s: float = Field(
        3.0, ge=0.0, description="QoS deadline offered on agent/action (s); 0 disables; misses are counted")

    # decisions and the deadline monitor
    decision_period_s: float = Field(1.0, ge=0.0, description="rate trigger period (s); 0 = events only")
    decide_on_goal: bool = Field(True, description="trigger a decision when a new goal arrives")
    decide_on_scene_change: bool = Field(True, description="trigger a decision when the seen objects change")
    decide_while_executing: bool = Field(
        False, description="false: no rate/scene decisions while the robot executes the last model call; "
                           "its done/rejected/preempted feedback triggers the next one")
    observe_while_executing: bool = Field(
        False, description="false: joint and camera readings are held back while the robot executes a model "
                           "call (nothing decides then), so the engine is free when its feedback triggers a "
                           "decision; the newest readings go in after that decision")
    execution_timeout_s: float = Field(
        30.0, gt=0.0, description="an execution without done/rejected feedback for this long no longer blocks decisions (s)")
    deadline_budget_s: float = Field(
        2.0, gt=0.0, description="observation stamp -> action deadline (s)")
    publish_margin_s: float = Field(
        0.02, ge=0.0, description="the engine stops this long before the deadline to leave time to publish (s)")
    monitor_period_s: float = Field(0.01, gt=0.0, description="deadline monitor timer period (s)")
    fallback: Literal["hold", "stop", "last_valid"] = Field(
        "hold", description="safe action published when a decision misses its deadline or fails")
    tool_choice: str = Field("required", description='decide() tool_choice: "required", "auto" or a tool name')
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
        64, ge=0, description="the state line is not prefilled again before a decision while at most this many "
                              "tokens of other observations followed it (tokens; a joint-state line is ~57)")
    decide_ahead: bool = Field(
        True, description="while the robot executes a pick, decide the next call on the state its success leads "
                          "to; published at once when the real state line matches, else decided as usual")
    diagnostics_period_s: float = Field(1.0, gt=0.0, description="/diagnostics publish period (s)")

    # engine (model, threads, tools_file, kv_budget_tokens: see NodeParams)
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="system message of the session")

    # input checks
    stale_after_s: float = Field(2.0, gt=0.0, description="a sensor topic silent this long counts as missing (s)")
    max_future_s: float = Field(0.5, ge=0.0, description="stamps further ahead of the node clock are bad input (s)")
    max_age_s: float = Field(5.0, gt=0.0, description="stamps older than this are bad input (s)")
    max_goal_chars: int = Field(1000, ge=1, description="longer goal texts are bad input")

    # perception (intrinsics from CameraInfo, pose of the optical frame from camera_pose_topic)
    object_plane_z: float = Field(0.025, description="height of cube centres above the base frame origin, metres")
    min_blob_area_px: int = Field(12, ge=1, description="smaller colour blobs are ignored, pixels")

    @model_validator(mode="after")
    def _check(self) -> "AgentParams":
        if self.publish_margin_s >= self.deadline_budget_s:
            raise ValueError("publish_margin_s must be smaller than deadline_budget_s")
        for name in ("tools_when_empty", "tools_when_holding"):
            names = getattr(self, name)
            if len(set(names)) != len(names):
                raise ValueError(f"{name} lists a tool twice: {names}")
        return self

    def check_tool_names(self, known: list[str]) -> None:
        """Check tools_when_empty / tools_when_holding against the loaded tool names `known`.

        Raises AgentParamsError naming the parameter and the unknown tool.
        """
        for name in ("tools_when_empty", "tools_when_holding"):
            unknown = [t for t in getattr(self, name) if t not in known]
            if unknown:
                raise AgentParamsError(f"bad {self.NODE} parameters: {name} names unknown tool "
                                       f"{unknown[0]!r}; tools in the tool file: {known}")
