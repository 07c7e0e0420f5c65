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
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

PACKAGE = "tokenspeed_ros"


@dataclass(frozen=True)
class NodeSpec:
    """One process: a console entry point (= ROS executable), its node name and its parameter
    file (a name inside the config directory)."""

    executable: str
    name: str
    params_file: str


AGENT = NodeSpec("tokenspeed_agent", "tokenspeed_agent", "agent.yaml")
COBOT_SIM = NodeSpec("tokenspeed_cobot_sim", "tokenspeed_cobot_sim", "cobot_sim.yaml")
MARKET_BRIDGE = NodeSpec("tokenspeed_market_bridge", "tokenspeed_market_bridge", "market_bridge.yaml")

LAUNCHES: dict[str, tuple[NodeSpec, ...]] = {
    "agent": (AGENT,),                  # launch/agent.launch.py: the agent alone, for a real robot
    "cobot_sim": (COBOT_SIM, AGENT),    # launch/cobot_sim.launch.py: simulated cobot + agent
    "market": (MARKET_BRIDGE,),         # launch/market.launch.py: the market bridge (feeds connect to it)
}


def config_dir() -> Path:
    """The parameter files and tool lists: package data of tokenspeed_ros (`tokenspeed_ros/config`),
    found through the package in a source checkout and in an installed wheel alike."""
    return Path(str(files(PACKAGE) / "config"))


def params_path(spec: NodeSpec) -> Path:
    """Absolute path of the node's parameter file."""
    return config_dir() / spec.params_file


def help_requested(args: list[str] | None) -> bool:
    """True when the command line of a ROS node's console entry point (`args` as given to
    rclpy.init; None = sys.argv) asks for -h/--help before any `--ros-args`: the entry point then
    prints its usage and exits 0 without starting the node."""
    argv = (sys.argv if args is None else args)[1:]
    user = argv[:argv.index("--ros-args")] if "--ros-args" in argv else argv
    return "-h" in user or "--help" in user

