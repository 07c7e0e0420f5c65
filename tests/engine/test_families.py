"""The families users run in 2026, from their GGUF files: Llama 3.x, Qwen2.5, Qwen3 (per-head Q/K
RMSNorm) and SmolLM3 (no rotation in every 4th layer).

Each family is a tiny random-weight model at its layout (`tokenspeed.bench.scale.SHAPES`: "tiny-llama",
"tiny" for Qwen2.5, "tiny-qwen3", "tiny-smollm3"; "tiny-0.5b" for Qwen2.5-0.5B's hidden size that is not
whole 256-blocks), written as an F16 GGUF by the `gguf` writer and
quantized to Q4_K_M by llama.cpp's own quantizer. TokenSpeed runs the file's own blocks
(`quantize="gguf"`, never an fp32 copy) and its logits are compared with llama.cpp's on the same file
and ids. On the F16 file no quantization stands between the two engines, so the logits nearly agree
only if the architecture is the same: a control model with the family's feature switched off (no
Q/K norms, a rotation in every layer) is far from llama.cpp's there.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import tokenspeed
from tokenspeed.bench import scale
from tokenspeed.bench.agreement import compare
from tokenspeed.weights import load_gguf, load_quantized, resolve_model

llama_cpp = pytest.importorskip("llama_cpp")

FAMILIES = {"tiny-llama": "llama", "tiny": "qwen2", "tiny-qwen3": "qwen3", "tiny-smollm3": "smollm3"}
IDS = [int(i) for i in np.random.default_rng(1).integers(0, 49000, 40)]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """size name -> {"F16": source file, "Q4_K_M": llama.cpp's quantization of it} (written once)."""
    folder = tmp_path_factory.mktemp("families")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scale, "_folder", lambda: folder)
        yield {name: {"F16": scale.source_file(name), "Q4_K_M": scale.model_file(name, "Q4_K_M", threads=1)}
               for name in [*FAMILIES, "tiny-0.5b"]}


def _llama_cpp_logits(path) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=1, logits_all=True, seed=0,
                          verbose=False)
    llm.eval(IDS)
    return np.array(llm.scores[:len(IDS)])


def _logits(model, fused: bool, one_by_one: bool = False) -> torch.Tensor:
    model.use_fused = fused
    cache = model.new_cache(64)
    if one_by_one:  # decode steps
        return torch.cat([model(torch.tensor(IDS[i:i + 1]), i, cache, "all") for i in range(len(IDS))])
    return model(torch.tensor(IDS), 0, cache, "all")


def _distance(ours, theirs) -> float:
    # |ours - theirs| / |theirs| of the logits, each centred per position (softmax ignores a shift)
    a, b = (torch.as_tensor(x).double() for x in (ours, theirs))
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_reads_as_llama_cpp_reads_it(name, made):
    files = resolve_model(made[name]["Q4_K_M"])
    assert json.loads((files.folder / "config.json").read_text())["model_type"] == FAMILIES[name]
    args = files.args
    assert args.qk_norm == (name == "tiny-qwen3") and args.qkv_bias == (name == "tiny")
    assert args.no_rope_layers == ((3,) if name == "tiny-smollm3" else ())
    assert args.head_dim == scale.SHAPES[name].head_dim  # Qwen3's 128 from attention.key_length, not 256 / 4
    assert args.tie_embeddings == scale.SHAPES[name].tied


@pytest.mark.parametrize("name", list(FAMILIES))
def test_f16_logits_match_llama_cpp_and_the_family_feature_matters(name, made):
    theirs = _llama_cpp_logits(made[name]["F16"])
    model = load_gguf(resolve_model(made[name]["F16"]))
    fused, python = _logits(model, True), _logits(model, False)
    steps = _logits(model, True, one_by_one=True)
    for ours in (fused, python, steps):
        agree = compare(ours, theirs)
        assert agree["top1"] >= 0.95 and agree["kl_mean"] < 1e-4, agree
        assert _distance(ours, theirs) < 0.01
    if name in ("tiny-qwen3", "tiny-smollm3"):  # the same weights without the family's feature: far off
        for layer in model.layers:
            layer.attention.q_norm = layer.attention.k_norm = None
            layer.attention.rotates = True
        model.invalidate_fused()
        for fused in (True, False):
            assert _distance(_logits(model, fused), theirs) > 0.1


@pytest.mark.parametrize("name", list(FAMILIES))
def test_q4_k_m_file_runs_natively_and_agrees_with_llama_cpp(name, made, monkeypatch):
    # the file's own blocks through Engine.load (what `--quantize gguf` and the agent's model parameter
    # load): no fp32 copy is ever written, and the fused step takes it
    import tokenspeed.weights as weights

    def no_fp32(*_):
        raise AssertionError("an fp32 copy of the model was written")

    monkeypatch.setattr(weights, "_write_fp32_weights", no_fp32)
    engine = tokenspeed.Engine.load(made[name]["Q4_K_M"], quantize="gguf")
    model = engine.model
    assert model.fused_decode() is not None
    theirs = _llama_cpp_logits(made[name]["Q4_K_M"])
    for ours in (_logits(model, True), _logits(model, False)):
        agree = compare(ours, theirs)
        # random weights of std 0.1 make sharp logits, where the two engines' activation rounding
        # (llama.cpp's Q8_K blocks, TokenSpeed's W4A8 and W6A8 groups of 32) shows
        assert agree["top1"] >= 0.8 and agree["kl_mean"] < 0.02, agree


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_q5_k_m_file_runs_its_q5_k_blocks_and_agrees_with_llama_cpp(name, made):
    # llama.cpp's Q5_K_M of the family's file: its all-Q5_K projections run as stored (`Q5KLinear`, W5A8
    # with the activations per 256 as llama.cpp's Q8_K), in the fused step too, and the logits agree with
    # llama.cpp's on the same file as the Q4_K_M file's do
    from tokenspeed.quant import Q5KLinear

    path = scale.model_file(name, "Q5_K_M", threads=1)
    model = tokenspeed.Engine.load(path, quantize="gguf").model
    projections = [lin for layer in model.layers for lin in (layer.attention.wo, layer.feed_forward.w13)]
    assert any(isinstance(lin, Q5KLinear) for lin in projections) and model.fused_decode() is not None
    theirs = _llama_cpp_logits(path)
    for ours in (_logits(model, True), _logits(model, False)):
        agree = compare(ours, theirs)
        assert agree["top1"] >= 0.8 and agree["kl_mean"] < 0.02, agree


@pytest.mark.parametrize("name", list(FAMILIES))
def test_q4_k_m_files_q6_k_tensors_run_as_stored(name, made):
    # Q4_K_M's Q6_K tensors (the embedding, a tied head, ffn_down in about half the layers) are the
    # file's blocks, held once: looked-up rows equal gguf's dequantization exactly, the head runs the
    # table's own blocks, and the fused step takes them
    import gguf

    from tokenspeed.quant import Q6KEmbedding, Q6KLinear, StackedLinear, linear_rows
    from tokenspeed.weights import _gguf_tensors

    tensors, _ = _gguf_tensors(made[name]["Q4_K_M"])
    kind = {n: t.tensor_type.name for n, t in tensors.items()}
    model = load_gguf(resolve_model(made[name]["Q4_K_M"]))
    tied = scale.SHAPES[name].tied
    assert kind["token_embd.weight" if tied else "output.weight"] == "Q6_K" and isinstance(model.output, Q6KLinear)
    if kind["token_embd.weight"] == "Q6_K":
        assert isinstance(model.tok_embeddings, Q6KEmbedding)
        rows = gguf.quants.dequantize(tensors["token_embd.weight"].data[IDS], gguf.GGMLQuantizationType.Q6_K)
        assert torch.equal(model.tok_embeddings(torch.tensor(IDS)), torch.from_numpy(rows))
    if tied:
        assert model.output.blocks is model.tok_embeddings.blocks
    q6k = 0
    for i, layer in enumerate(model.layers):
        down = kind[f"blk.{i}.ffn_down.weight"]
        assert isinstance(layer.feed_forward.w2, Q6KLinear if down == "Q6_K" else object)
        q6k += down == "Q6_K"
        if kind[f"blk.{i}.attn_v.weight"] == "Q6_K" and kind[f"blk.{i}.attn_q.weight"] != "Q6_K":
            wqkv = layer.attention.wqkv  # a mix: one layer per format, the v rows the file's Q6_K blocks
            assert isinstance(wqkv, StackedLinear) and isinstance(wqkv.parts[-1], Q6KLinear)
    assert q6k > 0
    x = torch.randn(5, model.args.dim)
    head = model.output  # the kernel against the W6A8 arithmetic; selected rows = the full head's columns
    torch.testing.assert_close(head(x), head.reference(x), rtol=1e-5, atol=1e-4)
    rows = torch.tensor([0, 7, 300, model.args.vocab_size - 1])
    assert torch.equal(linear_rows(head, x, rows), head(x)[:, rows])
    assert model.fused_decode() is not None  # its Q6_K projections included (fused == Python: test_cpu_decode)
    # the quantized weights cache keeps them as they are: a warm load holds the same blocks, the tied head once
    tokenspeed.Engine.load(made[name]["Q4_K_M"], quantize="gguf")  # (writes the entry if it is not there)
    warm = load_quantized(resolve_model(made[name]["Q4_K_M"]), "gguf")
    assert {k: type(m) for k, m in warm.named_modules()} == {k: type(m) for k, m in model.named_modules()}
    assert torch.equal(warm.output.blocks, model.output.blocks)
    if tied:
        assert warm.output.blocks is warm.tok_embeddings.blocks


def test_q4_k_m_file_of_rows_not_whole_256_blocks_runs_its_q5_0_blocks(made):
    # Qwen2.5-0.5B's case in small: llama.cpp's Q4_K_M stores the projections whose rows are not whole
    # 256-blocks as Q5_0 (and attn_v, meant Q6_K, as Q8_0). All-Q5_0 projections are the file's blocks
    # (the same values as gguf's dequantization), the q/k/v mix one layer per format, the fused step takes
    # them, the logits agree with llama.cpp's on the same file, and the cache entry holds the same layers
    import gguf

    from tokenspeed.quant import Int8Linear, Q5_0Linear, StackedLinear
    from tokenspeed.weights import _gguf_tensors

    path = made["tiny-0.5b"]["Q4_K_M"]
    tensors, _ = _gguf_tensors(path)
    kind = {n: t.tensor_type.name for n, t in tensors.items()}
    assert kind["blk.0.attn_q.weight"] == kind["blk.0.ffn_gate.weight"] == "Q5_0"
    model = load_gguf(resolve_model(path))
    native = 0
    for i, layer in enumerate(model.layers):
        for lin, names in ((layer.attention.wo, ["attn_output"]), (layer.feed_forward.w13, ["ffn_gate", "ffn_up"]),
                           (layer.attention.wqkv, ["attn_q", "attn_k", "attn_v"])):
            types = {kind[f"blk.{i}.{n}.weight"] for n in names}
            assert isinstance(lin, Q5_0Linear if types == {"Q5_0"} else object)
            if types == {"Q5_0"}:
                native += 1
                theirs = np.concatenate([gguf.quants.dequantize(tensors[f"blk.{i}.{n}.weight"].data,
                                                                gguf.GGMLQuantizationType.Q5_0) for n in names])
                assert torch.equal(lin.dequantized(), torch.from_numpy(theirs))
            elif len(types) > 1:  # Q5_0 q/k beside a Q8_0 v: one layer per format, the v int8 groups (Q8_0 exactly)
                assert isinstance(lin, StackedLinear) and [type(p) for p in lin.parts] == [Q5_0Linear, Int8Linear]
    assert native >= 2 * len(model.layers)
    assert model.fused_decode() is not None and 16 + Q5_0Linear.FORMAT.ggml_type in model.fused_decode().kinds
    theirs = _llama_cpp_logits(path)
    for ours in (_logits(model, True), _logits(model, False)):
        agree = compare(ours, theirs)
        assert agree["top1"] >= 0.8 and agree["kl_mean"] < 0.02, agree
    tokenspeed.Engine.load(path, quantize="gguf")  # (writes the cache entry if it is not there)
    warm = load_quantized(resolve_model(path), "gguf")
    assert {k: type(m) for k, m in warm.named_modules()} == {k: type(m) for k, m in model.named_modules()}
    assert torch.equal(warm.layers[0].attention.wo.blocks, model.layers[0].attention.wo.blocks)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-smollm3"])
def test_cli_call_takes_the_q4_k_m_file(name, made, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([
        {"type": "function", "function": {"name": "hold", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "grip", "parameters": {
            "type": "object", "properties": {"state": {"type": "string", "enum": ["open", "close"]}},
            "required": ["state"]}}}]))
    r = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "call", "--model", str(made[name]["Q4_K_M"]),
                        "--quantize", "gguf", "--tools", str(tools), "--prompt", "Close the gripper.",
                        "--max-tokens", "64"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["status"] == "ok" and out["tool_call"]["name"] in ("hold", "grip"), out
    if out["tool_call"]["name"] == "grip":
        assert out["tool_call"]["arguments"]["state"] in ("open", "close")
