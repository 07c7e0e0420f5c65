"""`tokenspeed serve` under hostile and abandoned requests, through a real server process and the
official `openai` client (tiny-random model; the server's defaults otherwise: context 4096,
queue 8). Every request that should be refused is refused before it reaches the engine (the
engine's counters do not move), in OpenAI's error shapes; a request nobody waits for any more
is dropped from the queue or stopped between forwards. Timings are printed (run with -s), never
asserted beyond "before the engine could have answered" and /health's slowest answer under a bound
twenty times its target (`check_health`; the target is `tokenspeed bench serve`'s)."""
import json
import socket
import threading
import time

import pytest
from support import serve_process
from tokenspeed.bench.serve import HealthProbe

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

U = [{"role": "user", "content": "Tell a long story about a robot."}]


def _tool(name: str, description: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}


TOOLS_128 = [_tool(f"tool_{i}", f"Tool number {i}: " + "moves the arm along a careful path. " * 12)
             for i in range(128)]
TOOL_50KB = [_tool("describe", "word " * 10_000)]


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "number"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.fixture(scope="module")
def server():
    """(process, base URL) of `tokenspeed serve --model tiny-random` with the default context and queue."""
    with serve_process("--model", "tiny-random", "--quantize", "none", "--cache-budget-mb", "100") as running:
        yield running


@pytest.fixture(scope="module")
def url(server):
    return server[1]


@pytest.fixture()
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus samples, name{labels} -> value."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def engine_work(url: str) -> float:
    """Sessions the engine took from its cache or started: unchanged when no request reached a session."""
    m = metrics(url)
    return m["tokenspeed_cache_hits"] + m["tokenspeed_cache_misses"]


HEALTH_BOUND_S = 1.0  # asserted: a loop blocked by request work (e.g. tokenizing on it) takes seconds


def check_health(probe: HealthProbe) -> str:
    """Assert every probe answered 200 within `HEALTH_BOUND_S` (the 50 ms target is `tokenspeed bench
    serve`'s to check); return the figures as text."""
    assert probe.times and -1.0 not in probe.times
    assert probe.worst < HEALTH_BOUND_S, f"slowest /health {probe.worst * 1e3:.0f} ms"
    return probe.describe()


@pytest.mark.parametrize("tools,messages", [
    (TOOLS_128, U),
    (TOOL_50KB, U),
    (None, [{"role": "user", "content": f"note {i}"} for i in range(2000)]),
], ids=["128 tools", "50 KB description", "2000 messages"])
def test_over_length_is_refused_before_any_prefill(client, url, tools, messages):
    before = engine_work(url)
    extra = {"tools": tools} if tools else {}
    raw = json.dumps({"messages": messages, **extra}).encode()
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    print(f"refused in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tokenspeed", messages=messages, **extra)
    err = info.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages" and "4096" in err["message"]
    with pytest.raises(openai.BadRequestError):  # a stream is refused the same way, before it starts
        client.chat.completions.create(model="tokenspeed", messages=messages, stream=True, **extra)
    assert engine_work(url) == before
    # the pooled connection still serves the next request
    r = client.chat.completions.create(model="tokenspeed", messages=U, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_max_tokens_beyond_the_context_names_max_tokens(url):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": U, "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,param", [
    (b'{"messages": [{"role": "user", "content": "lone \\ud800 surrogate"}]}', "messages.0.content"),
    (json.dumps({"messages": U, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": _deep_schema(350)}}]}).encode(), "tools"),
    (json.dumps({"messages": U, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": _deep_schema(100)}}}).encode(), "response_format"),
], ids=["lone surrogate", "schema 700 deep", "response schema 200 deep"])
def test_bad_unicode_and_deep_schemas_are_400s(url, body, param, stream):
    if stream:
        body = body.replace(b'{"messages"', b'{"stream": true, "messages"', 1)
    before = engine_work(url)
    r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert engine_work(url) == before


def test_body_over_the_limit_is_413(url):
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (20 << 20),
                   headers={"content-type": "application/json"}, timeout=60)
    print(f"20 MB body: {r.status_code} in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_fifty_concurrent_over_length_requests(url):
    """All refused without touching the engine; /health keeps answering meanwhile."""
    before = engine_work(url)
    statuses = []
    raw = json.dumps({"messages": U, "tools": TOOL_50KB}).encode()  # encoded once: the server is timed, not the client
    clients = [httpx.Client(timeout=60) for _ in range(50)]
    ready = threading.Barrier(51)

    def send(c: httpx.Client):
        ready.wait()
        statuses.append(c.post(f"{url}/v1/chat/completions", content=raw,
                               headers={"content-type": "application/json"}).status_code)

    workers = [threading.Thread(target=send, args=(c,)) for c in clients]
    with HealthProbe(url) as health:
        for w in workers:
            w.start()
        ready.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        total = time.perf_counter() - t0
    for c in clients:
        c.close()
    print(f"50 over-length requests refused in {total * 1e3:.0f} ms; {check_health(health)}")
    assert statuses == [400] * 50
    assert engine_work(url) == before


def test_max_tokens_inside_a_call_is_length(client):
    r = client.chat.completions.create(model="tokenspeed", messages=U, tools=[_tool("move", "Move.")],
                                       tool_choice="required", max_tokens=2)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.model_extra["tokenspeed_finish"]["reason"] == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_that_cannot_be_met_never_reaches_the_engine(client, url, stream):
    before = engine_work(url)
    cold = [{"role": "user", "content": " ".join(f"reading {j}: x={j * 0.01:.2f}" for j in range(120))}]
    r = client.chat.completions.create(model="tokenspeed", messages=cold, max_tokens=5, stream=stream,
                                       extra_body={"deadline_ms": 1})
    if stream:  # a stream all the same: the role, then the finish
        chunks = list(r)
        assert all(not c.choices[0].delta.content for c in chunks)
        choice = chunks[-1].choices[0]
    else:
        choice = r.choices[0]
        assert choice.message.content is None
    assert choice.finish_reason == "length" and choice.model_extra["tokenspeed_finish"]["reason"] == "deadline"
    assert engine_work(url) == before


def _long_request(url: str, box: dict, **extra) -> threading.Thread:
    def run():
        t = time.perf_counter()
        box["response"] = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                                     json={"messages": U, "max_tokens": 1500, **extra})
        box["took"] = time.perf_counter() - t

    worker = threading.Thread(target=run)
    worker.start()
    return worker


def _wait_for_depth(url: str, depth: int) -> None:
    while metrics(url)["tokenspeed_queue_depth"] < depth:
        time.sleep(0.02)


def _wait_for_metric(url: str, key: str, value: float) -> None:
    """Poll /metrics until `key` reaches `value` (30 s at most): the engine thread counts a dropped or
    cancelled request when it reaches or stops it, which may be after the test has its answer."""
    deadline = time.monotonic() + 30
    while metrics(url).get(key, 0.0) < value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(url)[key] == value


def test_deadline_passing_in_the_queue_answers_at_once(url):
    """A request with a 300 ms deadline admitted behind a 1,500-token answer (seconds of work) is dropped
    from the queue when the deadline passes, before the answer ahead is done: finish "length", reason
    "deadline" (not "cancelled": the server's timer may fire a millisecond before the deadline), and the
    engine never takes it. Admission is made to let it in: short answers first pull the server's
    answer-length estimate down to a few dozen tokens, so the answer ahead is estimated far under the
    600 ms that would refuse a 300 ms deadline."""
    for _ in range(10):
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": U, "max_tokens": 3},
                          timeout=120).status_code == 200
    long: dict = {}
    before = engine_work(url)
    worker = _long_request(url, long)
    while engine_work(url) == before and worker.is_alive():  # until the engine has taken it
        time.sleep(0.01)
    assert engine_work(url) != before, long.get("response")
    ahead = metrics(url)["tokenspeed_queue_ahead_seconds"]
    key = 'tokenspeed_dropped_total{why="queue"}'
    dropped = metrics(url).get(key, 0.0)
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": U, "max_tokens": 3, "deadline_ms": 300},
                   timeout=120)
    waited = time.perf_counter() - t0
    worker.join()
    print(f"queued request with deadline 300 ms (ahead: estimated {ahead * 1e3:.0f} ms) answered after "
          f"{waited * 1e3:.0f} ms; the answer ahead took {long['took'] * 1e3:.0f} ms")
    assert ahead >= 0.0  # the answer ahead past its estimate counts nothing, not less
    assert r.status_code == 200, (r.status_code, r.text, ahead)
    assert long["response"].status_code == 200 and waited < long["took"]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["tokenspeed_finish"]["reason"] == "deadline"
    _wait_for_metric(url, key, dropped + 1)  # the engine skipped it


def test_a_request_running_past_its_estimate_adds_no_wait(tiny_engine):
    """`Server.ahead_s` (admission's and Retry-After's estimate): a request the engine has run for 1 s on
    an estimate of 10 ms counts 0, not -0.99 s, beside a queued one of 0.5 s. (Tickets set by hand:
    no request overruns its estimate on cue.)"""
    from tokenspeed.serve import Server, Ticket

    server = Server(tiny_engine, "tokenspeed", context=512)
    running, queued = Ticket(None, 0.01), Ticket(None, 0.5)
    assert running.start()
    running.started -= 1.0
    server.tickets.update({running, queued})
    assert server.ahead_s() == 0.5 and server.retry_after() == 1


def _hang_up_mid_answer(url: str, body: dict) -> None:
    """POST `body` on a connection of its own and hang up once the engine is answering it: a stream
    after its first text chunk; otherwise once the engine has taken the request's session
    (`engine_work` moved). Not after a fixed time: on a loaded machine the engine thread can start
    later than that, and the request is then (rightly) dropped from the queue instead."""
    if body.get("stream"):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    return
        pytest.fail("the stream ended before its first text chunk")
    before = engine_work(url)
    raw = json.dumps(body).encode()
    with socket.create_connection((httpx.URL(url).host, httpx.URL(url).port)) as conn:  # plain HTTP/1.1
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
        while engine_work(url) == before:
            time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnected_client_stops_its_answer(url, stream):
    """The client hangs up mid-answer: the engine stops within a step and the next request does not wait
    for the abandoned answer (its wait is printed, beside the abandoned answer's full length)."""
    ref = httpx.post(f"{url}/v1/chat/completions", json={"messages": U, "max_tokens": 1500}, timeout=120).json()
    full = ref["tokenspeed"]["total_ms"] / 1e3
    key = 'tokenspeed_dropped_total{why="cancelled"}'
    cancelled = metrics(url).get(key, 0.0)
    _hang_up_mid_answer(url, {"messages": U, "max_tokens": 1500, "stream": stream})
    t0 = time.perf_counter()  # hung up: the next request's wait
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": U, "max_tokens": 2}, timeout=120)
    waited = time.perf_counter() - t0
    print(f"stream={stream}: next request answered after {waited * 1e3:.0f} ms; the abandoned answer alone "
          f"takes {full * 1e3:.0f} ms")
    assert r.status_code == 200
    _wait_for_metric(url, key, cancelled + 1)


def test_full_queue_is_429_at_once_with_retry_after(url):
    """20 concurrent long requests on a queue of 8: the ones beyond it are refused before any is answered."""
    results = []

    def send():
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": U, "max_tokens": 600}, timeout=120)
        results.append((time.perf_counter(), r))

    workers = [threading.Thread(target=send) for _ in range(20)]
    with HealthProbe(url) as health:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    refused = [(t, r) for t, r in results if r.status_code == 429]
    answered = [(t, r) for t, r in results if r.status_code == 200]
    print(f"{len(refused)} x 429, {len(answered)} x 200; {check_health(health)}")
    assert len(refused) + len(answered) == 20 and len(refused) >= 1 and len(answered) >= 9
    for _, r in refused:
        assert r.json()["error"]["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
    assert max(t for t, _ in refused) < min(t for t, _ in answered)  # refused before the first answer came


def test_a_disconnected_client_is_dropped_from_the_queue(url):
    """A request whose client hangs up while it waits never reaches the engine."""
    long: dict = {}
    worker = _long_request(url, long)
    _wait_for_depth(url, 1)
    key = 'tokenspeed_dropped_total{why="queue"}'
    dropped = metrics(url).get(key, 0.0)
    with pytest.raises(httpx.ReadTimeout):  # queued behind the long answer, then hung up
        httpx.post(f"{url}/v1/chat/completions", json={"messages": U, "max_tokens": 3},
                   timeout=httpx.Timeout(120, read=0.3))
    worker.join()
    assert long["response"].status_code == 200
    _wait_for_metric(url, key, dropped + 1)


# -- faults no request can cause: the engine raising something unexpected (a fake, in process) --

@pytest.fixture()
def faulty_app(tiny_engine, monkeypatch):
    """The app over a real `Server` whose `ChatEngine.complete` raises RuntimeError (a fake fault:
    no request reaches such an error on purpose)."""
    from starlette.testclient import TestClient

    from tokenspeed.serve import Server, create_app

    server = Server(tiny_engine, "tokenspeed", context=512)

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(server.chat, "complete", broken)
    with TestClient(create_app(server), raise_server_exceptions=False) as test_client:
        yield test_client


def test_unexpected_error_is_an_openai_500(faulty_app):
    r = faulty_app.post("/v1/chat/completions", json={"messages": U, "max_tokens": 2})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "server_error" and "RuntimeError" in r.json()["error"]["message"]


def test_stream_that_fails_ends_with_an_error_event_then_done(faulty_app):
    r = faulty_app.post("/v1/chat/completions", json={"messages": U, "max_tokens": 2, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=faulty_app, max_retries=0)
    with pytest.raises(openai.APIError, match="internal error"):  # the client raises the error, not a protocol error
        list(client.chat.completions.create(model="tokenspeed", messages=U, max_tokens=2, stream=True))


@pytest.mark.parametrize("status, reason, tokens, expect", [
    ("ok", "", 5, ("tool_calls", "tool_calls")),
    ("text", "", 5, ("stop", "stop")),
    ("text", "max_tokens", 8, ("length", "max_tokens")),
    ("invalid", "no complete call within max_tokens=8", 8, ("length", "max_tokens")),
    ("deadline_missed", "deadline passed after 3 tokens", 3, ("length", "deadline")),
    ("invalid", "non-finite logits", 2, ("content_filter", "invalid")),
])
def test_finish_reasons_are_openais_with_ours_beside(status, reason, tokens, expect):
    from tokenspeed import Decision
    from tokenspeed.chat import FINISH_REASONS, finish

    finish_reason, detail = finish(Decision(status=status, reason=reason), tokens, 8)
    assert finish_reason in FINISH_REASONS and (finish_reason, detail["reason"]) == expect
    assert detail["detail"] == reason
