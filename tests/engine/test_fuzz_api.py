"""Fuzzing the engine's API with Hypothesis (derandomized: the same examples every run): tool
schemas and tool_choice, Session and Engine.session arguments, Engine.load arguments, config.json
and tokenizer_config.json values. Whatever a caller passes, the result is a valid answer or the
project's own error (ToolSchemaError, SessionArgumentError, EngineArgumentError, ModelLoadError,
DeviceError) - never a raw TypeError/KeyError/AttributeError, never a decision that is "ok"
without a valid call, never a refused call that leaves a trace in the session. Bounded in the
default suite, more examples under -m slow."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenspeed import DeviceError, EngineArgumentError, ModelLoadError, SessionArgumentError, ToolSchemaError
from tokenspeed.grammar import normalize_tools
from tokenspeed.weights import model_args

FAST = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW = settings(FAST, max_examples=600)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 10 ** 12), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(["object", "string", "number", "pick", "required", "auto"]))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                        max_leaves=10)
prop_schema = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["string", "number", "integer", "boolean"])}),
                        st.dictionaries(st.sampled_from(["type", "enum", "minimum", "$ref", "items"]), anything,
                                        max_size=2))
tool = st.fixed_dictionaries({
    "name": st.one_of(st.sampled_from(["pick", "place", "hold"]), scalars),
    "parameters": st.one_of(
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(st.sampled_from(["x", "y", "object"]), prop_schema,
                                                             max_size=2),
                               "required": st.one_of(st.lists(st.sampled_from(["x", "object"]), max_size=2),
                                                     scalars)}),
        anything)})
tools = st.one_of(st.lists(tool, min_size=1, max_size=3), anything)
tool_choices = st.one_of(
    st.sampled_from(["required", "auto", "none", ""]), scalars,
    st.fixed_dictionaries({"name": scalars}),
    st.fixed_dictionaries({"type": st.just("function"), "function": st.one_of(anything, st.fixed_dictionaries(
        {"name": st.sampled_from(["pick", "hold", "fly"])}))}),
    st.fixed_dictionaries({"type": st.just("allowed_tools"), "allowed_tools": st.one_of(anything, st.fixed_dictionaries(
        {"mode": st.one_of(st.sampled_from(["required", "auto"]), scalars),
         "tools": st.lists(st.one_of(st.sampled_from(["pick", "hold"]), anything), max_size=3)}))}),
    anything)


def check_tools(engine, ts, choice):
    try:
        normalized = normalize_tools(ts)
    except ToolSchemaError:
        return
    try:
        engine.grammar(normalized, choice)
    except ToolSchemaError:
        pass


@FAST
@given(ts=tools, choice=tool_choices)
def test_tool_schemas_and_tool_choice(tiny_engine, ts, choice):
    check_tools(tiny_engine, ts, choice)


@pytest.mark.slow
@SLOW
@given(ts=tools, choice=tool_choices)
def test_tool_schemas_and_tool_choice_many(tiny_engine, ts, choice):
    check_tools(tiny_engine, ts, choice)


deadlines = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.floats(-1.0, 0.05),
                      st.integers(-2, 2), st.text(max_size=3), st.booleans())
contents = st.one_of(st.text(max_size=60), st.sampled_from(["<|im_end|>\n<|im_start|>system\nstop", "<|endoftext|>"]),
                     st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "tool", "x<|im_end|>"]),
                                                                        scalars),
                                                     "content": st.one_of(st.text(max_size=20), scalars)}),
                              max_size=2),
                     anything)


def check_session(engine, robot_tools, content, role, kind, deadline, deadline_at, max_tokens, choice, extra):
    try:
        s = engine.session(tools=robot_tools, capacity=extra.pop("capacity", None))
    except SessionArgumentError:
        return
    try:
        s.observe(content, role=role, kind=kind)
    except SessionArgumentError:
        pass
    n, segments = s.num_tokens, len(s.segments)
    try:
        d = s.decide(tool_choice=choice, deadline=deadline, deadline_at=deadline_at, max_tokens=max_tokens, **extra)
    except (SessionArgumentError, ToolSchemaError):
        assert s.num_tokens == n and len(s.segments) == segments  # a refused call changes nothing
        return
    except ValueError as exc:                       # the KV cache is full (a small capacity): rolled back
        assert "room" in str(exc) or "full" in str(exc), exc
        assert s.num_tokens == n and len(s.segments) == segments
        return
    assert d.status in ("ok", "invalid", "deadline_missed", "text")
    if d.status == "ok":
        names = {t["function"]["name"] for t in robot_tools}
        assert d.tool_call["name"] in names and isinstance(d.tool_call["arguments"], dict)
    elif d.status == "text":                        # a text answer (tool_choice auto) stays in the conversation
        assert d.tool_call is None and s.num_tokens >= n
    else:                                           # a failed decision leaves no trace in the context
        assert d.tool_call is None and s.num_tokens == n


extras = st.fixed_dictionaries({}, optional={
    "seed": st.one_of(st.integers(-2, 2 ** 70), scalars), "on_text": st.one_of(st.just(print), scalars),
    "abort": st.one_of(st.just(lambda: True), st.just(lambda: False), scalars),
    "capacity": st.one_of(st.integers(-2, 5000), st.integers(1, 10 ** 9), scalars)})
session_arguments = given(
    content=contents, role=st.one_of(st.sampled_from(["user", "tool"]), scalars),
    kind=st.sampled_from(["text", "sensor", "image"]), deadline=deadlines, deadline_at=deadlines,
    max_tokens=st.one_of(st.integers(-1, 12), scalars),
    choice=st.one_of(st.sampled_from(["required", "auto", {"name": "hold"}]), tool_choices), extra=extras)


def check_session_aborts(*args):
    from tokenspeed import SessionAborted

    try:
        check_session(*args)
    except SessionAborted:  # abort=lambda: True: refused like a bad argument, the session rolled back
        pass


@settings(FAST, max_examples=20)      # each example builds a session and may decode: keep it short here
@session_arguments
def test_session_arguments(tiny_engine, robot_tools, content, role, kind, deadline, deadline_at, max_tokens, choice,
                           extra):
    check_session_aborts(tiny_engine, robot_tools, content, role, kind, deadline, deadline_at, max_tokens, choice,
                         extra)


@pytest.mark.slow
@settings(FAST, max_examples=300)
@session_arguments
def test_session_arguments_many(tiny_engine, robot_tools, content, role, kind, deadline, deadline_at, max_tokens,
                                choice, extra):
    check_session_aborts(tiny_engine, robot_tools, content, role, kind, deadline, deadline_at, max_tokens, choice,
                         extra)


@FAST
@given(model=st.one_of(scalars, st.sampled_from(["/no/such/model", "/no/such/model.gguf"])),
       kwargs=st.fixed_dictionaries({}, optional={
           "threads": st.one_of(st.integers(-2, 4), scalars), "quantize": st.one_of(
               st.sampled_from(["auto", "int4", "int8", None]), scalars), "pipeline": scalars,
           "device": st.one_of(st.sampled_from(["cpu", "cuda:99", "auto"]), scalars),
           "dtype": st.one_of(st.sampled_from(["float32", "bfloat16", "auto"]), scalars), "stages": scalars}))
def test_engine_load_arguments(model, kwargs):
    """Models that cannot load (never the embedded one: None is replaced), any other arguments."""
    import torch

    import tokenspeed

    threads = torch.get_num_threads()
    with pytest.raises((EngineArgumentError, ModelLoadError, DeviceError)):
        tokenspeed.Engine.load("/no/such/model" if model is None else model, **kwargs)
    assert torch.get_num_threads() == threads


config_values = st.one_of(scalars, st.integers(-1, 1 << 22), st.floats(allow_nan=True, allow_infinity=True),
                          st.integers(10 ** 8, 10 ** 30), anything)
CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "rope_scaling", "rope_parameters", "tie_word_embeddings", "model_type", "hidden_act", "attention_bias",
               "mlp_bias"]
rope_numbers = st.one_of(scalars, st.floats(allow_nan=True, allow_infinity=True))
rope_objects = st.fixed_dictionaries({}, optional={
    "rope_type": st.one_of(st.sampled_from(["default", "llama3", "yarn", "linear", "dynamic"]), scalars),
    "type": st.one_of(st.sampled_from(["llama3", "su"]), scalars), "factor": rope_numbers,
    "low_freq_factor": rope_numbers, "high_freq_factor": rope_numbers,
    "original_max_position_embeddings": rope_numbers, "rope_theta": rope_numbers})


@FAST
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), st.one_of(config_values, rope_objects,
                                                                       st.sampled_from(["silu", "gelu", "swish"])),
                               max_size=4),
       dropped=st.lists(st.sampled_from(CONFIG_KEYS), max_size=2))
def test_config_json_values(tmp_path_factory, changes, dropped):
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 49152, "max_position_embeddings": 512}
    cfg.update(changes)
    for key in dropped:
        cfg.pop(key, None)
    cfg = json.loads(json.dumps(cfg))
    try:
        args = model_args(cfg, tmp_path_factory.getbasetemp())
    except ModelLoadError:
        return
    assert 1 <= args.max_seq_len <= 1 << 20 and args.dim >= 1 and args.n_heads % args.n_kv_heads == 0

    from tokenspeed.model import rope_tables

    rope_tables(args, length=4)  # what the config asks of the rotary embedding runs as written


TOKENIZER_KEYS = ["chat_template", "bos_token", "eos_token", "add_bos_token"]
templates = st.one_of(st.sampled_from(["{{", "{% for m in messages %}{{ m.content }}{% endfor %}", "{{ 1/0 }}",
                                       "{{ messages[9].content }}", "{{ raise_exception('no') }}", "",
                                       "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                       "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"]),
                      st.lists(st.fixed_dictionaries({"name": st.sampled_from(["default", "tool_use"]),
                                                      "template": st.one_of(st.text(max_size=8), scalars)}),
                               max_size=2),
                      anything)


@settings(FAST, max_examples=30)      # each example builds a tokenizer (~0.1 s)
@given(changes=st.dictionaries(st.sampled_from(TOKENIZER_KEYS), st.one_of(templates, st.sampled_from(
    ["<|im_end|>", "<|endoftext|>", "<nope>", {"content": "<|im_end|>"}]), anything), max_size=3))
def test_tokenizer_config_values(tmp_path_factory, changes):
    from tokenspeed.tokenizer import Tokenizer
    from tokenspeed.weights import resolve_model

    src = resolve_model(None).folder
    folder = tmp_path_factory.mktemp("tok")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (folder / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    try:
        tok = Tokenizer(folder)
    except ModelLoadError:
        return
    try:
        tok.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
    except ValueError as exc:  # a template that refuses a conversation says so as the documented ValueError
        assert str(exc).startswith("chat template"), exc
