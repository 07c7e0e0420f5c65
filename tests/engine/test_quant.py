"""Weight-only int8 linears: numerics against fp32, row projection, model swap, real-model calls."""
import pytest
import torch
from torch import nn

import tokenspeed
from tokenspeed.quant import PACKED_ROWS, Int8Linear, linear_rows, quantize


@pytest.mark.parametrize("rows", [1, PACKED_ROWS + 5])  # packed decode kernel and the dequantize path
def test_int8_linear_matches_fp32(rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=True)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 96)
    ref, out = lin(x), q(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 0.02
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (160, 96)


def test_linear_rows_equals_selected_columns():
    torch.manual_seed(0)
    lin = nn.Linear(64, 500, bias=False)
    rows = torch.tensor([3, 17, 499, 0])
    x = torch.randn(2, 64)
    torch.testing.assert_close(linear_rows(lin, x, rows), lin(x)[:, rows])
    q = Int8Linear.from_linear(lin)
    full = x @ q.dequantized().T
    torch.testing.assert_close(linear_rows(q, x, rows), full[:, rows], rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError):
        linear_rows(nn.Identity(), x, rows)


def test_quantize_swaps_every_linear_and_rejects_unknown_mode():
    engine = tokenspeed.Engine.load("tiny-random")
    model = engine.model
    cache, cache_q = model.new_cache(64), None
    tokens = torch.arange(10, 20)
    ref = model(tokens, torch.arange(10), cache, "all")
    quantize(model, "int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    cache_q = model.new_cache(64)
    out = model(tokens, torch.arange(10), cache_q, "all")
    assert (out - ref).norm() / ref.norm() < 0.05
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(model, "int3")


def test_int8_engine_makes_the_same_robot_calls_as_fp32():
    tools = [{"type": "function", "function": {"name": "pick", "description": "Grasp a cube.", "parameters": {
        "type": "object", "properties": {"object": {"type": "string", "enum": ["red_cube", "green_cube", "blue_cube"]}},
        "required": ["object"]}}},
             {"type": "function", "function": {"name": "move_to", "description": "Move the gripper (metres).",
                                               "parameters": {"type": "object", "properties": {
                                                   "x": {"type": "number", "minimum": 0.3, "maximum": 0.7},
                                                   "y": {"type": "number", "minimum": -0.3, "maximum": 0.3}},
                                                   "required": ["x", "y"]}}}]
    prompts = ["The green cube is at x=0.42 y=-0.10. Pick up the green cube.", "Move the gripper to x=0.5 y=0.2."]
    calls = {}
    for mode in (None, "int8"):
        engine = tokenspeed.Engine.load(quantize=mode)
        calls[mode] = []
        for p in prompts:
            s = engine.session(system="You control a robot arm.", tools=tools)
            s.observe(p)
            d = s.decide()
            assert d.status == "ok", d.reason
            calls[mode].append(d.tool_call)
    assert calls["int8"] == calls[None]
