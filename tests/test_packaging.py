"""Packaging as a new user meets it: every console entry point imports and answers --help (usage,
exit 0, no node started); every third-party import of the ROS side is installed by the `ros`
extra (or the base requirements); tool lists and parameter files are package data."""
import ast
import importlib
import importlib.metadata as md
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from support import BIN, ROOT

SCRIPTS = dict(re.findall(r'"(\w+)\s*=\s*([\w.]+:\w+)"', (ROOT / "setup.py").read_text()))
LOCAL = {"tokenspeed", "tokenspeed_ros", "tokenspeed_sim", "tokenspeed_msgs"}
FULL_ROS_ONLY = {"launch", "launch_ros"}    # launch_spec.launch_description, for `ros2 launch` (not on PyPI)


def test_setup_lists_the_console_scripts():
    assert {"tokenspeed_agent", "tokenspeed_market_bridge", "tokenspeed_cobot_sim", "tokenspeed_demo",
            "tokenspeed_launch"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_entry_point_imports_and_answers_help(name, tmp_path):
    module, func = SCRIPTS[name].split(":")
    assert callable(getattr(importlib.import_module(module), func))
    # a fresh domain and cwd: a node that started anyway would not meet anything, and wrote nowhere
    env = {"ROS_DOMAIN_ID": "231", "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "PATH": str(BIN)}
    r = subprocess.run([str(BIN / name), "--help"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower(), r.stdout[:500]
    if name in ("tokenspeed_agent", "tokenspeed_market_bridge", "tokenspeed_cobot_sim"):
        assert "--ros-args" in r.stdout and "default" in r.stdout


def _third_party_imports() -> set[str]:
    """Top-level modules imported by tokenspeed_ros/ and sim/ that are not the project's own."""
    names = set()
    for path in [*(ROOT / "tokenspeed_ros").glob("*.py"), *(ROOT / "sim").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in LOCAL | FULL_ROS_ONLY and n not in sys.stdlib_module_names}


def _closure(requirements: list[str]) -> set[str]:
    """Distribution names (normalised) reachable from `requirements` through installed metadata."""
    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in md.requires(req.name) or [] if "extra ==" not in r]
        except md.PackageNotFoundError:
            pass
    return seen


def test_ros_extra_installs_every_import_of_the_nodes_and_the_demo():
    dist = md.distribution("tokenspeed_ros")
    reqs = [r for r in dist.requires or [] if "extra ==" not in r or 'extra == "ros"' in r]
    available = _closure([r.split(";")[0] for r in reqs])
    owners = md.packages_distributions()
    missing = {}
    for module in sorted(_third_party_imports()):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(module, [])}
        if not dists & available:
            missing[module] = sorted(dists)
    assert not missing, f"imported but not installed by .[ros]: {missing}"


def test_tool_lists_and_parameter_files_ship_in_the_wheel(tmp_path):
    """A real wheel (no dependencies, no build isolation: seconds) carries tokenspeed_ros/config
    and the engine's tool sets (tokenspeed/data/tools), and the code finds them through the packages."""
    from importlib.resources import files

    from tokenspeed.tools import TOOLS_DIR
    from tokenspeed_ros.launch_spec import config_dir
    assert config_dir() == Path(str(files("tokenspeed_ros") / "config"))
    assert (TOOLS_DIR / "robot_tools.json").is_file()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("tokenspeed_ros-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("agent.yaml", "cobot_sim.yaml", "market_bridge.yaml", "fastdds.xml"):
        assert f"tokenspeed_ros/config/{name}" in names, name
    for name in ("robot_tools.json", "trading_tools.json"):
        assert f"tokenspeed/data/tools/{name}" in names, name


def test_the_engine_does_not_read_the_ros_package():
    """The ROS-free engine: nothing in engine/ imports or reads tokenspeed_ros."""
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py")
            if "tokenspeed_ros" in p.read_text().replace("tokenspeed_ros[", "")]     # pip extras are names
    assert hits == []


def _ros_imports() -> set[str]:
    """ROS packages (rclpy, *_msgs, *_srvs, *_interfaces) imported by tokenspeed_ros/ and sim/."""
    names = {n for n in _third_party_imports() | {"tokenspeed_msgs"}
             if n == "rclpy" or n.endswith(("_msgs", "_srvs", "_interfaces"))}
    return names


def test_package_xml_names_every_ros_import_and_nothing_unused():
    """colcon/rosdep: every ROS package the nodes import is an exec_depend, and every
    *_msgs / *_srvs / *_interfaces exec_depend is imported (no trajectory_msgs left over)."""
    import xml.etree.ElementTree as ET
    deps = {e.text for e in ET.parse(ROOT / "package.xml").getroot().iter("exec_depend")}
    assert _ros_imports() <= deps, sorted(_ros_imports() - deps)
    declared_ros = {d for d in deps if d == "rclpy" or d.endswith(("_msgs", "_srvs", "_interfaces"))}
    assert declared_ros <= _ros_imports(), sorted(declared_ros - _ros_imports())


def test_setup_cfg_installs_the_executables_where_ros2_run_finds_them():
    """ament_python: colcon's `setup.py install/develop` writes the console scripts to
    <prefix>/lib/tokenspeed_ros (ros2 run, launch_ros' Node(executable=...)), not <prefix>/bin."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["develop"]["script_dir"] == "$base/lib/tokenspeed_ros"
    assert cfg["install"]["install_scripts"] == "$base/lib/tokenspeed_ros"
