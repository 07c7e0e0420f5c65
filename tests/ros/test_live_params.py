"""Live parameters over DDS (the nodes' set_parameters services, from a parameter client node):
on a configured node every parameter either applies at once - checked on the running node - or
is refused with a reason; bad values are refused; nothing is accepted and ignored."""
import math

import pytest
import rclpy
from rclpy.duration import Duration
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.parameter_client import AsyncParameterClient

from support import spin_until
from tokenspeed_ros.agent_node import AgentNode
from tokenspeed_ros.market_bridge import MarketBridgeNode, MarketBridgeParams
from tokenspeed_ros.params import AgentParams

NOT_DEFAULT = {"quantize": "int8", "device": "cpu", "dtype": "bfloat16", "sensor_reliability": "reliable",
               "fallback": "stop", "tool_choice": "auto"}


def other_value(name: str, default):
    """A valid value of the field's type that differs from its default."""
    if name in NOT_DEFAULT:
        return NOT_DEFAULT[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return default + 0.5
    if isinstance(default, list):
        return default[:1]
    return (default or "x") + "_2"


@pytest.fixture
def ros(ros_env):
    rclpy.init()
    executor = SingleThreadedExecutor()
    client_node = rclpy.create_node("param_client")
    executor.add_node(client_node)
    nodes = [client_node]
    yield executor, nodes
    for node in nodes:
        if hasattr(node, "close"):
            assert node.close(timeout_s=60.0)
        node.destroy_node()
    rclpy.try_shutdown()


def setter(ros, node_name: str):
    executor, nodes = ros
    client = AsyncParameterClient(nodes[0], node_name)
    assert spin_until(executor, client.services_are_ready, 30)

    def set_one(name, value):
        future = client.set_parameters([Parameter(name, value=value)])
        assert spin_until(executor, future.done, 10)
        return future.result().results[0]
    return set_one


def check_every_parameter(node, params, set_one, took_effect) -> None:
    """Set each parameter of the node's table `params` to another valid value: a LIVE one applies
    (node.p changes and `took_effect(name, value)` holds), a READ_ONLY one is refused by its
    descriptor, any other is refused as read at configure and node.p keeps its value."""
    for name, field in params.model_fields.items():
        value, before = other_value(name, field.default), getattr(node.p, name)
        result = set_one(name, value)
        if name in params.READ_ONLY:
            assert not result.successful and "read-only" in result.reason and name in result.reason, name
            assert getattr(node.p, name) == before, name
        elif name in params.LIVE:
            assert result.successful, (name, result.reason)
            assert getattr(node.p, name) == value, name
            assert took_effect(name, value), name
        else:
            assert not result.successful and name in result.reason and "read at configure" in result.reason, name
            assert getattr(node.p, name) == before, name


AGENT_EFFECTS = {
    "threads": lambda n, v: n.worker.threads == v,
    "decision_period_s": lambda n, v: n._rate_timer.timer_period_ns == round(v * 1e9),
    "deadline_budget_s": lambda n, v: n.monitor.budget == Duration(seconds=v),
    "publish_margin_s": lambda n, v: n.loop.publish_margin_s == v,
    "fallback": lambda n, v: n.monitor.fallback == v,
    "restate_slack_tokens": lambda n, v: n.worker._repeat_slack == v,
    "diagnostics_period_s": lambda n, v: n._diag_timer.timer_period_ns == round(v * 1e9),
    "tools_when_empty": lambda n, v: [t["function"]["name"] for t in
                                      n.ctx.tool_choice(n.p)["allowed_tools"]["tools"]] == v,
    "tool_choice": lambda n, v: n.ctx.tool_choice(n.p)["allowed_tools"]["mode"] == v,
}


def test_agent_parameters_apply_live_or_are_refused(ros):
    executor, nodes = ros
    node = AgentNode(parameter_overrides=[Parameter("model", value="tiny-random")])
    nodes.append(node)
    executor.add_node(node)
    assert spin_until(executor, lambda: node.active, 120)      # autostart: on the executor's first step
    assert node.worker.state == "ready"
    set_one = setter(ros, "tokenspeed_agent")
    check_every_parameter(node, AgentParams, set_one,
                          lambda name, v: name not in AGENT_EFFECTS or
                          spin_until(executor, lambda: AGENT_EFFECTS[name](node, v), 5))
    assert set_one("decision_period_s", 0.0).successful and node._rate_timer is None      # events only
    bad = set_one("fallback", "explode")
    assert not bad.successful and "fallback" in bad.reason and node.monitor.fallback == "stop"
    unknown = set_one("tools_when_holding", ["fly"])
    assert not unknown.successful and "fly" in unknown.reason


# The probes of issue 25 that crashed or silently disabled the agent, and values of another type:
# each is refused with one line naming the parameter and its range, and the node keeps its value.
PROBES = [("deadline_budget_s", math.inf), ("deadline_budget_s", 1e300), ("decision_period_s", math.inf),
          ("decision_period_s", 1e300), ("diagnostics_period_s", math.inf), ("diagnostics_period_s", 1e300),
          ("threads", 2 ** 62), ("threads", 100_000), ("tool_choice", "no_such_tool"), ("tool_choice", "none"),
          ("decision_period_s", 1e-9), ("deadline_budget_s", math.nan), ("deadline_budget_s", "1"),
          ("threads", True), ("fallback", 1), ("tools_when_empty", "pick"),
          ("threads", -1), ("fallback", "explode"), ("tools_when_empty", ["task_done", "fly"])]


def test_agent_refuses_the_hostile_probes(ros):
    executor, nodes = ros
    node = AgentNode(parameter_overrides=[Parameter("model", value="tiny-random")])
    nodes.append(node)
    executor.add_node(node)
    assert spin_until(executor, lambda: node.active, 120)
    set_one = setter(ros, "tokenspeed_agent")
    before = node.p
    for name, value in PROBES:
        result = set_one(name, value)
        assert not result.successful, (name, value)
        assert "\n" not in result.reason and name in result.reason, result.reason
    assert node.p == before and node.worker.state == "ready"
    # an integer for a float parameter is that float (`ros2 param set /tokenspeed_agent deadline_budget_s 2`)
    assert set_one("deadline_budget_s", 2).successful
    assert node.p.deadline_budget_s == 2.0 and isinstance(node.p.deadline_budget_s, float)
    assert node.get_parameter("deadline_budget_s").type_ == Parameter.Type.DOUBLE
    assert spin_until(executor, lambda: node.monitor.budget == Duration(seconds=2), 5)


def test_bridge_parameters_apply_live_or_are_refused(ros, tmp_path):
    executor, nodes = ros
    node = MarketBridgeNode(parameter_overrides=[
        Parameter("feed_endpoint", value=f"ipc://{tmp_path}/feed"),
        Parameter("decision_endpoint", value=f"ipc://{tmp_path}/decisions"), Parameter("agent", value=False)])
    nodes.append(node)
    executor.add_node(node)
    set_one = setter(ros, "tokenspeed_market_bridge")
    effects = {"deadline_budget_s": lambda v: node.monitor.budget == Duration(seconds=v),
               "publish_margin_s": lambda v: node.loop.publish_margin_s == v,
               "status_period_s": lambda v: node._status_timer.timer_period_ns == round(v * 1e9)}
    check_every_parameter(node, MarketBridgeParams, set_one, lambda name, v: name not in effects or effects[name](v))
    assert not set_one("move_bps", -1.0).successful and node.p.move_bps == other_value("move_bps", 5.0)
