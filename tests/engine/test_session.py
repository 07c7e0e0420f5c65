"""Sessions on the real model: streaming prefill equivalence, decide/rollback, jump-forward
equivalence, deadlines, schema errors."""
import time

import pytest
import torch

from tokenspeed import SessionAborted, SessionArgumentError, ToolSchemaError
from tokenspeed.bfcl import load_bfcl
from tokenspeed.chat import finish
from tokenspeed.grammar import parse_tool_call

SYSTEM = "You control a robot arm on a table with three cubes."
SCENES = [
    ("Camera: red_cube at x=0.42 y=-0.10; green_cube at x=0.55 y=0.12; blue_cube at x=0.61 y=-0.20.",
     "Goal: pick up the red cube."),
    ("Camera: red_cube at x=0.35 y=0.20; green_cube at x=0.48 y=-0.05; blue_cube at x=0.66 y=0.01.",
     "Goal: pick up the blue cube."),
    ("The arm holds the green cube above the table.", "Goal: place it at x=0.50 y=0.10."),
    ("A person entered the workspace.", "Goal: stop all motion now."),
    ("Joint positions nominal, gripper open.", "Goal: move the gripper to x=0.40 y=0.00 z=0.30."),
]


@pytest.fixture
def plain_engine(engine):
    """The real engine with speculation off (tests that count forwards or compare repeated runs)."""
    saved, engine.speculation = engine.speculation, None
    yield engine
    engine.speculation = saved


def _next_logits(session):
    """Logits of the next token after the session's context, without changing the session."""
    cp = session.checkpoint()
    session._flush()
    probe = session.tok.encode("<|im_start|>assistant\n")
    logits = session._forward(probe)[0].clone()
    session.rollback(cp)
    return logits


def test_streaming_prefill_equals_prefill_at_once(engine, robot_tools):
    incremental = engine.session(system=SYSTEM, tools=robot_tools)
    for scene, goal in SCENES[:3]:
        incremental.observe(scene, kind="sensor", source="camera")
        incremental.observe(goal)
    at_once = engine.session(system=SYSTEM, tools=robot_tools)
    at_once.observe([{"role": "user", "content": t} for pair in SCENES[:3] for t in pair])
    assert incremental.tokens == at_once.tokens
    a, b = _next_logits(incremental), _next_logits(at_once)
    assert (a - b).abs().max().item() < 1e-3
    assert int(a.argmax()) == int(b.argmax())


def test_decide_keeps_call_in_context_and_rollback_restores_it(engine, robot_tools):
    s = engine.session(system=SYSTEM, tools=robot_tools)
    s.observe(" ".join(SCENES[0]))
    cp = s.checkpoint()
    tokens_before, logits_before = list(s.tokens), _next_logits(s)
    first = s.decide()
    assert first.status == "ok", first.reason
    assert first.tool_call == {"name": "pick", "arguments": {"object": "red_cube"}}
    assert s.segments[-1].kind == "assistant"
    rendered = s.tok.decode(s.tokens + s.pending)
    assert rendered.endswith('<tool_call>[{"name": "pick", "arguments": {"object": "red_cube"}}]</tool_call><|im_end|>\n')
    s.rollback(cp)
    assert s.tokens == tokens_before
    assert torch.equal(_next_logits(s), logits_before)
    again = s.decide()
    assert again.tool_call == first.tool_call and again.text == first.text


PREDICTED = "objects blue_cube=(0.59,0.21) green_cube=(0.36,-0.24) red_cube=(0.54,-0.12); gripper empty; pick the red cube"
REAL = PREDICTED.replace("red_cube=(0.54,", "red_cube=(0.50,")  # the red cube moved 4 cm


def _segments(s):
    return [(g.start, g.end, g.kind, g.source, g.pinned) for g in s.segments]


@pytest.mark.parametrize("kv_budget", [None, 1024])
def test_observe_since_keeps_the_common_prefix_and_decides_as_a_fresh_session(engine, robot_tools, kv_budget):
    """A state line predicted on a checkpoint and decided on, then the real one (a cube moved) observed
    `since` that checkpoint: the tokens up to the first differing one keep their KV, only the rest
    is prefilled, and the context, the next logits and the greedy call equal a session that only ever
    saw the real line (full and pruned cache)."""
    def start():
        s = engine.session(system=SYSTEM, tools=robot_tools, kv_budget=kv_budget)
        s.observe(SCENES[3][0], kind="sensor", source="state")
        assert s.decide().status == "ok"   # its answer's tail stays pending: part of what follows cp
        return s

    s = start()
    cp = s.checkpoint()
    s.observe(PREDICTED, kind="sensor", source="state")
    assert s.decide().status == "ok"
    n = s.observe(REAL, kind="sensor", source="state", since=cp)
    fresh = start()
    assert fresh.observe(REAL, kind="sensor", source="state") == n
    predicted = start()
    assert predicted.observe(PREDICTED, kind="sensor", source="state") == n
    old, new = predicted.tokens[-n - len(cp.pending):], fresh.tokens[-n - len(cp.pending):]
    assert s.kept_tokens == next(i for i, (a, b) in enumerate(zip(old, new)) if a != b) - len(cp.pending) > 0
    assert fresh.kept_tokens == 0
    assert (s.tokens, s.pending, _segments(s)) == (fresh.tokens, fresh.pending, _segments(fresh))
    a, b = _next_logits(s), _next_logits(fresh)
    # (< 1e-3 over an fp32 cache; the fp16 one rounds the two histories' ~1e-6-apart entries to
    # values up to one half-float ulp apart: 1.5e-3 measured)
    assert (a - b).abs().max().item() < 5e-3 and int(a.argmax()) == int(b.argmax())
    d, f = s.decide(), fresh.decide()
    assert d.status == f.status == "ok" and d.tool_call == f.tool_call and d.text == f.text
    assert s.tokens + s.pending == fresh.tokens + fresh.pending


def test_observe_since_the_same_line_prefills_nothing_and_a_failed_one_leaves_the_rollback(engine, robot_tools):
    s = engine.session(system=SYSTEM, tools=robot_tools, kv_budget=1024)
    cp = s.checkpoint()
    n = s.observe(PREDICTED, kind="sensor", source="state")
    after, logits = (s.tokens, s.pending, _segments(s)), _next_logits(s)
    s.decide()
    assert s.observe(PREDICTED, kind="sensor", source="state", since=cp) == n and s.kept_tokens == n
    assert (s.tokens, s.pending, _segments(s)) == after and torch.equal(_next_logits(s), logits)
    s.decide()
    with pytest.raises(SessionAborted):
        s.observe(REAL, kind="sensor", source="state", since=cp, abort=lambda: True)
    s2 = engine.session(system=SYSTEM, tools=robot_tools, kv_budget=1024)
    assert (s.tokens, s.pending, _segments(s)) == (s2.tokens, s2.pending, _segments(s2))
    other = engine.session(system=SYSTEM, tools=robot_tools)
    with pytest.raises(SessionArgumentError):
        s.observe(REAL, since=other.checkpoint())


@pytest.mark.parametrize("scene,goal", SCENES)
def test_jump_forward_does_not_change_the_call(engine, robot_tools, scene, goal):
    s = engine.session(system=SYSTEM, tools=robot_tools)
    s.observe(f"{scene} {goal}")
    cp = s.checkpoint()
    fast = s.decide(jump_forward=True)
    s.rollback(cp)
    slow = s.decide(jump_forward=False)
    assert fast.status == slow.status == "ok", (fast.reason, slow.reason)
    assert fast.text == slow.text
    assert fast.tool_call == slow.tool_call
    assert fast.forced_tokens > 0 and slow.forced_tokens == 0
    assert fast.forwards < slow.forwards


@pytest.mark.parametrize("case", load_bfcl("heldout")[:6], ids=lambda c: c["id"])
def test_bfcl_calls_are_schema_valid_with_and_without_jump_forward(engine, case):
    s = engine.session(system="You are a function-calling assistant.", tools=case["tools"])
    s.observe(case["messages"])
    cp = s.checkpoint()
    fast = s.decide(max_tokens=96)
    s.rollback(cp)
    slow = s.decide(max_tokens=96, jump_forward=False)
    assert fast.text == slow.text
    if fast.status == "ok":  # the 135M model may run past max_tokens on long free-text args
        fn = case["tools"][0]["function"]
        assert fast.tool_call["name"] == fn["name"]
        assert set(fn["parameters"].get("required", [])) <= set(fast.tool_call["arguments"])
    else:
        assert fast.status == "invalid" and fast.tool_call is None


def test_deadline_expires_mid_decode(plain_engine, robot_tools):
    s = plain_engine.session(system=SYSTEM, tools=robot_tools)
    s.observe(" ".join(SCENES[4]))
    n_before = s.num_tokens
    probe = s.checkpoint()
    full = s.decide(jump_forward=False)  # ~30 forwards
    s.rollback(probe)
    assert full.status == "ok" and full.forwards > 10
    # A deadline a few forwards after the first token: the decode must stop and say so.
    d = s.decide(jump_forward=False, deadline=full.ttft_s + 3 * min(full.itl_s))
    assert d.status == "deadline_missed"
    assert d.tool_call is None
    assert 0 < d.forwards < full.forwards
    assert s.num_tokens == n_before  # rolled back: no half call left in the context
    assert s.decide(deadline_at=time.monotonic() - 1).status == "deadline_missed"


def test_named_tool_choice_and_auto(engine, robot_tools):
    s = engine.session(system=SYSTEM, tools=robot_tools)
    s.observe(" ".join(SCENES[0]))
    cp = s.checkpoint()
    d = s.decide(tool_choice={"name": "hold"})
    assert d.status == "ok" and d.tool_call == {"name": "hold", "arguments": {}}
    s.rollback(cp)
    allowed = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": n}} for n in ("place", "stop")]}}
    d = s.decide(tool_choice=allowed)
    assert d.status == "ok" and d.tool_call["name"] in ("place", "stop")
    s.rollback(cp)
    d = s.decide(tool_choice="auto", max_tokens=40)
    assert d.status in ("ok", "text", "invalid")
    if d.status == "text":
        assert not d.text.startswith("<") and d.tool_call is None


def test_auto_weighs_every_way_of_opening_a_call_and_threshold_one_answers_in_text(engine, robot_tools):
    # p(call) sums the family's opener and a call written as bare JSON or in a code fence; the
    # call branch itself stays the family's format
    g = engine.grammar(robot_tools, "auto")
    ids = {t: engine.tokenizer.encode_text(t) for t in ("<", "```", "{", "[", "The", " {")}
    assert all(len(v) == 1 for v in ids.values())
    ids = {t: v[0] for t, v in ids.items()}
    assert (g.call_evidence | g.call_start).equal(g.call_evidence)
    assert [t for t, i in ids.items() if g.call_evidence[i]] == ["<", "```", "{", "["]
    assert [t for t, i in ids.items() if g.call_start[i]] == ["<"]
    s = engine.session(system=SYSTEM, tools=robot_tools)
    s.observe([{"role": "user", "content": "Pick up the red cube."}])
    cp = s.checkpoint()
    d = s.decide(tool_choice="auto", max_tokens=40, auto_threshold=0.0)
    assert d.status == "ok" and d.text.startswith("<tool_call>") and 0 < d.p_call < 1
    s.rollback(cp)
    d = s.decide(tool_choice="auto", max_tokens=8, auto_threshold=1.0)
    assert d.status == "text" and d.text[:1] not in ("<", "") and d.tool_call is None


def test_invalid_when_max_tokens_too_small(engine, robot_tools):
    s = engine.session(system=SYSTEM, tools=robot_tools)
    s.observe(" ".join(SCENES[4]))
    n = s.num_tokens
    d = s.decide(max_tokens=3, jump_forward=False)
    assert d.status == "invalid" and "max_tokens" in d.reason and s.num_tokens == n
    # cut, not a grammar failure: finish "length", as the server says (issue 27)
    assert d.cut and d.finish_reason == "length" and finish(d, 3, 3)[0] == "length"
    assert d.openai_message() == {"role": "assistant", "content": None}


def test_parse_tool_call_rejects_partial_output():
    assert parse_tool_call('<tool_call>[{"name": "pick", "arguments": {"object": "red_cube"}}]</tool_call>') == \
        {"name": "pick", "arguments": {"object": "red_cube"}}
    assert parse_tool_call('<tool_call>[{"name": "pick", "arguments": {"obj') is None
    assert parse_tool_call("pick the red cube") is None


@pytest.mark.parametrize("tools,needle", [
    ("pick", "must be a list"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "name 'bad name!'"),
    ([{"name": "a"}, {"name": "a"}], "duplicate tool name 'a'"),
    ([{"name": "grip", "parameters": {"type": "string"}}], "tool 'grip': parameters must be"),
    ([{"name": "grip", "parameters": {"type": "object", "properties": {"f": {"type": "number"}},
                                      "required": ["force"]}}], "required parameter 'force'"),
    ([{"name": "grip", "parameters": {"type": "object", "properties": {"f": {"type": "numbr"}}}}], "tool 'grip'"),
    ([{"name": "grip", "parameters": {"type": "object", "properties": {"f": {"$ref": "#/nowhere"}}}}], "tool 'grip'"),
])
def test_bad_schemas_fail_at_session_with_the_bad_part_named(tiny_engine, tools, needle):
    with pytest.raises(ToolSchemaError, match=needle):
        tiny_engine.session(tools=tools)


def test_bad_tool_choice(tiny_engine, robot_tools):
    s = tiny_engine.session(tools=robot_tools)
    with pytest.raises(ToolSchemaError, match="unknown tool 'fly'"):
        s.decide(tool_choice={"name": "fly"})
    with pytest.raises(ToolSchemaError, match="tool_choice must be"):
        s.decide(tool_choice="sometimes")
    with pytest.raises(ToolSchemaError, match="unknown tool 'fly'"):
        s.decide(tool_choice={"type": "allowed_tools", "allowed_tools": {"tools": ["pick", "fly"]}})
    with pytest.raises(ToolSchemaError, match="non-empty tools list"):
        s.decide(tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}})
    with pytest.raises(ToolSchemaError, match="needs tools"):
        tiny_engine.session().decide()


def test_a_deadline_that_is_not_positive_is_refused(tiny_engine, robot_tools):
    s = tiny_engine.session(tools=robot_tools)
    s.observe("anything")
    n = s.num_tokens
    for deadline in (-1, 0, 0.0, -1e-9, float("nan")):
        with pytest.raises(SessionArgumentError, match="deadline must be"):
            s.decide(deadline=deadline)
    assert s.num_tokens == n  # refused before any work


def test_tiny_random_model_still_gives_schema_valid_calls(tiny_engine, robot_tools):
    s = tiny_engine.session(tools=robot_tools)
    s.observe("anything")
    d = s.decide(max_tokens=128)
    if d.status == "ok":  # random weights: a valid call, or honestly "invalid" when numbers run long
        assert d.tool_call["name"] in {t["function"]["name"] for t in robot_tools}
    else:
        assert d.status == "invalid" and d.tool_call is None


def test_the_grammar_tokenizer_is_built_once_by_the_first_session_with_tools(robot_tools, monkeypatch):
    # not by the load: a model used without tools never builds it; then once, whichever threads ask
    import threading

    import tokenspeed
    import tokenspeed.engine

    builds = []
    real = tokenspeed.engine.grammar_tokenizer

    def counted(tok):  # the real build, counted
        builds.append(threading.get_ident())
        return real(tok)

    monkeypatch.setattr(tokenspeed.engine, "grammar_tokenizer", counted)
    engine = tokenspeed.Engine.load("tiny-random")
    engine.session(system="plain text")
    assert builds == []
    got = []
    threads = [threading.Thread(target=lambda: got.append(engine.ll_tokenizer)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(got) == 4 and all(g is got[0] for g in got)
    engine.session(tools=robot_tools).decide(max_tokens=4)
    assert len(builds) == 1

    fresh = tokenspeed.Engine.load("tiny-random")
    s = fresh.session(tools=robot_tools)
    assert len(builds) == 2  # the session built it, before any decision
    s.observe("anything")
    assert s.decide(max_tokens=16).status in ("ok", "invalid") and len(builds) == 2


def test_generate_greedy_and_seeded_sampling(plain_engine):
    prompt = "What is the capital of France? Answer in one word."
    a = plain_engine.generate(prompt, max_tokens=12)
    b = plain_engine.generate(prompt, max_tokens=12)
    assert a == b and "Paris" in a
    s1 = plain_engine.generate(prompt, max_tokens=12, temperature=0.9, top_p=0.9, seed=3)
    s2 = plain_engine.generate(prompt, max_tokens=12, temperature=0.9, top_p=0.9, seed=3)
    assert s1 == s2
    pieces = []
    streamed = plain_engine.generate(prompt, max_tokens=12, on_token=pieces.append)
    assert "".join(pieces) == streamed == a


def test_observe_rejects_bad_content(tiny_engine):
    s = tiny_engine.session()
    with pytest.raises(TypeError):
        s.observe(42)
    with pytest.raises(TypeError):
        s.observe([{"role": "user"}])


def test_a_call_that_overflows_the_kv_cache_raises_and_leaves_the_session_as_it_was(tiny_engine, robot_tools):
    """generate() and decide() past the KV capacity raise ValueError and roll the session back:
    the same cached tokens, pending observations and segments, so a smaller call still works."""
    s = tiny_engine.session(tools=robot_tools, capacity=len(tiny_engine.session(tools=robot_tools).tokens) + 40)
    s.observe("The red cube is at x=0.42 y=-0.10.")
    before = (s.tokens, list(s.pending), [(g.start, g.end, g.kind) for g in s.segments])
    for call in (lambda: s.generate("Count from one to one hundred, slowly, one number per line.", max_tokens=200),
                 lambda: s.decide(max_tokens=200)):
        with pytest.raises(ValueError, match="KV cache full|context full"):
            call()
        assert (s.tokens, list(s.pending), [(g.start, g.end, g.kind) for g in s.segments]) == before
    assert s.generate("Hi", max_tokens=2) is not None  # the context still has room for a short reply
