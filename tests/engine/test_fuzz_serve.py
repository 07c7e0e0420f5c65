"""Hypothesis fuzzing of `tokenspeed serve`'s POST /v1/chat/completions through a real server
process (tiny-random model): bytes that are not JSON, JSON of any shape, and request objects with
every field given random JSON values (lone surrogates, schemas nested past the limit and texts
over the context among them). Every answer is a 2xx or an OpenAI-shaped 4xx error whose `param`
names a field of the body (or nothing), never a 5xx; a finish reason is OpenAI's; a stream ends
with `[DONE]`; the server stays up throughout. Seeded and bounded here; the slow suite runs more
examples."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import serve_process

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

FAST = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW = settings(FAST, max_examples=600)

REQUEST_FIELDS = ("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "max_tokens",
                  "max_completion_tokens", "temperature", "top_p", "seed", "stream", "stream_options", "stop", "n",
                  "deadline_ms")
TOOL = {"type": "function", "function": {"name": "move", "description": "Move the arm.", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}

OPENAI_FINISH = {"stop", "length", "tool_calls", "content_filter"}
hostile_text = st.sampled_from(["lone \ud800 surrogate", "\udfff", "word " * 3000])  # bad Unicode; over the context


def _nested(levels: int) -> dict:
    schema: dict = {"type": "number"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2, 10 ** 20), st.floats(allow_nan=False),
                    st.text(max_size=20), hostile_text)
deep_schemas = st.integers(1, 120).map(_nested)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
roles = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), json_values)
messages = st.lists(st.fixed_dictionaries({"role": roles}, optional={
    "content": st.one_of(st.text(max_size=40), json_values,
                         st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
                                  max_size=2)),
    "name": json_values, "tool_calls": json_values, "tool_call_id": json_values}), max_size=3)
field_values = {
    "messages": st.one_of(messages, json_values),
    "tools": st.one_of(st.just([TOOL]), st.lists(json_values, max_size=2), json_values,
                       deep_schemas.map(lambda p: [{"type": "function", "function": {"name": "f", "parameters": p}}])),
    "response_format": st.one_of(json_values, deep_schemas.map(
        lambda p: {"type": "json_schema", "json_schema": {"name": "r", "schema": p}})),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "move"}},
                                              {"type": "function", "function": {"name": "fly"}}]), json_values),
    "max_tokens": st.one_of(st.integers(1, 6), json_values),
    "stream": st.one_of(st.booleans(), json_values),
}
request_objects = st.fixed_dictionaries(
    {"messages": field_values["messages"], "max_tokens": st.integers(1, 6)},
    optional={f: field_values.get(f, json_values) for f in REQUEST_FIELDS if f not in ("messages", "max_tokens")})
bodies = st.one_of(
    st.binary(max_size=60),                                              # anything, mostly not JSON
    json_values.map(lambda v: json.dumps(v).encode()),                   # JSON of any shape
    request_objects.map(lambda v: json.dumps(v).encode()),               # request objects, fields random
    request_objects.map(lambda v: json.dumps(v).encode()[:-1]),          # a request object cut short
)


@pytest.fixture(scope="module")
def server():
    """(process, base URL) of `tokenspeed serve` on the tiny-random model."""
    with serve_process("--model", "tiny-random", "--quantize", "none", "--context", "512",
                       "--cache-budget-mb", "50") as running:
        yield running


def check_answer(server, body: bytes) -> None:
    proc, url = server
    r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code < 500, (body, r.status_code, r.text)
    assert proc.poll() is None, body
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"], r.text
        param = error["param"]
        assert param is None or param.split(".")[0] in REQUEST_FIELDS, (body, r.text)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "choices" in chunk or set(chunk.get("error", {})) >= {"message", "type", "param"}, e
            for choice in chunk.get("choices", ()):
                assert choice["finish_reason"] in OPENAI_FINISH | {None}, e
    else:
        assert r.json()["object"] == "chat.completion", r.text
        assert r.json()["choices"][0]["finish_reason"] in OPENAI_FINISH, r.text


def test_non_json_body_names_no_field(server):
    _, url = server
    r = httpx.post(f"{url}/v1/chat/completions", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text


@FAST
@given(body=bodies)
def test_chat_bodies(server, body):
    check_answer(server, body)


@pytest.mark.slow
@SLOW
@given(body=bodies)
def test_chat_bodies_many(server, body):
    check_answer(server, body)
