"""Which processes each launch starts, with which parameter files: the one table both the ROS 2
launch files (`launch/*.launch.py`) and the `tokenspeed_launch` command read.

Why a Python table rather than parsing the launch files: `launch`/`launch_ros` are not on the
package registries here, so the launch files cannot be executed, and parsing their AST would
tie the launcher to one way of writing them. A plain table that the launch files import keeps
one source of truth that works with and without a ROS 2 installation, and that the launch-file
test can check directly (executables exist as console entry points, parameter files exist,
every parameter in them is declared by the node).
"""
from __future__ import annotations

import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

PACKAGE = "tokenspeed_ros"


@dataclass(frozen=True)
class NodeSpec:
    """One process: a console entry point (= ROS executable), its node name, its parameter file
    (a name inside the config directory), and whether it is a managed (lifecycle) node that runs
    the engine: the `params_file` and `model` launch arguments apply to it."""

    executable: str
    name: str
    params_file: str
    managed: bool = False


AGENT = NodeSpec("tokenspeed_agent", "tokenspeed_agent", "agent.yaml", managed=True)
COBOT_SIM = NodeSpec("tokenspeed_cobot_sim", "tokenspeed_cobot_sim", "cobot_sim.yaml")
MARKET_BRIDGE = NodeSpec("tokenspeed_market_bridge", "tokenspeed_market_bridge", "market_bridge.yaml", managed=True)

LAUNCHES: dict[str, tuple[NodeSpec, ...]] = {
    "agent": (AGENT,),                  # launch/agent.launch.py: the agent alone, for a real robot
    "cobot_sim": (COBOT_SIM, AGENT),    # launch/cobot_sim.launch.py: simulated cobot + agent
    "market": (MARKET_BRIDGE,),         # launch/market.launch.py: the market bridge (feeds connect to it)
}


# Launch arguments (name, default, description), declared by every launch file
# (DeclareLaunchArgument) and accepted by `tokenspeed_launch` (--params-file, --model, ...).
LAUNCH_ARGUMENTS: tuple[tuple[str, str, str], ...] = (
    ("params_file", "", "parameter file of the managed node (agent / market bridge); '' = the packaged one"),
    ("model", "", "model of the managed node (.gguf, HF folder, tiny-random); '' = the parameter file's"),
    ("autostart", "true", "the managed node configures and activates itself at start-up; false: it waits "
                          "unconfigured for lifecycle transitions (a lifecycle manager)"),
    ("namespace", "", "ROS namespace of every node of the launch (one robot cell per namespace)"),
    ("use_sim_time", "false", "every node follows /clock"),
    ("log_level", "info", "log level of every node (debug, info, warn, error, fatal)"),
)


def launch_description(launch: str):
    """The ROS 2 LaunchDescription of `launch` (a LAUNCHES key), for launch/*.launch.py with a
    full ROS 2 installation (imports `launch` and `launch_ros`, which are not installable here):
    the LAUNCH_ARGUMENTS declared, every node in the `namespace`, with `log_level` and
    `use_sim_time`, the managed node with `params_file` (default: its packaged file) and `model`
    (when given) and `autostart`; when any node exits, the launch shuts down. With autostart true
    (default) the managed node brings itself up; `tokenspeed_launch` drives the transitions itself
    instead. The nodes get the packaged Fast DDS profile unless FASTDDS_DEFAULT_PROFILES_FILE names
    one (as `dds_profile_env` gives the launcher's processes)."""
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, SetEnvironmentVariable, Shutdown
    from launch.conditions import IfCondition
    from launch.substitutions import EnvironmentVariable, LaunchConfiguration, PythonExpression
    from launch_ros.actions import Node

    arg = LaunchConfiguration
    declared = [DeclareLaunchArgument(name, default_value=default, description=text)
                for name, default, text in LAUNCH_ARGUMENTS]
    profile = dds_profile_env({})["FASTDDS_DEFAULT_PROFILES_FILE"]
    dds = SetEnvironmentVariable("FASTDDS_DEFAULT_PROFILES_FILE",
                                 EnvironmentVariable("FASTDDS_DEFAULT_PROFILES_FILE", default_value=profile))
    nodes = []
    for spec in LAUNCHES[launch]:
        common = dict(package=PACKAGE, executable=spec.executable, name=spec.name, namespace=arg("namespace"),
                      output="screen", on_exit=Shutdown(), arguments=["--ros-args", "--log-level", arg("log_level")])
        if not spec.managed:
            nodes.append(Node(**common, parameters=[str(params_path(spec)), {"use_sim_time": arg("use_sim_time")}]))
            continue
        params = PythonExpression(["'", arg("params_file"), "' or '", str(params_path(spec)), "'"])
        given = PythonExpression(["'", arg("model"), "' != ''"])
        launched = {"use_sim_time": arg("use_sim_time"), "autostart": arg("autostart")}
        nodes.append(Node(**common, condition=IfCondition(given),
                          parameters=[params, {**launched, "model": arg("model")}]))
        nodes.append(Node(**common, condition=IfCondition(PythonExpression(["not ", given])),
                          parameters=[params, launched]))
    return LaunchDescription([*declared, dds, *nodes])


def config_dir() -> Path:
    """The parameter files and tool lists: package data of tokenspeed_ros (`tokenspeed_ros/config`),
    found through the package in a source checkout and in an installed wheel alike."""
    return Path(str(files(PACKAGE) / "config"))


def params_path(spec: NodeSpec) -> Path:
    """Absolute path of the node's parameter file."""
    return config_dir() / spec.params_file


def dds_profile_env(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Set FASTDDS_DEFAULT_PROFILES_FILE in `env` (e.g. os.environ, before rclpy.init; or a child
    process's environment) to the package's config/fastdds.xml, unless it names a file already:
    Fast DDS participants that announce themselves every 0.5 s instead of every 3 s, so processes
    started together match each other's topics within about a second on a busy host (see the
    file). Other RMW implementations ignore it. Returns `env`."""
    env.setdefault("FASTDDS_DEFAULT_PROFILES_FILE", str(config_dir() / "fastdds.xml"))
    return env


def help_requested(args: list[str] | None) -> bool:
    """True when the command line of a ROS node's console entry point (`args` as given to
    rclpy.init; None = sys.argv) asks for -h/--help before any `--ros-args`: the entry point then
    prints its usage and exits 0 without starting the node."""
    argv = (sys.argv if args is None else args)[1:]
    user = argv[:argv.index("--ros-args")] if "--ros-args" in argv else argv
    return "-h" in user or "--help" in user

