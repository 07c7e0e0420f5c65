"""Launch files and `tokenspeed_launch`: every launch names only executables that are console
entry points, parameter files that exist, and parameters the nodes declare; the launcher starts
the same processes and leaves none behind."""
import ast
import importlib
import inspect
import os
import re
import signal
import subprocess
import time

import pytest
import yaml
from rcl_interfaces.srv import ListParameters

from support import BIN, ROOT, stop
from tokenspeed_ros.launch_spec import LAUNCH_ARGUMENTS, LAUNCHES, params_path
from tokenspeed_ros.market_bridge import MarketBridgeParams
from tokenspeed_ros.params import AgentParams

LAUNCH_FILES = sorted((ROOT / "launch").glob("*.launch.py"))
ALL_SPECS = sorted({s for specs in LAUNCHES.values() for s in specs}, key=lambda s: s.name)


def console_scripts() -> dict[str, str]:
    """{name: "module:function"} from setup.py's console_scripts."""
    text = (ROOT / "setup.py").read_text()
    return dict(re.findall(r'"(\w+)\s*=\s*([\w.]+:\w+)"', text))


def yaml_parameters(spec) -> dict:
    """The ros__parameters a params file gives the node (its own section or `/**`)."""
    doc = yaml.safe_load(params_path(spec).read_text())
    out = {}
    for key in ("/**", spec.name, "/" + spec.name, "/**/" + spec.name):
        out.update((doc.get(key) or {}).get("ros__parameters", {}))
    assert out, f"{spec.params_file} has no ros__parameters for {spec.name}"
    return out


def test_each_launch_file_reads_its_entry_in_the_launch_table():
    assert {f.name.removesuffix(".launch.py") for f in LAUNCH_FILES} == set(LAUNCHES)
    for f in LAUNCH_FILES:
        tree = ast.parse(f.read_text())
        calls = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", "") == "launch_description"}
        assert calls == {f.name.removesuffix(".launch.py")}, f.name
        assert any(isinstance(n, ast.FunctionDef) and n.name == "generate_launch_description" for n in tree.body)


def test_launch_arguments_are_declared_and_accepted_by_the_launcher():
    """launch_description declares every LAUNCH_ARGUMENTS entry (checked in its source: `launch`
    is not installable here), and tokenspeed_launch takes each as an option."""
    from tokenspeed_ros import launch_spec
    assert {name for name, _, _ in LAUNCH_ARGUMENTS} == {"params_file", "model", "autostart", "namespace",
                                                         "use_sim_time", "log_level"}
    source = inspect.getsource(launch_spec.launch_description)
    assert "DeclareLaunchArgument(name" in source and "LAUNCH_ARGUMENTS" in source
    assert '"autostart": arg("autostart")' in source        # the managed node gets it as its parameter
    assert 'SetEnvironmentVariable("FASTDDS_DEFAULT_PROFILES_FILE"' in source and "dds_profile_env({})" in source
    out = subprocess.run([str(BIN / "tokenspeed_launch"), "--help"], capture_output=True, text=True, check=True).stdout
    for name, _, _ in LAUNCH_ARGUMENTS:
        assert "--" + name.replace("_", "-") in out
    dry = subprocess.run([str(BIN / "tokenspeed_launch"), "cobot_sim", "--dry-run", "--namespace", "cell7",
                          "--model", "tiny-random", "--log-level", "warn", "--use-sim-time", "false",
                          "--params-file", "/tmp/agent.yaml"], capture_output=True, text=True, check=True).stdout
    sim, agent = dry.strip().splitlines()
    assert "-r __ns:=/cell7" in sim and "-r __ns:=/cell7" in agent and "--log-level warn" in agent
    assert "--params-file /tmp/agent.yaml" in agent and "--params-file /tmp/agent.yaml" not in sim
    assert "-p model:=tiny-random" in agent and "model:=" not in sim and "-p autostart:=false" in agent


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_executables_and_parameter_files_exist(spec):
    scripts = console_scripts()
    assert spec.executable in scripts, f"{spec.executable} is not a console entry point in setup.py"
    module, func = scripts[spec.executable].split(":")
    assert callable(getattr(importlib.import_module(module), func))
    assert (BIN / spec.executable).exists(), "entry point not installed: run make setup"
    assert params_path(spec).is_file()
    yaml_parameters(spec)


# Nodes that declare their parameters from one pydantic table: checked without starting them.
PARAM_TABLES = {"tokenspeed_agent": AgentParams, "tokenspeed_market_bridge": MarketBridgeParams}


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_yaml_parameters_are_declared_by_the_node(spec, probe, ros_env):
    values = yaml_parameters(spec)
    table = PARAM_TABLES.get(spec.executable)
    if table is not None:
        fields = set(table.model_fields)
        assert set(values) <= fields, f"{spec.params_file} sets undeclared parameters: {set(values) - fields}"
        assert fields - {"system_prompt"} <= set(values), f"{spec.params_file} lacks {fields - set(values)}"
        assert table(**values) == table()          # the YAML repeats the declared defaults
        return
    # the node declares its parameters in code: ask the running node which ones it has
    proc = subprocess.Popen([str(BIN / spec.executable), "--ros-args", "--params-file", str(params_path(spec))],
                            env=ros_env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = probe.node.create_client(ListParameters, f"/{spec.name}/list_parameters")
        assert probe.spin_until(client.service_is_ready, 30)
        future = client.call_async(ListParameters.Request())
        assert probe.spin_until(future.done, 10)
        declared = set(future.result().result.names)
    finally:
        stop(proc)
    missing = set(values) - declared
    assert not missing, f"{spec.params_file} sets parameters {spec.name} does not declare: {missing}"


def test_dry_run_prints_the_table():
    out = subprocess.run([str(BIN / "tokenspeed_launch"), "cobot_sim", "--dry-run",
                          "--set", "tokenspeed_agent.model=tiny-random"], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(LAUNCHES["cobot_sim"])
    for line, spec in zip(lines, LAUNCHES["cobot_sim"]):
        assert line.split()[0] == str(BIN / spec.executable)
        assert f"--params-file {params_path(spec)}" in line and f"__node:={spec.name}" in line
    assert lines[1].endswith("-p model:=tiny-random")       # --set overrides come last


def test_the_launch_processes_get_the_packaged_dds_profile_unless_one_is_named():
    """tokenspeed_launch and tokenspeed_demo set FASTDDS_DEFAULT_PROFILES_FILE to the packaged
    discovery profile (a file Fast DDS parses: announcements every 0.5 s), and leave a user's own."""
    import xml.etree.ElementTree as ET

    from tokenspeed_ros.launch_spec import config_dir, dds_profile_env

    env = dds_profile_env({})
    assert env["FASTDDS_DEFAULT_PROFILES_FILE"] == str(config_dir() / "fastdds.xml")
    ns = {"d": "http://www.eprosima.com"}
    lease = ET.parse(env["FASTDDS_DEFAULT_PROFILES_FILE"]).find(".//d:leaseAnnouncement", ns)
    assert (lease.find("d:sec", ns).text, lease.find("d:nanosec", ns).text) == ("0", "500000000")
    assert dds_profile_env({"FASTDDS_DEFAULT_PROFILES_FILE": "/mine.xml"}) == {"FASTDDS_DEFAULT_PROFILES_FILE": "/mine.xml"}


def test_bad_override_is_a_clear_error():
    out = subprocess.run([str(BIN / "tokenspeed_launch"), "agent", "--set", "nobody.x=1"], capture_output=True, text=True)
    assert out.returncode == 2 and "NODE.PARAM=VALUE" in out.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def launch_until_ready_then_ctrl_c(probe, ros_env, launch: str, overrides: list[str], ready) -> str:
    """Run `tokenspeed_launch <launch>` until `ready()` holds (spinning the probe), SIGINT it and
    check it exits 0 leaving none of its processes alive; returns its output."""
    sets = [arg for o in overrides for arg in ("--set", o)]
    launcher = subprocess.Popen([str(BIN / "tokenspeed_launch"), launch, "--grace", "10", *sets],
                                env=ros_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert probe.spin_until(ready, 60)
    finally:
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
    assert len(pids) == len(LAUNCHES[launch]), out
    time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], out
    assert "stopping: SIGINT" in out
    return out


def test_launcher_runs_both_nodes_and_ctrl_c_leaves_no_process(probe, ros_env):
    """Both processes run (the agent, tiny random model, decides; the sim publishes), and the agent's
    engine status on /diagnostics gives its start-up stages from its process start (launched by
    this test) to the engine ready, in order."""
    from diagnostic_msgs.msg import DiagnosticArray
    from tokenspeed_msgs.msg import ActionCommand

    from agent_support import diagnostics

    actions = probe.listen(ActionCommand, "agent/action")
    diags = probe.listen(DiagnosticArray, "/diagnostics")
    started = time.time()
    # the agent (tiny random model, its task from the sim's goal topic) decides and the sim is up: both run
    launch_until_ready_then_ctrl_c(probe, ros_env, "cobot_sim", ["tokenspeed_agent.model=tiny-random",
                                                                 "tokenspeed_agent.goal_topic=goal"],
                                   lambda: actions and probe.node.count_publishers("joint_states") >= 1 and diags)
    engine = next(d["/tokenspeed_agent: engine"] for d in map(diagnostics, diags) if "/tokenspeed_agent: engine" in d)
    assert started - 1 <= float(engine.pop("startup: process started")) <= time.time()
    stages = [k.removeprefix("startup: ") for k in engine if k.startswith("startup: ")]
    assert stages[:5] == ["process start to main (Python, the node's imports)", "rclpy and the node",
                          "waiting for configure", "configure: parameters, topics, tools",
                          "engine imports (torch; begun at process start)"]
    assert stages[-1] == "session: grammar tokenizer, system prompt and tools prefilled" and "tokenizer" in stages
    assert all(float(v) >= 0 for k, s in engine.items() if k.startswith("startup: ") for v in s.split())


def test_market_launch_runs_the_bridge(probe, ros_env, tmp_path):
    """`tokenspeed_launch market` (feed summaries only, endpoints private to the test) brings the
    bridge up with tokenspeed_ros/config/market_bridge.yaml: its tick publisher and diagnostics appear."""
    from diagnostic_msgs.msg import DiagnosticArray

    diags = probe.listen(DiagnosticArray, "/diagnostics")
    node = "tokenspeed_market_bridge"
    overrides = [f"{node}.agent=false", f"{node}.feed_endpoint=ipc://{tmp_path}/feed",
                 f"{node}.decision_endpoint=ipc://{tmp_path}/decisions"]
    launch_until_ready_then_ctrl_c(probe, ros_env, "market", overrides,
                                   lambda: diags and probe.node.count_publishers("market/tick") >= 1)
    assert any(s.name == f"/{node}: feed" and s.hardware_id == f"/{node}" for arr in diags for s in arr.status)


def test_a_node_failing_ends_the_launch_with_its_status(ros_env):
    """Bad parameters: the agent exits 2 with a message naming the parameter; the launch stops."""
    out = subprocess.run([str(BIN / "tokenspeed_launch"), "agent", "--set", "tokenspeed_agent.fallback=explode"],
                         env=ros_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "fallback" in out.stderr and "tokenspeed_agent exited with status 2" in out.stdout


def test_an_override_without_a_value_is_a_clear_error(ros_env):
    """`-p model:=` (rcl cannot parse it) ends with status 2 and one line, not a traceback."""
    out = subprocess.run([str(BIN / "tokenspeed_agent"), "--ros-args", "-p", "model:="], env=ros_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "tokenspeed_agent: cannot parse the ROS arguments" in out.stderr and "model:=" in out.stderr
def test_two_cells_in_two_namespaces_on_one_domain(probe, ros_env):
    """Two launches (simulator + agent each, tiny random model) in namespaces cell1 and cell2 on
    one ROS domain, as a fleet scales over DDS: each agent is brought up by its launcher (lifecycle
    active), takes its own cell's goal as its task and acts on its own cell's topics, and Ctrl-C ends
    both with no process left."""
    from tokenspeed_msgs.msg import ActionCommand

    from agent_support import Lifecycle

    actions = {cell: probe.listen(ActionCommand, f"/{cell}/agent/action") for cell in ("cell1", "cell2")}
    launchers = [subprocess.Popen([str(BIN / "tokenspeed_launch"), "cobot_sim", "--namespace", cell, "--model",
                                   "tiny-random", "--grace", "10", "--set", "tokenspeed_cobot_sim.seed=" + str(i),
                                   "--set", "tokenspeed_agent.goal_topic=goal"],
                                  env=ros_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i, cell in enumerate(actions, 1)]
    try:
        assert probe.spin_until(lambda: all(len(a) >= 2 for a in actions.values()), 120)
        for cell in actions:
            assert Lifecycle(probe, f"{cell}/tokenspeed_agent").state() == "active"
        assert not probe.node.count_publishers("/agent/action")      # nothing outside the namespaces
    finally:
        for launcher in launchers:
            launcher.send_signal(signal.SIGINT)
        outs = [launcher.communicate(timeout=60)[0] for launcher in launchers]
    for launcher, out in zip(launchers, outs):
        assert launcher.returncode == 0, out
        assert "tokenspeed_agent: configured" in out and "tokenspeed_agent: activated" in out
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
        time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], out
