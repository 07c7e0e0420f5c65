"""LiteLLM end to end: `litellm.completion(model="openai/...", api_base=...)` against a real
`tokenspeed serve` process (the `base_url` fixture: the embedded model). A forced tool call comes
back as LiteLLM's tool call, and a missed deadline as a finish reason from OpenAI's set, which
LiteLLM maps without its "Unmapped finish_reason" warning (it used to default "deadline" to "stop":
an empty answer that looked normal), streamed or not.
"""
import json
import logging
import os

import jsonschema
import pytest
from test_serve import PICK, TOOLS

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its own copy, not a download at import
litellm = pytest.importorskip("litellm")
litellm.suppress_debug_info = True  # no "Provider List" banner when it cannot price the model "tokenspeed"


@pytest.fixture()
def call(base_url, caplog):
    """litellm.completion against the server; fails the test on any LiteLLM warning about finish reasons."""
    caplog.set_level(logging.WARNING, logger="LiteLLM")

    def completion(**kwargs):
        return litellm.completion(model="openai/tokenspeed", api_base=f"{base_url}/v1", api_key="unused",
                                  num_retries=0, timeout=300, **kwargs)

    yield completion
    unmapped = [r.getMessage() for r in caplog.records if "finish_reason" in r.getMessage()]
    assert not unmapped


def test_tool_call_through_litellm(call):
    r = call(messages=PICK, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    fn = choice.message.tool_calls[0].function
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn.name)
    jsonschema.validate(json.loads(fn.arguments), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_missed_deadline_through_litellm_is_a_standard_finish_reason(call, stream):
    r = call(messages=PICK, tools=TOOLS, tool_choice="required", stream=stream, extra_body={"deadline_ms": 1})
    if stream:
        r = litellm.stream_chunk_builder(list(r), messages=PICK)
    choice = r.choices[0]
    assert choice.finish_reason == "length"  # OpenAI's "the budget ran out", not a normal "stop"
    assert not choice.message.tool_calls and not choice.message.content
