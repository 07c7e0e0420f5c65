"""Runaway guards: no answer runs on to max_tokens inside a value or by repeating a call, and an
answer never takes more than max_tokens.

The patterns are the ones `tool_choice="required"` showed on public function-calling prompts
(issue 27): one call repeated inside the call list, an endless number (`1000000000...`), a string
repeated until the limit, a string in a loop (one unit repeated, or with its numbers counting up).
A tiny random-weight model makes arbitrary choices, so only the grammar's bounds can end its values.
"""
import json
from pathlib import Path

import pytest

from tokenspeed.chat import finish
from tokenspeed.decision import Decision, keep_complete_calls
from tokenspeed.grammar import (CALL_FORMATS, LOOP_MIN_CHARS, MAX_CALLS, MAX_JSON_DEPTH, complete_tool_calls,
                                format_tool_calls, json_closings, looping_string, looping_structure, parse_tool_calls)
from tokenspeed.schema import MAX_ARRAY_ITEMS, MAX_STRING_LENGTH, NUMBER_LIMIT, NUMBER_STEP, prepare


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": "", "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


def test_unbounded_values_get_the_documented_caps():
    schema = prepare({"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number", "minimum": 0.5}, "big": {"type": "integer", "minimum": 10 ** 17},
        "s": {"type": "string"}, "long": {"type": "string", "minLength": 300}, "a": {"type": "array"},
        "e": {"type": "string", "enum": ["a", "b"]}, "own": {"type": "string", "maxLength": 3}}}, "", "t").schema
    p = schema["properties"]
    assert p["n"] == {"type": "integer", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}
    assert p["x"] == {"type": "number", "minimum": 0.5, "maximum": NUMBER_LIMIT, "multipleOf": NUMBER_STEP}
    assert p["big"]["maximum"] == 10 ** 17  # never a range that nothing satisfies
    assert p["s"]["maxLength"] == MAX_STRING_LENGTH and p["long"]["maxLength"] == 300
    assert p["a"]["maxItems"] == MAX_ARRAY_ITEMS
    assert p["e"] == {"type": "string", "enum": ["a", "b"]} and p["own"]["maxLength"] == 3


def test_endless_numbers_and_strings_end_inside_their_bounds(tiny_engine):
    tools = [_tool("f", {"n": {"type": "integer"}, "x": {"type": "number"}, "s": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}}})]
    for i in range(3):
        s = tiny_engine.session(tools=tools)
        s.observe(f"go {i}")
        d = s.decide(max_tokens=600)
        assert d.status == "ok", d.reason
        args = d.tool_call["arguments"]
        assert abs(args["n"]) <= NUMBER_LIMIT and abs(args["x"]) <= NUMBER_LIMIT
        assert len(args["s"]) <= MAX_STRING_LENGTH and len(args["tags"]) <= MAX_ARRAY_ITEMS
        assert d.generated_tokens + d.forced_tokens < 600


@pytest.mark.parametrize("parallel", [False, True])
def test_completion_tokens_never_exceed_max_tokens(tiny_engine, robot_tools, parallel):
    # jump-forward appends forced runs (`"}}]</tool_call>`): they count, and stop at the limit too
    for max_tokens in range(1, 40, 2):
        s = tiny_engine.session(tools=robot_tools)
        s.observe("Pick up the red cube.")
        d = s.decide(max_tokens=max_tokens, parallel=parallel)
        assert d.generated_tokens + d.forced_tokens <= max_tokens, (max_tokens, d.status, d.text)


def test_parallel_calls_are_capped(tiny_engine):
    grammar = tiny_engine.grammar([_tool("beep", {})], "required", parallel=True)
    m = grammar.matcher()
    one = '{"name": "beep", "arguments": {}}'
    text = "<tool_call>[" + ", ".join([one] * MAX_CALLS)
    assert m.consume_tokens(tiny_engine.ll_tokenizer.tokenize_str(text))
    assert not m.consume_tokens(tiny_engine.ll_tokenizer.tokenize_str(", "))  # no call past the cap


CALL = {"name": "move", "arguments": {"x": 1}}
OTHER = {"name": "move", "arguments": {"x": 2}}


def test_complete_tool_calls_of_a_cut_answer():
    text = format_tool_calls([CALL, OTHER])
    assert complete_tool_calls(text) == [CALL, OTHER] == parse_tool_calls(text)
    assert complete_tool_calls(text[:-len("}]</tool_call>")]) == [CALL]
    assert complete_tool_calls('<tool_call>[{"name": "mo') == [] == complete_tool_calls("plain text")


def test_a_repeated_call_ends_the_answer_with_the_calls_before_it():
    d = Decision(status="invalid", text=format_tool_calls([CALL, OTHER, CALL])[:-2])  # stopped at the repeat
    assert keep_complete_calls(d, 40, 256)
    assert d.status == "ok" and d.tool_calls == [CALL, OTHER] and d.text == format_tool_calls([CALL, OTHER])
    assert finish(d, 40, 256)[0] == "tool_calls"
    d = Decision(status="ok", text=format_tool_calls([CALL, CALL]))  # closed after the repeat
    assert keep_complete_calls(d, 30, 256) and d.tool_calls == [CALL]


def test_a_call_list_cut_at_max_tokens_returns_its_complete_calls_as_length():
    d = Decision(status="invalid", reason="no complete call within max_tokens=30",
                 text=format_tool_calls([CALL, OTHER])[:-len("}}]</tool_call>")])
    assert keep_complete_calls(d, 30, 30)
    assert d.status == "ok" and d.tool_calls == [CALL] and d.reason == "max_tokens"
    assert d.finish_reason == "length" and finish(d, 30, 30) == ("length", {
        "reason": "max_tokens", "detail": "the call list was cut at max_tokens"})
    d = Decision(status="invalid", reason="no complete call within max_tokens=5", text='<tool_call>[{"na')
    assert not keep_complete_calls(d, 5, 5) and d.status == "invalid"  # nothing complete: no call
    assert d.finish_reason == "length" == finish(d, 5, 5)[0]  # cut, not a grammar failure


def test_a_repeated_call_in_decoding_ends_the_answer(tiny_engine):
    # One argument-less tool: every call after the first repeats it. Sampled, the random model
    # writes ", " (another call) after the first one on some seeds; the answer then ends there.
    tokens = []
    for seed in range(8):
        s = tiny_engine.session(tools=[_tool("beep", {})])
        s.observe("Beep three times.")
        d = s.decide(parallel=True, max_tokens=200, temperature=1.0, seed=seed)
        assert d.status == "ok" and d.tool_calls == [{"name": "beep", "arguments": {}}], d.text
        assert tiny_engine.tokenizer.decode(s.tokens + s.pending).endswith(format_tool_calls(d.tool_calls) + "<|im_end|>\n")
        tokens.append(d.generated_tokens + d.forced_tokens)
    assert max(tokens) > min(tokens)  # some answer went on past its first call, and was ended at the repeat


# What SmolLM2-135M (int4) wrote under tool_choice="required" with the smollm2 tool listing on two
# questions no tool applies to (labelled cases bfcl_text_32 and bfcl_text_37): each string ran on
# until max_tokens=256.
DNA = '<tool_call>[{"name": "fetch_DNA_sequence", "arguments": {"DNA_id": "'
LOOPS = [(DNA, "); 1; 2; 3}}]</tool_call> 1. 1. 2. 3. 1. 2. 3. 1. 2. 3. 1. 2. 3. 1. 2. 3. 1. 2. 3"),
         ('<tool_call>[{"name": "calculate_molecular_weight", "arguments": {"compound": "',
          "A_compound_name_1_to_a_compound_name_2_to_a_compound_name_3_to_a_compound_name_4_to_a_compound_name_5"),
         (DNA, " " * 40), (DNA, "ATATATATATATATATATATAT"), (DNA, 'say \\"no\\" ' * 6)]


def test_a_string_in_a_loop_is_seen_after_a_few_repeats_and_not_once_it_is_closed():
    for head, value in LOOPS:
        seen = next((i for i in range(len(value) + 1) if looping_string(head + value[:i])), None)
        assert seen is not None and seen <= 3 * LOOP_MIN_CHARS + 20, (value, seen)
        assert not looping_string(head + value[:seen] + '", "format": "')  # the next string starts afresh
    assert not looping_string(DNA + "ATATATATATATATATATATAT" + '"}}]</tool_call>')  # not in a string
    assert not looping_string(DNA + "x" * 40 + "\\")  # inside an escape: a quote would not end the string


def test_no_string_of_the_public_calls_and_tool_sets_looks_like_a_loop():
    # every prefix of every string of the BFCL questions, answers and functions and of the shipped
    # robot and market tool sets, as it would be written inside a call (JSON-escaped)
    data = Path(__file__).resolve().parents[2] / "engine" / "data"

    def strings(x):
        if isinstance(x, str):
            yield x
        for v in x.values() if isinstance(x, dict) else x if isinstance(x, list) else ():
            yield from strings(v)

    texts = set()
    for name in ("bfcl/BFCL_v4_simple_python.json", "bfcl/possible_answer_BFCL_v4_simple_python.json"):
        for line in (data / name).read_text().splitlines():
            texts.update(strings(json.loads(line)))
    for path in (data / "tools").glob("*.json"):
        texts.update(strings(json.loads(path.read_text())))
    assert len(texts) > 3000
    for text in texts:
        value = json.dumps(text)[1:-1]
        hit = next((value[:i] for i in range(1, len(value) + 1) if looping_string(DNA + value[:i])), None)
        assert hit is None, hit


@pytest.mark.slow  # ~60 s of fp32 prefill and decoding on 2 busy cores
def test_a_string_in_a_loop_is_closed_and_the_forced_call_completes(engine):
    # A labelled question whose forced call ran on inside a string to max_tokens (LOOPS above:
    # bfcl_text_37; the fp32 model writes the same loop): the decode loop closes each string where
    # it starts repeating, and the call list completes.
    from tokenspeed.auto import labelled_cases

    case = next(c for c in labelled_cases() if c["id"] == "bfcl_text_37")
    s = engine.session(tools=case["tools"], tool_prompt="smollm2")
    s.observe(case["messages"])
    d = s.decide(tool_choice="required", parallel=True, max_tokens=256)
    assert d.status == "ok" and d.generated_tokens + d.forced_tokens < 256, d.text
    closed = [v for c in d.tool_calls for v in c["arguments"].values() if isinstance(v, str)
              and looping_string(DNA + json.dumps(v)[1:-1])]
    assert closed, d.text  # a string the guard ended


# What SmolLM2-135M wrote under response_format json_object for "Give a JSON object describing a
# cat." (issue 27): one object nested in the next until max_tokens=256, invalid JSON.
CAT = '{"name": "Felix", "age": 10, "looks": ' + '{"cat": {"name": "Felix", "looks": ' * 6


def test_a_structure_in_a_loop_is_seen_after_a_few_repeats_and_closed_as_valid_json():
    seen = next(i for i in range(len(CAT) + 1) if looping_structure(CAT[:i]))
    assert seen <= len('{"name": "Felix", "age": 10, "looks": ') + 4 * len('{"cat": {"name": "Felix", "looks": ')
    for i in range(seen, len(CAT) + 1):  # wherever it shows, each closing ends the answer as valid JSON
        closings = json_closings(CAT[:i])
        assert closings and all(isinstance(json.loads(CAT[:i] + c), dict) for c in closings), CAT[:i]
    assert not looping_structure('{"a": "' + '{"cat": {"name": "Felix", "looks": ' * 4)  # inside a string
    assert not looping_structure("[" * 3 + "1" + "]" * 3)
    deep = "".join(f'{{"k{i}": ' for i in range(MAX_JSON_DEPTH + 1))  # no unit repeats: the depth cap alone
    assert looping_structure(deep) and not looping_structure(deep[:deep.rindex("{")])
    assert json_closings('{"a": [1, {"b": 2, ') == [f'"": {v}}}]}}' for v in ("0", '""', "[]", "{}", "null", "true",
                                                                            "false")]
    assert json_closings('{"a": [1, {"b') == ['": 0}]}', '": ""}]}', '": []}]}', '": {}}]}', '": null}]}',
                                             '": true}]}', '": false}]}']
    assert json_closings('{"a": [') == [']}'] and json_closings('{"a": "x\\"') == ['"}']  # an escaped quote
    assert json_closings('{"a": "x\\\\"') == ['}']  # an escaped backslash, then the closing quote


def test_no_public_call_or_tool_set_looks_like_a_structure_in_a_loop():
    # every prefix of every BFCL answer written as a call in each call format, and of the BFCL
    # functions and the shipped tool sets written as JSON
    data = Path(__file__).resolve().parents[2] / "engine" / "data"
    texts = []
    for line in (data / "bfcl" / "possible_answer_BFCL_v4_simple_python.json").read_text().splitlines():
        calls = [{"name": name, "arguments": {k: v[0] for k, v in args.items()}}
                 for call in json.loads(line)["ground_truth"] for name, args in call.items()]
        texts += [format_tool_calls(calls, fmt) for fmt in CALL_FORMATS.values()]
    for line in (data / "bfcl" / "BFCL_v4_simple_python.json").read_text().splitlines():
        texts.append(json.dumps(json.loads(line)["function"]))
    texts += [json.dumps(json.loads(path.read_text())) for path in (data / "tools").glob("*.json")]
    assert len(texts) > 1000
    for text in texts:
        hit = next((text[:i] for i in range(1, len(text) + 1) if looping_structure(text[:i])), None)
        assert hit is None, hit


@pytest.mark.slow  # ~40 s of fp32 prefill and decoding on 2 busy cores
def test_a_json_object_in_a_loop_is_closed_as_valid_json(engine):
    # The issue-27 repro (CAT above): the answer now ends where its structure starts repeating.
    s = engine.session()
    s.observe([{"role": "user", "content": "Give a JSON object describing a cat."}])
    d = s.decide(response_format={"type": "object"}, max_tokens=256)
    assert d.status == "text" and d.finish_reason == "stop" and d.generated_tokens + d.forced_tokens < 256, d.text
    assert isinstance(json.loads(d.text), dict)
