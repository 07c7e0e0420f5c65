"""Fused CPU decode step (tokenspeed.kernels.cpu_decode) against the model's Python path.

The extension is built by `make setup`; a machine without a C++ compiler fails these tests on
purpose (the engine would still run, on the slower Python path).
"""
import pytest
import torch

import tokenspeed
from support import block_layer, decide_each, q5_0_blocks, q6k_blocks, qk_blocks
from tokenspeed.kernels.cpu_decode import FUSED_PREFILL_ROWS, FUSED_ROWS
from tokenspeed.model import ModelArgs, Transformer
from tokenspeed.quant import (Q4_K, Q5_0, Q5_K, Q6_K, Int4Linear, Int8Linear, Q4KLinear, Q5_0Linear, Q5KLinear,
                              Q6KEmbedding, Q6KLinear, fused_ext)


@pytest.fixture(scope="module")
def ext():
    mod = fused_ext()
    assert mod is not None, "the fused CPU decode extension did not build (see the warning above)"
    return mod


def _run(model, fused: bool, prefix: int, new: list[int]):
    """Prefill `prefix` tokens (Python path), then forwards of len(n) tokens for n in `new`;
    returns the logits of each forward and the KV cache."""
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (prefix + sum(new),))
    model.use_fused = fused
    try:
        cache = model.new_cache(prefix + sum(new) + 4)
        model(ids[:prefix], torch.arange(prefix), cache, "none")
        outs, at = [], prefix
        for n in new:
            outs.append(model(ids[at:at + n], torch.arange(at, at + n), cache, "all"))
            at += n
    finally:
        model.use_fused = True
    return outs, cache


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_fused_matches_python_path_on_tiny_model(ext, tiny_engine, quant):
    # decode (1 token), short verification of drafts (2: attention loops), a forced run (5: attention
    # GEMM) and the largest single fused call; grouped-query heads (4 query / 2 KV heads)
    model = tiny_engine.model
    if quant:
        model = tokenspeed.Engine.load("tiny-random", quantize=quant).model
    assert model.fused_decode() is not None
    new = [1, 2, 5, FUSED_ROWS]
    ref, ref_cache = _run(model, False, 37, new)
    out, cache = _run(model, True, 37, new)
    for a, b in zip(ref, out):
        assert (a - b).abs().max() <= 1e-4  # both paths run the same matmul kernels
    n = cache.n
    assert n == ref_cache.n == 37 + sum(new)
    assert torch.equal(cache.pos[:n], ref_cache.pos[:n])
    # the fp16 cache (both paths round on write to nearest-even): a ~1e-6 difference in a key or value
    # before rounding can flip it by one half-float ulp (2^-10 relative), and a layer that reads a
    # flipped one passes the next layer inputs ~1e-5 apart (the logits' 1e-4 bounds it all)
    assert cache.k.dtype == ref_cache.k.dtype == torch.float16
    for a, b in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        torch.testing.assert_close(a[:, :, :, :n].float(), b[:, :, :, :n].float(), rtol=2 ** -10, atol=1e-4)


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_short_prefill_runs_in_fused_blocks_like_python_path(ext, quant):
    # more than FUSED_ROWS new tokens (the agent's state line): fused calls of FUSED_ROWS rows, then
    # the rest, each attending over the blocks before it. int4 and int8 (W4A8, W8A8) round each row's
    # activations to int8 per group, so a 1-ulp attention difference can flip one rounding and move
    # that row's logits by ~1e-2 (see test_fused_real_model_decisions_identical): there at most 1 row
    # in 25 may differ more (how many flip depends on the inputs: 4 of 125 rows, ~1e-2 each, with the
    # int8 embedding table; 3 of 125 in int8 over the fp16 KV cache).
    model = tokenspeed.Engine.load("tiny-random", quantize=quant).model
    new = [2 * FUSED_ROWS - 3]
    (ref,), ref_cache = _run(model, False, 37, new)
    (out,), cache = _run(model, True, 37, new)
    off = int(((ref - out).abs().amax(-1) > 1e-4).sum())
    assert off <= (new[0] // 25 if quant in ("int4", "int8") else 0) and (ref - out).abs().max() < 0.05
    n = cache.n
    assert n == ref_cache.n == 37 + new[0] and torch.equal(cache.pos[:n], ref_cache.pos[:n])


def test_fused_matches_python_path_with_gguf_block_projections(ext):
    # a Q4_K_M file's mix at a width of 256: Q6_K ffn_down and tied head/embedding (the file's blocks,
    # `Q6KLinear`), a Q5_0 wo (`Q5_0Linear`), a Q4_K wqkv and a Q5_K w13 in one layer each, int4
    # elsewhere; the fused step takes every kind and agrees
    # with the Python path to
    # the activation-rounding noise floor: at this width a 1-ulp difference in a norm or SwiGLU flips
    # some int8 activation codes (the same model with int4 ffn_down and an int8 table: 0.05 apart, 98.6%
    # of the argmaxes equal; kernel == reference exactly per row: test_block_gemv_matches_reference_row_by_row)
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=512, vocab_size=1000,
                     max_seq_len=512, tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
    for i, layer in enumerate(model.layers):
        att, ffn = layer.attention, layer.feed_forward
        att.wqkv, ffn.w13 = (Int4Linear(lin.weight) for lin in (att.wqkv, ffn.w13))
        if i == 0:
            att.wqkv = Q4KLinear(qk_blocks(512, 256, seed=i, d=2e-4))
        else:
            ffn.w13 = Q5KLinear(qk_blocks(1024, 256, True, seed=i, d=1e-4))
        att.wo = Q5_0Linear(q5_0_blocks(256, 256, seed=i, d=6e-3))
        ffn.w2 = Q6KLinear(q6k_blocks(256, 512, seed=i, scale=40))
    model.tok_embeddings = Q6KEmbedding(q6k_blocks(1000, 256, seed=9, scale=40))
    model.output = Q6KLinear.tied(model.tok_embeddings)
    model.invalidate_fused()
    blocks = {16 + fmt.ggml_type for fmt in (Q4_K, Q5_K, Q6_K, Q5_0)}  # the C++ step's kinds of the four formats
    assert model.fused_decode() is not None and blocks <= set(model.fused_decode().kinds)
    new = [1, 2, 5, FUSED_ROWS]
    ref, out = (torch.cat(_run(model, fused, 37, new)[0]) for fused in (False, True))
    # the argmax agrees on every row but near-ties: rows whose top two logits are closer than twice the
    # largest difference (1 to 4 of the 72 rows flip, ties within 1e-3 .. 3e-3, which ones depending on the
    # kernels' float summation order)
    diff, top2 = (ref - out).abs().max(), ref.topk(2, -1).values
    assert diff < 0.1 and bool(((ref.argmax(-1) == out.argmax(-1)) | (top2[:, 0] - top2[:, 1] < 2 * diff)).all())


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_block_gemv_matches_reference_row_by_row(ext, fmt, rows):
    # GGUF blocks (every code, fifth bit, scale and minimum byte random; Q5_0 interleaved by 16 rows, rows of
    # 28 blocks, Qwen2.5-0.5B's width): the kernel against the torch arithmetic, and a row's result does not
    # depend on the rows beside it (decode == verification); a format the kernels do not run is refused
    K = 896 if fmt == "Q5_0" else 768
    lin = block_layer(fmt, 304, K)
    def gemv(x, blocks):
        if fmt == "Q5_0":
            return ext.q5_0_gemv(x, blocks)
        return ext.block_gemv(x, blocks, lin.FORMAT.ggml_type)

    x = torch.randn(rows, K)
    x[0, :32] = 0  # an all-zero group: scale 0, codes 0
    y = gemv(x, lin.blocks)
    torch.testing.assert_close(y, lin.reference(x), rtol=1e-5, atol=1e-4)
    assert all(torch.equal(gemv(x[r:r + 1], lin.blocks), y[r:r + 1]) for r in range(rows))
    with pytest.raises(RuntimeError, match="blocks"):
        gemv(torch.randn(1, 512), lin.blocks)
    with pytest.raises(RuntimeError, match="no kernel for ggml type 8"):  # Q8_0: int8_gemv's, not a block kernel
        ext.block_gemv(x, lin.rows_of(), 8)
    with pytest.raises(RuntimeError, match="no kernel for ggml type 6"):  # Q5_0 runs interleaved (q5_0_gemv)
        ext.block_gemv(torch.randn(1, 896), torch.zeros(2, 28 * 22, dtype=torch.uint8), 6)


def test_fused_skipped_where_it_does_not_apply(tiny_engine):
    model = tiny_engine.model
    _, cache = _run(model, True, 3, [FUSED_PREFILL_ROWS + 1])  # too many rows: the Python path
    assert cache.n == 3 + FUSED_PREFILL_ROWS + 1
    bf16 = tokenspeed.Engine.load("tiny-random", dtype=torch.bfloat16)
    assert bf16.model.fused_decode() is None  # the extension is fp32 only: bf16 keeps the Python path
    bf16.speculation = None
    s = bf16.session(system="You control a robot arm.")
    assert isinstance(s.generate("Hello", max_tokens=4), str) and s.cache.k.dtype == torch.bfloat16


def test_int8_gemv_matches_reference(ext):
    # W8A8 (int8 codes x per-group int8 activations, llama.cpp's Q8_0 x Q8_0) against the same
    # arithmetic in torch; K = 70: a shorter last activation group (the layout pads the weight to 96
    # channels of zeros, 1000 rows to 1008)
    torch.manual_seed(0)
    lin = Int8Linear(torch.randn(1000, 70))
    x = torch.randn(3, 70)
    ref = lin.reference(x)
    assert ext.int8_gemv(x, lin.qweight, lin.scales).shape == (3, 1008)
    torch.testing.assert_close(ext.int8_gemv(x, lin.qweight, lin.scales)[:, :1000], ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lin(x), ref, atol=1e-4, rtol=1e-5)  # the lm_head's decode path uses it
    # and within fp32 activations' rounding of the unquantized product (8-bit activations: ~0.5%)
    exact = (x.double() @ lin.dequantized(torch.float64).T).float()
    assert (lin(x) - exact).norm() < 0.01 * exact.norm()
    # a prefill burst (>= 16 rows: output rows split over torch's threads, tiles of several tokens)
    # gives each row the bits of that row decoded alone
    burst = torch.randn(21, 70)
    y = ext.int8_gemv(burst, lin.qweight, lin.scales)
    assert all(torch.equal(ext.int8_gemv(burst[r:r + 1], lin.qweight, lin.scales), y[r:r + 1]) for r in range(21))


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17])
def test_int4_matmul_matches_reference_row_by_row(ext, rows):
    # W4A8 (Q4_1 codes x per-group int8 activations) against the same arithmetic in torch, and each
    # row bit-identical to that row alone (verifying k drafts == k plain decode steps); the
    # 8-row register blocks, their remainder and the 96-wide K (3 groups) all run
    torch.manual_seed(0)
    lin = Int4Linear(torch.randn(48, 96))
    x = torch.randn(rows, 96)
    x[0, :32] = 0  # an all-zero group: scale 0, codes 0
    y = ext.int4_matmul(x, lin.codes, lin.scales)
    torch.testing.assert_close(y, lin.reference(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, torch.cat([ext.int4_matmul(x[i:i + 1], lin.codes, lin.scales) for i in range(rows)]))
    assert torch.equal(lin(x), y)  # the module's forward is the kernel


def test_fused_real_model_decisions_identical(ext, engine, robot_tools):
    # the real model (fp32, speculation on: draft verification runs fused too): every tool call
    # decided with the fused step equals the Python path's. (With int4 weights both paths round
    # activations to bf16, and 1-ulp fp32 differences can flip a rounding and, rarely, a close
    # greedy choice; `tokenspeed bench aal` reports the int4 path's agreement with fp32.)
    prompts = ["The red cube is at x=0.42 y=-0.10 on the table. Pick it up.",
               "Move the gripper 5 cm up, then open it.",
               "Place the blue cylinder at x=0.30 y=0.25."]
    texts = {}
    try:
        for fused in (False, True):
            engine.model.use_fused = fused
            texts[fused] = [d.text for d in decide_each(engine, robot_tools, prompts)]
    finally:
        engine.model.use_fused = True
    assert texts[True] == texts[False]


KV_PROMPTS = ["The red cube is at x=0.42 y=-0.10 on the table. Pick it up.",
              "Move the gripper 5 cm up, then open it.",
              "Place the blue cylinder at x=0.30 y=0.25.",
              "Stop the arm immediately, a person entered the workspace."]


def _decisions(engine, tools, dtype, monkeypatch, **session_args):
    from tokenspeed.model import Transformer

    monkeypatch.setattr(Transformer, "kv_dtype", property(lambda self: dtype))
    try:
        return [d.text for d in decide_each(engine, tools, KV_PROMPTS, **session_args)]
    finally:
        monkeypatch.undo()


def test_fp16_kv_cache_keeps_real_model_decisions(ext, engine, robot_tools, monkeypatch):
    # the CPU default KV cache is fp16 (half the memory; attention reads it as fp32): the real
    # model's tool calls on the robot tools (fp32 weights) equal those decided over an fp32 cache,
    # in a plain session and a pruned one (the demo's kv_budget). Teacher-forced over these calls
    # the logits move by <= 0.03 (mean KL ~6e-7); int4 and int8 weights: the next test.
    assert engine.model.kv_dtype == torch.float16
    for args in ({}, {"kv_budget": 1024}):
        assert (_decisions(engine, robot_tools, torch.float16, monkeypatch, **args)
                == _decisions(engine, robot_tools, torch.float32, monkeypatch, **args))


def _forced(model, ids, dtype, fused=True):
    """Logits [len(ids), vocab] of `ids` teacher-forced in fused-size chunks over a new cache of `dtype`."""
    model.use_fused = fused
    try:
        cache = model.new_cache(len(ids), dtype=dtype)
        return torch.cat([model(torch.tensor(ids[i:i + FUSED_ROWS]), torch.arange(i, min(i + FUSED_ROWS, len(ids))),
                                cache, "all") for i in range(0, len(ids), FUSED_ROWS)])
    finally:
        model.use_fused = True


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_fp16_kv_cache_within_activation_rounding_noise(ext, robot_tools, monkeypatch, quant):
    # int4 and int8 weights (W4A8 as `bench aal` runs them, W8A8) round every row's activations to
    # int8 per group, so any perturbation of ~1e-6 (the Python path's attention instead of the fused
    # one, over the same fp32 KV) flips roundings and moves logits by up to ~1.5: close greedy choices flip with it
    # ("Move the gripper 5 cm up" picks the red cube over fp32 KV, moves over fp16 KV: a 0.08-logit
    # margin). So here the fp16 cache is held to that floor, teacher-forced over the robot prompts and
    # their decisions: measured top-1 agreement 97.4% and mean KL 0.0023 against fp32 KV, where the
    # fused and Python paths over fp32 KV agree 98.3% with mean KL 0.0022.
    engine = tokenspeed.Engine.load(quantize=quant)
    model, tok = engine.model, engine.tokenizer
    system = engine.session(system="You control a robot arm.", tools=robot_tools)._system_text
    texts = _decisions(engine, robot_tools, torch.float32, monkeypatch)
    kl, agree, floor = [], [], []
    for prompt, text in zip(KV_PROMPTS, texts):
        chat = tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": prompt}],
                               add_generation_prompt=True)
        ids = tok.encode(chat)
        first, ids = len(ids) - 1, ids + tok.encode(text)
        ref = torch.log_softmax(_forced(model, ids, torch.float32)[first:], -1)
        for out, got in ((kl, _forced(model, ids, torch.float16)), (floor, _forced(model, ids, torch.float32, False))):
            got = torch.log_softmax(got[first:], -1)
            out.append((ref.exp() * (ref - got)).sum(-1))
            if out is kl:
                agree.append(got.argmax(-1) == ref.argmax(-1))
    kl, floor, agree = torch.cat(kl).mean(), torch.cat(floor).mean(), torch.cat(agree).float().mean()
    assert agree >= 0.95 and kl <= 2 * floor + 1e-4, (float(agree), float(kl), float(floor))


def test_fused_feeds_relevance_scores_like_python_path(ext, tiny_engine):
    # a pruned session (tracks attention): the fused step hands each layer's attention mass to
    # the cache; scores, evictions and output equal the Python path's. Plain decoding: adaptive
    # speculation picks proposal lengths from measured step times, so its forwards vary run to run.
    results = {}
    spec, tiny_engine.speculation = tiny_engine.speculation, None
    try:
        for fused in (False, True):
            tiny_engine.model.use_fused = fused
            s = tiny_engine.session(system="You control a robot arm.", kv_budget=128)
            for i in range(10):
                s.observe(f"joint q=[{i}.1, {i}.2, {i}.3]", kind="sensor", source="joint_states")
                s.generate(max_tokens=6)
            c = s.cache
            results[fused] = (s.tokens[:], c.score[:c.n].clone(), c.pos[:c.n].clone(), c.take_metrics())
    finally:
        tiny_engine.model.use_fused, tiny_engine.speculation = True, spec
    (t0, s0, p0, m0), (t1, s1, p1, m1) = results[False], results[True]
    assert t0 == t1 and torch.equal(p0, p1)
    assert torch.allclose(s0, s1, atol=1e-5)
    assert m0 == m1 and m0["totals"]["evicted"] > 0
