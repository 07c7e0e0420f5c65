"""Hypothesis fuzzing of the agent's live parameters over real DDS: a parameter client in the test
process sets values of every type (NaN, inf, huge, negative, wrong types, unknown tool names) on a
running `tokenspeed_agent` process (tiny random model). Each set is answered - applied, or refused
with a one-line reason - the process never dies, and afterwards, with good values back, the engine
still decides (no silent dead engine) and /diagnostics reports it `ready`."""
import math

from diagnostic_msgs.msg import DiagnosticArray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rclpy.parameter import Parameter, parameter_value_to_python
from rclpy.parameter_client import AsyncParameterClient
from tokenspeed_msgs.msg import DeadlineStatus

from agent_support import SensorFeed, diagnostics
from test_agent_node import ENGINE_TIMEOUT
from tokenspeed_ros.params import AgentParams

INT64 = 2 ** 63 - 1
GOOD = {"decide_without_task": True, "tool_choice": "hold", "decision_period_s": 0.3, "deadline_budget_s": 30.0, "threads": 1,
        "publish_margin_s": 0.02, "fallback": "hold", "tools_when_empty": ["pick", "move_to", "hold", "stop"],
        "tools_when_holding": ["place", "move_to", "hold", "stop"]}

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.inf, -math.inf, math.nan, 1e300, -1e300, 1e-9, 0.0, -0.0, 5e-324]),
    st.integers(-INT64, INT64),
    st.sampled_from([2 ** 62, 100_000, -1, 0, 1, 256, 257]),
    st.booleans(),
    st.text(max_size=40),
    st.sampled_from(["none", "no_such_tool", "required", "auto", "hold", "task_done", "last_valid", ""]),
    st.lists(st.sampled_from(["pick", "place", "hold", "fly", "task_done", ""]), max_size=5),
)


def test_live_parameters_survive_hypothesis_fuzzing(probe, start_agent):
    statuses = probe.listen(DeadlineStatus, "agent/deadline_status")
    diags = probe.listen(DiagnosticArray, "/diagnostics")
    SensorFeed(probe)
    agent = start_agent(model="tiny-random", **{k: v for k, v in GOOD.items() if not isinstance(v, list)})
    client = AsyncParameterClient(probe.node, "tokenspeed_agent")
    assert probe.spin_until(client.services_are_ready, ENGINE_TIMEOUT), agent.log_path.read_text()
    assert probe.spin_until(lambda: any(s.reason == "ok" for s in statuses), ENGINE_TIMEOUT), agent.log_path.read_text()

    def set_one(name, value):
        future = client.set_parameters([Parameter(name, value=value)])
        assert probe.spin_until(future.done, 10), f"no answer to {name}={value!r}: {agent.log_path.read_text()[-3000:]}"
        return future.result().results[0]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from(sorted(AgentParams.LIVE | {"model", "autostart", "kv_budget_tokens"})), value=values)
    def fuzz(name, value):
        result = set_one(name, value)
        assert "\n" not in result.reason, result.reason
        if result.successful:       # applied: the value is in range, with the others as they are now
            assert name in AgentParams.LIVE
            current[name] = value
            AgentParams.validated({**AgentParams().model_dump(), **current})
        assert agent.poll() is None, agent.log_path.read_text()[-3000:]

    live = sorted(AgentParams.LIVE)
    future = client.get_parameters(live)
    assert probe.spin_until(future.done, 10)
    started = dict(zip(live, (parameter_value_to_python(v) for v in future.result().values)))
    current = dict(started)         # the agent's live values as the fuzzing changes them
    fuzz()
    # every live value back as it started (a fuzzed stale_after_s or max_age_s, say, rightly
    # turns every reading away), then the engine must still decide
    for name, value in {**started, **GOOD}.items():
        assert set_one(name, value).successful, name
    n = sum(s.reason == "ok" for s in statuses)
    assert probe.spin_until(lambda: sum(s.reason == "ok" for s in statuses) >= n + 3, 30), \
        agent.log_path.read_text()[-3000:]
    assert probe.spin_until(lambda: diags and diagnostics(diags[-1])["/tokenspeed_agent: engine"]["state"] == "ready", 5)
    assert agent.poll() is None
