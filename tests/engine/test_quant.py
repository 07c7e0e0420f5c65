"""Weight-only int8/int4 linears: numerics against fp32, the int4 layout for torch's CUDA kernel,
row projection, model swap, real-model calls."""
import pytest
import torch
from torch import nn

import tokenspeed
from support import decide_each
from tokenspeed.model import Transformer
from tokenspeed.quant import (PACKED_ROWS, Int4Linear, Int4TinygemmLinear, Int8Embedding, Int8Linear, linear_bytes,
                              linear_rows, q4_1_groups, quantize)


@pytest.mark.parametrize("rows", [1, PACKED_ROWS + 5])  # packed decode kernel and the dequantize path
def test_int8_linear_matches_fp32(rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=True)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 96)
    ref, out = lin(x), q(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 0.02
    # the CPU kernel's layout: 16 output rows per block, one per 32-bit lane of each 4-byte chunk
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (10, 24, 64) and q.scales.shape == (10, 1, 16)
    codes, scales = q.rows_of()
    assert codes.shape == (160, 96) and scales.shape == (160,)
    assert q.qweight[2, 5, 4 * 7 + 3] == codes[2 * 16 + 7, 4 * 5 + 3] and q.scales[2, 0, 7] == scales[2 * 16 + 7]
    torch.testing.assert_close(q.dequantized(), lin.weight, atol=lin.weight.abs().max().item() / 127, rtol=0)


def test_int8_embedding_keeps_a_q8_0_table_exactly_in_a_quarter_of_the_memory():
    # a table of Q8_0 values (gguf's quantizer, as llama.cpp's) comes back bit for bit; any other
    # table within int8 rounding per group of 32; built from row blocks it is the same layer
    import gguf
    import numpy as np

    torch.manual_seed(0)
    w = torch.randn(300, 96) * torch.rand(300, 1)
    w[7] = 0  # an all-zero row (scale 0)
    q8 = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                                 gguf.GGMLQuantizationType.Q8_0).astype(np.float32))
    emb = Int8Embedding(q8)
    ids = torch.tensor([[0, 7, 299], [5, 5, 42]])
    out = emb(ids)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    assert torch.equal(emb(torch.arange(300)), q8) and torch.equal(out, q8[ids])
    assert emb.qweight.dtype == torch.int8 and emb.qweight.shape == (19, 24, 64) and emb.scales.shape == (19, 3, 16)
    assert emb.qweight.nbytes + emb.scales.nbytes < w.nbytes / 3.5
    approx = Int8Embedding(w)(torch.arange(300))
    assert (approx - w).abs().max() <= w.abs().amax() / 254 + 1e-7
    rows = Int8Embedding.from_rows(300, 96, lambda a, b: w[a:b])
    assert torch.equal(rows.qweight, Int8Embedding(w).qweight) and torch.equal(rows.scales, Int8Embedding(w).scales)
    with pytest.raises(ValueError, match="divisible"):
        Int8Embedding(torch.randn(4, 40))


@pytest.mark.parametrize("rows", [1, 5, PACKED_ROWS + 5])
def test_int8_linear_in_groups_of_32_keeps_q8_0_blocks_and_matches_a_float64_reference(rows):
    # group=32 (what load_gguf makes of a Q8_0 tensor): a weight of Q8_0 values (gguf's quantizer, as
    # llama.cpp's) is held exactly (codes and fp16 scales of its blocks), and the product equals the W8A8
    # product with those codes (activations in int8 per group of 32, `reference`: exact integer sums,
    # float64 scaling), within the activations' 8-bit rounding of the float64 product with those values;
    # per-row int8 of the same values is not exact
    import gguf
    import numpy as np

    torch.manual_seed(0)
    w = torch.randn(160, 96) * torch.rand(160, 3).repeat_interleave(32, 1)  # groups of very different ranges
    w[3] = 0
    qt = gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(w.numpy(), qt)
    q8 = torch.from_numpy(gguf.quants.dequantize(blocks, qt).astype(np.float32))
    bias = torch.randn(160)
    lin = Int8Linear(q8, bias, group=32)
    assert lin.group == 32 and lin.scales.shape == (10, 3, 16) and lin.rows_of()[1].shape == (160, 3)
    assert torch.equal(lin.dequantized(), q8)
    file_scales = torch.from_numpy(blocks.reshape(160, 3, 34)[..., :2].copy().view(np.float16).astype(np.float32))
    assert torch.equal(lin.rows_of()[1], file_scales[..., 0])
    assert torch.equal(lin.dequantized(rows=torch.tensor([5, 150])), q8[[5, 150]])
    assert not torch.equal(Int8Linear(q8).dequantized(), q8)
    x = torch.randn(rows, 96)
    ref = lin.reference(x) + bias
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    exact = (x.double() @ q8.double().T).float()
    assert (lin(x) - bias - exact).norm() < 0.01 * exact.norm()
    sel = torch.tensor([3, 17, 159, 0])
    torch.testing.assert_close(linear_rows(lin, x, sel), lin(x)[:, sel], rtol=1e-5, atol=1e-5)
    built = Int8Linear.from_rows(160, 96, lambda a, b: q8[a:b], bias, group=32)
    assert torch.equal(built.qweight, lin.qweight) and torch.equal(built.scales, lin.scales)
    with pytest.raises(ValueError, match="divisible"):
        Int8Linear(torch.randn(4, 40), group=32)


def test_int4_linear_recovers_q4_1_codes_exactly():
    # Weights on a Q4_1 grid (per group of 32: code * d + m, codes spanning 0..15) come back exactly,
    # up to the bf16 rounding of the group scale/minimum; the forward adds the int8 rounding of the
    # activations (per group of 32, as GGML's Q8_1).
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (64, 128)).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15
    d, m = torch.rand(64, 4, 1) * 0.01 + 0.001, torch.randn(64, 4, 1) * 0.01
    w = (codes.view(64, 4, 32) * d + m).view(64, 128)
    d, m = d.bfloat16().float(), m.bfloat16().float()
    lin = Int4Linear(w)
    torch.testing.assert_close(lin.dequantized(), (codes.view(64, 4, 32) * d + m).view(64, 128), rtol=0, atol=1e-7)
    x = torch.randn(3, 128)
    ref = x @ lin.dequantized().T
    assert (lin(x) - ref).norm() / ref.norm() < 0.01
    with pytest.raises(ValueError, match="divisible"):
        Int4Linear(torch.randn(8, 40))


def test_int4_tinygemm_layer_runs_the_same_q4_1_groups_through_torchs_kernel():
    # On the CPU the layer packs for torch's CPU int4 kernel (`_for_cpu`): the same arithmetic and
    # scales-and-zeros as the CUDA kernel, so this checks the conversion from the Q4_1 groups
    # (zero = min + 8 scale) where no GPU is.
    torch.manual_seed(0)
    w = torch.randn(96, 192)
    codes, scale, minimum = q4_1_groups(w)
    dequant = (codes.view(96, 6, 32).float() * scale[..., None] + minimum[..., None]).view(96, 192)
    same_groups = Int4Linear(w).dequantized()  # its scale and minimum rounded to bf16
    assert (same_groups - dequant).norm() / dequant.norm() < 1e-2
    lin = Int4TinygemmLinear(w)
    assert lin.scales_and_zeros.shape == (6, 96, 2) and lin.scales_and_zeros.dtype == torch.bfloat16
    x = torch.randn(5, 192)
    ref = x @ dequant.T
    out = lin(x)
    assert out.dtype == torch.float32 and out.shape == (5, 96)
    assert (out - ref).norm() / ref.norm() < 0.01  # bf16 activations, scales and zeros
    with pytest.raises(ValueError, match="divisible"):
        Int4TinygemmLinear(torch.randn(12, 64))


def test_int4_off_the_cpu_is_packed_for_torchs_cuda_kernel():
    # No GPU here: a tiny model on the meta device, as fake tensors (shapes and dtypes, no data, and
    # torch's shape rules for its CUDA int4 kernel), takes the CUDA branch: the nibble-packed uint8
    # codes that `_convert_weight_to_int4pack` checks, its int32 tile layout, and a forward through
    # `_weight_int4pack_mm`.
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = tokenspeed.Engine.load("tiny-random").args
    with FakeTensorMode(), torch.device("meta"):
        meta = quantize(Transformer(args), "int4")
        w13 = meta.layers[0].feed_forward.w13
        y = w13(torch.empty(4, w13.in_features, dtype=torch.bfloat16))
    assert isinstance(w13, Int4TinygemmLinear) and isinstance(meta.output, Int8Linear)
    n, k = w13.out_features, w13.in_features
    assert k == 64  # the widest inner-k tiling that divides it: 4 tiles of 16 channels
    assert w13.packed.dtype == torch.int32 and w13.packed.shape == (n // 8, k // (16 * 4), 32, 4 // 2)
    assert y.shape == (4, n) and y.dtype == torch.bfloat16
    # what one decode step reads: 4-bit codes, a bf16 scale and zero per group of 32
    assert linear_bytes(w13) == n * k // 2 + n * (k // 32) * 2 * 2


def test_linear_rows_equals_selected_columns():
    torch.manual_seed(0)
    lin = nn.Linear(64, 500, bias=False)
    rows = torch.tensor([3, 17, 499, 0])
    x = torch.randn(2, 64)
    torch.testing.assert_close(linear_rows(lin, x, rows), lin(x)[:, rows])
    q = Int8Linear.from_linear(lin)
    torch.testing.assert_close(linear_rows(q, x, rows), q(x)[:, rows], rtol=1e-5, atol=1e-5)  # the same W8A8 kernel
    with pytest.raises(TypeError):
        linear_rows(nn.Identity(), x, rows)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
@pytest.mark.parametrize("extension", [True, False], ids=["kernel", "no compiler"])
def test_linear_rows_of_gguf_blocks_are_the_full_layers_columns(extension, fmt, monkeypatch):
    # with the extension both run the format's kernel (block_gemv); without it (the fallback) both run
    # the same arithmetic in torch (`BlockLinear.reference`)
    from support import block_layer
    from tokenspeed import quant

    if not extension:
        monkeypatch.setattr(quant, "fused_ext", lambda *a, **k: None)
    lin = block_layer(fmt, 40, 512)
    x, rows = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)), torch.tensor([5, 0, 39])
    torch.testing.assert_close(linear_rows(lin, x, rows), lin(x)[:, rows], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_tied_head_runs_the_embeddings_int8_groups(mode):
    # a model that ties its lm_head to the embedding holds the int8 table once: the quantized head is
    # the Int8Embedding's codes and group scales (the same tensors), and its logits are the table's
    # rows @ h within the activations' 8-bit rounding (the W8A8 kernel for a decode row and for many
    # rows, `linear_rows` for a grammar's few: the same columns); a cast of the model ties them again
    model = tokenspeed.Engine.load("tiny-random").model
    assert model.args.tie_embeddings
    quantize(model, mode)
    head, table = model.output, model.tok_embeddings
    assert head.qweight is table.qweight and head.scales is table.scales and head.group == Int8Embedding.GROUP
    rows = table(torch.arange(model.args.vocab_size)).double()
    for h in (torch.randn(1, model.args.dim), torch.randn(40, model.args.dim)):
        torch.testing.assert_close(head(h), head.reference(h), rtol=1e-5, atol=1e-4)
        exact = h.double() @ rows.T
        assert (head(h).double() - exact).norm() < 0.01 * exact.norm()
    pick = torch.tensor([7, 0, 101])
    torch.testing.assert_close(linear_rows(head, h, pick), head(h)[:, pick], rtol=1e-5, atol=1e-5)
    model.to(torch.float32)
    assert model.output.qweight is model.tok_embeddings.qweight and model.output.scales is model.tok_embeddings.scales


@pytest.mark.parametrize("mode,tol", [("int8", 0.05), ("int4", 0.2)])  # random weights: int4 is coarse
def test_quantize_swaps_every_linear_and_rejects_unknown_mode(mode, tol):
    model = tokenspeed.Engine.load("tiny-random").model
    tokens = torch.arange(10, 20)
    ref = model(tokens, torch.arange(10), model.new_cache(64), "all")
    quantize(model, mode)
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in model.modules())
    assert isinstance(model.output, Int8Linear) and isinstance(model.tok_embeddings, Int8Embedding)
    assert isinstance(model.layers[0].feed_forward.w13, Int4Linear if mode == "int4" else Int8Linear)
    out = model(tokens, torch.arange(10), model.new_cache(64), "all")
    assert (out - ref).norm() / ref.norm() < tol
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(model, "int3")


def test_quantized_engines_make_the_same_robot_calls_as_fp32():
    tools = [{"type": "function", "function": {"name": "pick", "description": "Grasp a cube.", "parameters": {
        "type": "object", "properties": {"object": {"type": "string", "enum": ["red_cube", "green_cube", "blue_cube"]}},
        "required": ["object"]}}},
             {"type": "function", "function": {"name": "move_to", "description": "Move the gripper (metres).",
                                               "parameters": {"type": "object", "properties": {
                                                   "x": {"type": "number", "minimum": 0.3, "maximum": 0.7},
                                                   "y": {"type": "number", "minimum": -0.3, "maximum": 0.3}},
                                                   "required": ["x", "y"]}}}]
    prompts = ["The green cube is at x=0.42 y=-0.10. Pick up the green cube.", "Move the gripper to x=0.5 y=0.2."]
    calls = {mode: [d.tool_call for d in decide_each(tokenspeed.Engine.load(quantize=mode), tools, prompts)]
             for mode in (None, "int4")}
    assert calls["int4"] == calls[None]


def test_decisions_read_only_the_allowed_lm_head_rows_with_the_same_result(monkeypatch):
    import tokenspeed.decode as decode_mod

    engine = tokenspeed.Engine.load("tiny-random")
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {
        "object": {"type": "string", "enum": ["red_cube", "green_cube", "blue_cube"]},
        "speed": {"type": "integer", "minimum": 1, "maximum": 90}}, "required": ["object", "speed"]}}}]
    seen = []
    real = decode_mod.linear_rows
    monkeypatch.setattr(decode_mod, "linear_rows", lambda lin, x, rows: seen.append(len(rows)) or real(lin, x, rows))
    results, default = {}, decode_mod.LM_HEAD_ROWS
    for limit in (default, 0):  # 0: always the full lm_head
        monkeypatch.setattr(decode_mod, "LM_HEAD_ROWS", limit)
        s = engine.session(system="You control a robot arm.", tools=tools)
        s.observe("Pick up the red cube slowly.")
        d = s.decide(max_tokens=40)
        results[limit] = (d.status, d.text)
    assert seen and max(seen) <= default  # the rows path ran, on small allowed sets
    assert results[0] == results[default] and results[0][0] == "ok"


def test_auto_picks_a_format_no_slower_than_fp32_and_caches_it(tmp_path):
    # the measured choice on this machine (tiny model: fast): every format timed and checked
    # against fp32's greedy tokens; the pick costs at most fp32's cost in its own timing; a second
    # load with the same key takes the cached choice and quantizes to it without timing
    from tokenspeed.quant import FORMATS, choose_format

    probes = [[1, 2, 3, 4, 5], [40, 41, 42]]
    model = tokenspeed.Engine.load("tiny-random", quantize=None).model
    model, choice = choose_format(model, probes, "tiny-random", tmp_path / "auto.json")
    assert set(choice.timings) == set(FORMATS) and choice.timings["fp32"]["agrees"] and not choice.cached
    assert choice.timings[choice.format]["agrees"]
    assert choice.timings[choice.format]["cost_ms"] <= choice.timings["fp32"]["cost_ms"]
    assert choice.format in choice.describe()
    kinds = {"fp32": torch.nn.Linear, "int8": Int8Linear, "int4": Int4Linear}
    again, cached = choose_format(tokenspeed.Engine.load("tiny-random", quantize=None).model, probes, "tiny-random",
                                  tmp_path / "auto.json")
    assert cached.cached and cached.format == choice.format and cached.timings == choice.timings
    for m in (model, again):
        assert isinstance(m.layers[0].attention.wqkv, kinds[choice.format])


def test_q5_0_held_interleaved_by_16_rows_as_documented():
    # pack_q5_0's bytes against its docstring's formula, row by row and block by block (30 rows: the second
    # block of 16 padded with zero blocks), and back to the blocks as stored, all rows or some
    from support import q5_0_blocks
    from tokenspeed import quant

    blocks = q5_0_blocks(30, 96, seed=3)
    held = quant.pack_q5_0(blocks, chunk_rows=16)  # two chunks: the padded tail on its own
    assert held.shape == (2, 3, 352) and held.dtype == torch.uint8
    b = blocks.view(30, 3, 22)
    for n, g in ((0, 0), (7, 2), (17, 1), (29, 2)):
        qs, qh = b[n, g, 6:], int.from_bytes(bytes(b[n, g, 2:6].tolist()), "little")
        low = [int(qs[i % 16]) >> (4 * (i // 16)) & 15 for i in range(32)]  # weight i's low 4 bits
        blk, j = held[n // 16, g], n % 16
        for o in range(4):
            for i in range(4):
                assert blk[64 * o + 4 * j + i] == low[8 * o + i] | low[8 * o + 4 + i] << 4
        word = int.from_bytes(bytes(blk[256 + 4 * j:260 + 4 * j].tolist()), "little")
        assert all((word >> (8 * i + 4 * h + o) & 1) == (qh >> (8 * o + 4 * h + i) & 1)
                   for o in range(4) for h in range(2) for i in range(4))
        assert torch.equal(blk[320 + 2 * j:322 + 2 * j], b[n, g, :2])
    assert not held[1, :, [4 * j + i for j in range(14, 16) for i in range(4)]].any()  # rows 30, 31: zero
    assert torch.equal(quant.unpack_q5_0(held, 30), blocks)
    rows = torch.tensor([29, 0, 16, 15])
    assert torch.equal(quant.unpack_q5_0(held, 30, rows), blocks[rows])
    assert torch.equal(quant.pack_q5_0(blocks), held)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_gguf_block_rows_equal_gguf_dequantize_bit_for_bit(fmt):
    # every code, fifth bit, scale and minimum byte random: the rows a BlockLinear multiplies (and a
    # BlockEmbedding looks up) are gguf-py's dequantization of the same blocks, bit for bit
    import gguf
    import numpy as np
    from support import block_layer
    from tokenspeed import quant

    blocks = block_layer(fmt, 30, 512).rows_of()
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt])
    lin, table = quant.BLOCK_LINEARS[fmt](blocks), quant.BLOCK_EMBEDDINGS[fmt](blocks)
    assert np.array_equal(lin.dequantized().numpy().view(np.uint32), theirs.view(np.uint32))
    ids = torch.tensor([3, 0, 29, 3])
    assert torch.equal(table(ids), torch.from_numpy(theirs[ids.numpy()]))
    assert quant.BLOCK_LINEARS[fmt].tied(table).blocks is table.blocks
