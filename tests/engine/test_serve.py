"""`tokenspeed serve` as a real server process on 127.0.0.1, driven by the official `openai` client.

One server (the `base_url` fixture of conftest.py: the embedded SmolLM2-135M-Instruct, int4) serves
the test run; its queue holds one waiting request so that overflow can be caused with three requests.
"""
import json
import threading
import time
from pathlib import Path

import jsonschema
import pytest
from support import readme_example

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]
TOOLS = json.loads((ROOT / "engine" / "data" / "tools" / "robot_tools.json").read_text())
SYSTEM = {"role": "system", "content": "You control a robot arm."}
PICK = [SYSTEM, {"role": "user", "content": "Pick up the red cube."}]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _metric(base_url, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _validate(call, tools=TOOLS):
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_readme_example(base_url, monkeypatch):
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    exec(readme_example("serve").replace("http://127.0.0.1:8000", base_url), scope)
    assert scope["r"].choices[0].message.tool_calls and scope["r"].usage.prompt_tokens_details.cached_tokens > 0


def test_models(client):
    assert [m.id for m in client.models.list()] == ["tokenspeed"]


@pytest.mark.parametrize("tool_choice,expect", [
    ("required", None),
    ({"type": "function", "function": {"name": "place"}}, "place"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required",
                                                 "tools": [{"type": "function", "function": {"name": "move_to"}}]}},
     "move_to"),
])
def test_tool_choice_forces_valid_calls(client, tool_choice, expect):
    r = client.chat.completions.create(model="tokenspeed", messages=PICK, tools=TOOLS, tool_choice=tool_choice)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _validate(call)
    assert call.function.name == (expect or "pick")


def test_tool_choice_none_and_auto_answer_in_text_or_calls(client):
    r = client.chat.completions.create(model="tokenspeed", messages=PICK, tools=TOOLS, tool_choice="none",
                                       max_tokens=24)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    # auto: a tool applies, and the model's p(call) reaches its calibrated threshold (tokenspeed.auto)
    r = client.chat.completions.create(model="tokenspeed", messages=PICK, tools=TOOLS, tool_choice="auto",
                                       max_tokens=64)
    msg = r.choices[0].message
    assert msg.tool_calls and r.choices[0].finish_reason == "tool_calls"
    _validate(msg.tool_calls[0])
    # a threshold above any p(call) (the request's extra field) answers in text; cut at max_tokens: "length"
    r = client.chat.completions.create(model="tokenspeed", messages=PICK, tools=TOOLS, tool_choice="auto",
                                       max_tokens=8, extra_body={"auto_threshold": 1.0})
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_auto_does_not_repeat_a_call_the_conversation_holds_and_answers_in_text(client):
    # an agent framework's second turn (CrewAI, LangChain): the call, its result, then the tools
    # and tool_choice "auto" again. With one possible call (an enum), a threshold that always calls
    # would make the same call again (a small model's loop): it comes back as a text answer.
    tools = [{"type": "function", "function": {
        "name": "get_joint_angle", "description": "Read the current angle of one robot joint, in degrees.",
        "parameters": {"type": "object", "properties": {"joint": {"type": "string", "enum": ["elbow"]}},
                       "required": ["joint"], "additionalProperties": False}}}]
    question = [{"role": "user", "content": "What is the angle of the elbow joint?"}]
    call = client.chat.completions.create(model="tokenspeed", messages=question, tools=tools, tool_choice="required",
                                          parallel_tool_calls=False).choices[0].message.tool_calls[0]
    history = question + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "The elbow joint is at 42 degrees."}]
    for extra in ({}, {"auto_threshold": 0.0}):  # clients leave tool_choice out: "auto"
        r = client.chat.completions.create(model="tokenspeed", messages=history, tools=tools,
                                           parallel_tool_calls=False, max_tokens=64, extra_body=extra)
        msg = r.choices[0].message
        assert not msg.tool_calls and r.choices[0].finish_reason in ("stop", "length")
        assert "42" in msg.content and "<tool_call>" not in msg.content  # from the tool's result


def test_streaming_reassembles_into_the_non_streaming_answer(client):
    plain = client.chat.completions.create(model="tokenspeed", messages=PICK, tools=TOOLS, tool_choice="required")
    chunks = list(client.chat.completions.create(model="tokenspeed", messages=PICK, tools=TOOLS,
                                                 tool_choice="required", stream=True,
                                                 stream_options={"include_usage": True}))
    calls: dict[int, dict] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["tool_calls"] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in plain.choices[0].message.tool_calls]

    text = [{"role": "user", "content": "Write one sentence about robots."}]
    plain = client.chat.completions.create(model="tokenspeed", messages=text, max_tokens=30)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       client.chat.completions.create(model="tokenspeed", messages=text, max_tokens=30, stream=True))
    assert streamed == plain.choices[0].message.content and streamed


def test_stop_sequence_cuts_the_text(client):
    text = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    full = client.chat.completions.create(model="tokenspeed", messages=text, max_tokens=40).choices[0].message.content
    stop = full.split(",")[1] if "," in full else full[3:6]
    r = client.chat.completions.create(model="tokenspeed", messages=text, max_tokens=40, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[:full.index(stop)]


def test_parallel_calls_only_when_allowed(client):
    ask = [SYSTEM, {"role": "user", "content": "Pick the red cube and then pick the blue cube."}]
    r = client.chat.completions.create(model="tokenspeed", messages=ask, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1
    r = client.chat.completions.create(model="tokenspeed", messages=ask, tools=TOOLS, tool_choice="required")
    for call in r.choices[0].message.tool_calls:
        _validate(call)


def test_response_format_json_schema(client):
    schema = {"$defs": {"Pose": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                 "required": ["x", "y"]}},
              "type": "object", "properties": {"target": {"$ref": "#/$defs/Pose"}, "object": {"enum": ["cube", "ball"]}},
              "required": ["target", "object"]}
    r = client.chat.completions.create(
        model="tokenspeed", max_tokens=60,
        messages=[{"role": "user", "content": "The cube is at x=0.4 y=0.1. Reply in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "goal", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_warm_session_reuses_the_conversation(client, base_url):
    hits = _metric(base_url, "tokenspeed_cache_hits")
    first = [SYSTEM, {"role": "user", "content": "Move the arm home, please."}]
    r1 = client.chat.completions.create(model="tokenspeed", messages=first, tools=TOOLS, tool_choice="required")
    call = r1.choices[0].message.tool_calls[0]
    second = first + [r1.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "done"},
                      {"role": "user", "content": "Now pick up the red cube."}]
    r2 = client.chat.completions.create(model="tokenspeed", messages=second, tools=TOOLS, tool_choice="required")
    ts = r2.model_extra["tokenspeed"]
    # Everything up to the first answer came from the cache; only the tool result and the new
    # user message were prefilled.
    assert r2.usage.prompt_tokens_details.cached_tokens > r1.usage.prompt_tokens
    assert ts["prefill_tokens"] < 40 and ts["cached_tokens"] == r2.usage.prompt_tokens_details.cached_tokens
    assert _metric(base_url, "tokenspeed_cache_hits") >= hits + 1


def test_deadline_gives_a_clear_finish_reason_and_no_call(client):
    """A missed deadline is OpenAI's "length" (the budget ran out) with TokenSpeed's reason beside it."""
    r = client.chat.completions.create(model="tokenspeed", messages=PICK, tools=TOOLS, tool_choice="required",
                                       extra_body={"deadline_ms": 1})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].model_extra["tokenspeed_finish"]["reason"] == "deadline"
    assert r.choices[0].model_extra["tokenspeed_finish"]["detail"]
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is None


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "act", "parameters": {"type": "object", "properties": {"j": {"type": "array", "enum": ["a"]}}}}}]},
     "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": {"name": "fly"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_bodies_get_openai_errors_naming_the_field(base_url, body, param):
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tokenspeed", **body}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    if param == "tools":
        assert "j:" in err["message"]  # the offending property is named


def test_an_infinite_deadline_is_a_bad_deadline_ms(base_url):
    # JSON's Infinity (Python's json reads it) is no deadline: a 400 naming deadline_ms, before any engine work
    raw = b'{"model": "tokenspeed", "messages": [{"role": "user", "content": "hi"}], "deadline_ms": Infinity}'
    r = httpx.post(f"{base_url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "deadline_ms"


def test_full_queue_answers_429_at_once(client, base_url):
    long = dict(model="tokenspeed", messages=[{"role": "user", "content": "Tell a long story about a robot."}],
                max_tokens=150)
    results = []
    workers = [threading.Thread(target=lambda: results.append(client.chat.completions.create(**long)))
               for _ in range(2)]
    workers[0].start()
    while _metric(base_url, "tokenspeed_queue_depth") < 1:
        time.sleep(0.05)
    workers[1].start()
    while _metric(base_url, "tokenspeed_queue_depth") < 2:
        time.sleep(0.05)
    t0 = time.perf_counter()
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**long)
    assert time.perf_counter() - t0 < 5  # refused at once, not after the queue drained
    assert info.value.body["type"] == "rate_limit_error"
    for w in workers:
        w.join()
    assert len(results) == 2 and _metric(base_url, "tokenspeed_queue_rejections_total") >= 1
