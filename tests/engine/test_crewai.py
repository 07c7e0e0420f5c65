"""CrewAI end to end: the README's agent with one tool, through CrewAI's own OpenAI provider
(`LLM(base_url=...)`), against a real `tokenspeed serve` process (the `base_url` fixture).

Slow: importing CrewAI and running the agent take tens of seconds on 2 cores.
"""
import httpx
import pytest
from support import readme_example

pytest.importorskip("crewai")

pytestmark = pytest.mark.slow


def _answered(base_url: str, finish_reason: str = "") -> float:
    # chat completions the server has answered (with that finish reason, or any)
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{base_url}/metrics").text.splitlines()
               if line.startswith(f'tokenspeed_requests_total{{finish_reason="{finish_reason}'))


def test_crewai_agent_with_a_tool_runs_against_tokenspeed_serve(base_url, monkeypatch):
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("CREWAI_TRACING_ENABLED", "false")
    before, calls_before = _answered(base_url), _answered(base_url, "tool_calls")
    scope: dict = {}
    exec(readme_example("crewai").replace("http://127.0.0.1:8000", base_url), scope)
    assert _answered(base_url) > before
    # CrewAI sends its tools with tool_choice="auto": the agent used its tool through it
    assert _answered(base_url, "tool_calls") > calls_before
    # its next turn (the call, the tool's result, tools and "auto" again) is the final answer: clean
    # text from the tool's result, not the call again nor its raw "<tool_call>" text
    raw = scope["result"].raw
    assert "42" in raw and "<tool_call>" not in raw and "get_joint_angle" not in raw
