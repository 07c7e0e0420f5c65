"""Weight loading: tiny random Llama/Qwen2 models written by the test as safetensors folders and as
GGUF files (F32/F16/Q8_0/Q4_0/Q4_1, Q/K permuted like llama.cpp's converter), compared with
Hugging Face transformers on the same weights; bad paths give clear errors."""
import hashlib
import itertools
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

import tokenspeed
from tokenspeed.weights import ModelLoadError, _file_digest, resolve_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

Q = gguf.GGMLQuantizationType


def _tiny_hf(kind="llama", **overrides):
    base = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    base.update(overrides)
    torch.manual_seed(0)
    classes = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM)}
    config, causal_lm = classes.get(kind, (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    model = causal_lm(config(**base))
    with torch.no_grad():  # HF inits biases to zero and norms to one: give them values so the test sees them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.3)
    return model.eval()


def _copy_tokenizer(dst):
    src = resolve_model(None).folder  # the embedded model's converted tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)


def _compare(model_path, hf_model, atol=1e-4):
    engine = tokenspeed.Engine.load(str(model_path), quantize=None)
    ids = engine.tokenizer.encode("<|im_start|>user\nPick the red cube at x=0.42.<|im_end|>\n")
    # an fp32 KV cache as transformers': this checks the weights (the default fp16 CPU cache moves logits ~2e-4)
    ours = engine.model(torch.tensor(ids), torch.arange(len(ids)), engine.model.new_cache(64, torch.float32), "all")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < atol
    return engine


@pytest.mark.parametrize("kind,extra", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),              # Q/K norms; head_dim != hidden / heads (as Qwen3-0.6B)
    ("smollm3", {"num_hidden_layers": 4, "pad_token_id": None}),  # layer 3 without rotation
])
def test_safetensors_folder_sharded(tmp_path, kind, extra):
    hf_model = _tiny_hf(kind, **extra)
    hf_model.save_pretrained(tmp_path, max_shard_size="2MB", safe_serialization=True)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _copy_tokenizer(tmp_path)
    engine = _compare(tmp_path, hf_model)
    assert engine.args.qkv_bias == (kind == "qwen2") and engine.args.qk_norm == (kind == "qwen3")
    assert engine.args.no_rope_layers == ((3,) if kind == "smollm3" else ())


def _permute(w, n_head):
    # llama.cpp convert_hf_to_gguf's Q/K permutation (Hugging Face halves -> interleaved pairs)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# fp16 fields of each block type (byte offset, power-of-two range of values): blocks written with
# these are exact in bf16 too, so a native load must reproduce the file's values bit for bit
_BLOCK_FIELDS = {Q.Q4_0: [(0, -7)], Q.Q4_1: [(0, -8), (2, -5)], Q.Q4_K: [(0, -12), (2, -12)],
                 Q.Q5_K: [(0, -16), (2, -16)], Q.Q6_K: [(208, -14)], Q.Q5_0: [(0, -10)], Q.Q8_0: [(0, -11)]}
# (Q5_K's small: its kernel quantizes activations per 256, as llama.cpp's Q8_K does, and larger random
# weights make the tiny model amplify that rounding past the logits' tolerance)


def _random_blocks(shape, qtype, rng):
    """Random blocks of `qtype` for a weight of `shape` [N, K]: random codes, power-of-two scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for at, exp in _BLOCK_FIELDS[qtype]:
        sign = -1.0 if at == 2 and qtype == Q.Q4_1 else 1.0  # Q4_1's minimum is negative
        value = sign * np.exp2(rng.integers(exp - 1, exp + 1, raw.shape[:2])).astype(np.float16)
        raw[..., at:at + 2] = value.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def _write_gguf(path, hf_model, qtype, blocks=False):
    """Write hf_model as a llama GGUF with 2-D weights in `qtype` (one type, or GGUF tensor suffix ->
    type with a "*" default); with `blocks`, quantized weights are random blocks (`_random_blocks`)
    instead of hf_model's. Return the dequantized state (what the file holds, Hugging Face layout)."""
    cfg = hf_model.config
    rng = np.random.default_rng(0)
    kinds = qtype if isinstance(qtype, dict) else {"*": qtype}
    from tokenspeed.weights import _gguf_tensors

    src: dict = {}  # the embedded model's metadata: its tokenizer
    _gguf_tensors(tokenspeed.weights.default_model_path(), src)

    arch = "qwen2" if cfg.model_type == "qwen2" else "llama"  # llama.cpp permutes Q/K rows of llama only
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(src["tokenizer.ggml.tokens"])
    w.add_token_types(src["tokenizer.ggml.token_type"])
    w.add_token_merges(src["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(src["tokenizer.chat_template"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias"}
    dequantized = {}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied model's file has no output.weight (llama.cpp's converter)
        arr = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{block[rest]}"
        else:
            gname = names[name]
        stored = arr
        if arch == "llama" and name.endswith("q_proj.weight"):
            stored = _permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            stored = _permute(arr, cfg.num_key_value_heads)
        qtype = kinds.get(gname.split(".")[-2], kinds["*"])
        if arr.ndim == 2 and qtype != Q.F32:
            if blocks and qtype in _BLOCK_FIELDS:
                data = _random_blocks(stored.shape, qtype, rng)
            else:
                data = gguf.quants.quantize(np.ascontiguousarray(stored), qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype).astype(np.float32)
            if arch == "llama" and name.endswith("q_proj.weight"):
                back = _unpermute(back, cfg.num_attention_heads)
            elif arch == "llama" and name.endswith("k_proj.weight"):
                back = _unpermute(back, cfg.num_key_value_heads)
            dequantized[name] = torch.from_numpy(back.reshape(arr.shape))
        else:
            w.add_tensor(gname, np.ascontiguousarray(stored))
            dequantized[name] = t.float()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dequantized


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_file(tmp_path, monkeypatch, qtype):
    # only the weights' cache moves to tmp_path: a new TOKENSPEED_CACHE would rebuild the kernels (~40 s)
    monkeypatch.setattr("tokenspeed.weights.cache_dir", lambda: tmp_path / "cache")
    hf_model = _tiny_hf()
    dequantized = _write_gguf(tmp_path / "tiny.gguf", hf_model, qtype)
    hf_model.load_state_dict(dequantized)  # the reference: transformers on the dequantized weights
    _compare(tmp_path / "tiny.gguf", hf_model)
    # The conversion is cached, content-addressed: a second load reuses it.
    folders = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(folders) == 1 and (folders[0] / "config.json").is_file()
    assert (folders[0] / "model.safetensors").is_file()  # the fp32 reference asked for the weights
    assert resolve_model(tmp_path / "tiny.gguf").folder == folders[0]


def test_q4_k_int4_layer_holds_the_files_values_exactly():
    # Q4KInt4Linear keeps Q4_K's fp16 d, dmin and 6-bit scales: its weights are gguf-py's dequantization of the
    # same blocks bit for bit (any finite fp16 d and dmin), and the kernel's rows agree with the fp32 product
    from tokenspeed.quant import Q4KInt4Linear

    rng = np.random.default_rng(1)
    data = _random_blocks((48, 512), Q.Q4_K, rng)
    data.reshape(48, 2, 144)[..., :4] = rng.integers(0, 256, (48, 2, 4), dtype=np.uint8) & 0x3B
    lin = Q4KInt4Linear.from_blocks(torch.from_numpy(data))
    weight = torch.from_numpy(gguf.quants.dequantize(data, Q.Q4_K).astype(np.float32))
    assert torch.equal(lin.dequantized(), weight)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    exact = x.double() @ weight.double().T
    assert (lin(x).double() - exact).norm() < 0.02 * exact.norm()  # the activations' int8 rounding
    with pytest.raises(ValueError, match="divisible by 256"):
        Q4KInt4Linear.from_blocks(torch.from_numpy(data[:40]))
    corrupt = data.copy()
    corrupt[5, 2:4] = np.array([np.inf], np.float16).view(np.uint8)  # a block's dmin
    with pytest.raises(ValueError, match="non-finite"):
        Q4KInt4Linear.from_blocks(torch.from_numpy(corrupt))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_int4_groups_are_the_blocks(qtype):
    # codes * scale + min of the repacked groups are the file's values, bit for bit (any fp16 scales)
    from tokenspeed.quant import gguf_int4_groups

    rng = np.random.default_rng(1)
    data = _random_blocks((48, 512), qtype, rng)
    data[..., :4] = rng.integers(0, 256, (48, 4), dtype=np.uint8) & 0x3B  # any finite fp16 scales
    codes, scale, minimum = gguf_int4_groups(data, qtype.name)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and codes.shape == (48, 512)
    values = (codes.reshape(48, -1, 32).float() * scale[..., None] + minimum[..., None]).reshape(48, 512)
    assert torch.equal(values, torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)))


# A Q4_K_M-like mix: attn_v, ffn_down and the lm_head in Q6_K, the rest Q4_K
_Q4_K_M = {"*": Q.Q4_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K}
_Q5_K_M = {"*": Q.Q5_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q4_K}  # (an untied Q5_K head)
# Q4_K_M where rows are not whole 256-blocks (Qwen2.5-0.5B's hidden 896; 64 here): llama.cpp's fallbacks,
# Q5_0 for Q4_K and Q8_0 for Q6_K (attn_v), the table and the untied head Q5_0 too
_Q4_K_M_ODD = {"*": Q.Q5_0, "attn_v": Q.Q8_0}


@pytest.mark.parametrize("kind,qtype", [("llama", Q.Q4_0), ("llama", Q.Q4_1), ("qwen2", Q.Q4_K),
                                        ("llama", _Q4_K_M), ("llama", _Q5_K_M), ("qwen2", _Q4_K_M_ODD), ("llama", Q.Q8_0),
                                        ("llama", Q.F16)],
                         ids=["Q4_0", "Q4_1", "Q4_K-qwen2", "Q4_K_M", "Q5_K_M", "Q4_K_M-hidden-64-qwen2", "Q8_0", "F16"])
def test_native_gguf_load_runs_the_files_own_blocks(tmp_path, monkeypatch, kind, qtype):
    # quantize="gguf": weights read from the file without an fp32 copy; Q4_K blocks become Q4KInt4Linear and
    # other 4-bit blocks Int4Linear, holding exactly the file's values (Q4_0 / Q4_1 scales here are exact in
    # bf16), projections of one other block format the kernels run (Q6_K, Q5_0; and such a head, Q4_K too) its
    # BlockLinear holding the file's blocks (the same values), a mix (Q4_K_M's q/k Q4_K with a Q6_K v) a
    # StackedLinear of those, one part per format, other quantized projections (Q8_0)
    # Int8Linear of their dequantized values in groups of 32, float ones stay fp32; the embedding table
    # the file's blocks when of such a format, int8 in groups of 32 (exact for Q8_0) unless float. Logits agree with the
    # fp32 reference on the same file (the kernels quantize activations to int8: W4A8, W5A8, W6A8).
    from tokenspeed.quant import (BLOCK_EMBEDDINGS, BLOCK_LINEARS, Int4Linear, Int8Embedding, Int8Linear, Q4KInt4Linear,
                                  StackedLinear)

    monkeypatch.setattr(tokenspeed.weights, "cache_dir", lambda: tmp_path / "cache")
    k_quants = any(t.name.endswith("_K") for t in (qtype.values() if isinstance(qtype, dict) else [qtype]))
    sizes = dict(hidden_size=256, intermediate_size=512) if k_quants else {}  # K-quant rows: blocks of 256
    _write_gguf(tmp_path / "tiny.gguf", _tiny_hf(kind, **sizes), qtype, blocks=True)
    native = tokenspeed.Engine.load(str(tmp_path / "tiny.gguf"), quantize="gguf")
    assert native.weights == "gguf" and "gguf weights streamed to the quantized cache" in native.load_stages
    folder = resolve_model(tmp_path / "tiny.gguf").folder
    assert not (folder / "model.safetensors").exists()  # no fp32 conversion
    ref = tokenspeed.Engine.load(str(tmp_path / "tiny.gguf"), quantize=None)
    kinds = qtype if isinstance(qtype, dict) else {"*": qtype}
    parts = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "w13": ("ffn_gate", "ffn_up"),
             "w2": ("ffn_down",)}
    def check(ours, one, weight, bias):  # one projection layer of GGUF type `one` against the reference's rows
        if one.name == "Q4_K" and weight.shape[0] % 16 == 0:  # the file's codes and two-level scales
            assert type(ours) is Q4KInt4Linear and torch.equal(ours.dequantized(), weight)
        elif one.name in ("Q4_0", "Q4_1"):
            assert type(ours) is Int4Linear and torch.equal(ours.dequantized(), weight)
        elif one == Q.F16:
            assert type(ours) is torch.nn.Linear and torch.equal(ours.weight, weight)
        elif one.name in BLOCK_LINEARS:
            assert isinstance(ours, BLOCK_LINEARS[one.name])
            assert torch.equal(ours.dequantized(), weight)
        else:
            assert isinstance(ours, Int8Linear) and ours.group == 32
            whole = Int8Linear(weight, group=32)  # made from the whole fp32 weight at once
            assert torch.equal(ours.qweight, whole.qweight) and torch.equal(ours.scales, whole.scales)
        if bias is not None:
            assert torch.equal(ours.bias, bias)

    for layer, ref_layer in zip(native.model.layers, ref.model.layers):
        for name, gnames in parts.items():
            ours = getattr(layer.attention if name in ("wqkv", "wo") else layer.feed_forward, name)
            theirs = getattr(ref_layer.attention if name in ("wqkv", "wo") else ref_layer.feed_forward, name)
            types = [kinds.get(g, kinds["*"]) for g in gnames]
            if len(set(types)) == 1:
                check(ours, types[0], theirs.weight, theirs.bias)
                continue
            # tensors of mixed formats: one part per run of one format, each as stored
            runs = [(t, len(list(run))) for t, run in itertools.groupby(types)]
            assert isinstance(ours, StackedLinear) and len(ours.parts) == len(runs)
            heads = {"attn_q": native.args.n_heads, "attn_k": native.args.n_kv_heads, "attn_v": native.args.n_kv_heads}
            rows = [heads[g] * native.args.head_dim for g in gnames]
            at = 0
            for part, (t, n) in zip(ours.parts, runs):
                end = at + sum(rows[:n])
                check(part, t, theirs.weight[at:end], None if theirs.bias is None else theirs.bias[at:end])
                at, rows = end, rows[n:]
    table, ref_table = native.model.tok_embeddings(torch.arange(native.args.vocab_size)), ref.model.tok_embeddings.weight
    embed = kinds.get("token_embd", kinds["*"])
    assert isinstance(native.model.tok_embeddings, torch.nn.Embedding if embed == Q.F16 else
                      BLOCK_EMBEDDINGS.get(embed.name, Int8Embedding))
    if embed == Q.F16 or embed.name in BLOCK_EMBEDDINGS:  # the file's values
        assert torch.equal(table, ref_table)
    else:  # within half an int8 step of its group of 32 (random blocks: a quantizer's Q8_0 is exact, below)
        assert (table - ref_table).abs().max() <= ref_table.abs().max() / 254
    head = kinds.get("output", kinds["*"])
    if head.name in BLOCK_LINEARS:
        assert isinstance(native.model.output, BLOCK_LINEARS[head.name])
        assert torch.equal(native.model.output.dequantized(), ref.model.output.weight)
    ids = torch.tensor(native.tokenizer.encode("<|im_start|>user\nPick the red cube at x=0.42.<|im_end|>\n"))
    logits = [e.model(ids, torch.arange(len(ids)), e.model.new_cache(64), "all") for e in (native, ref)]
    assert (logits[0] - logits[1]).abs().max() <= 0.05 * logits[1].abs().max()


def test_a_projections_rows_are_its_dequantized_rows_in_hugging_face_order(tmp_path):
    # `load_gguf` makes int8 projections from row blocks: any block of the stacked q/k/v rows (permuted
    # Q/K heads of a llama file back in Hugging Face order) equals those rows of the whole dequantized weight
    from tokenspeed.weights import _gguf_tensors, _projection_rows

    hf_model = _tiny_hf("llama")
    dequantized = _write_gguf(tmp_path / "tiny.gguf", hf_model, Q.Q8_0)
    tensors, _ = _gguf_tensors(tmp_path / "tiny.gguf")
    cfg = hf_model.config
    parts = [tensors[f"blk.0.attn_{x}.weight"] for x in "qkv"]
    rows = _projection_rows(parts, [cfg.num_attention_heads, cfg.num_key_value_heads, None], tmp_path / "tiny.gguf")
    whole = torch.cat([dequantized[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    for a, b in [(0, len(whole)), (3, 5), (1, 37), (cfg.hidden_size - 2, cfg.hidden_size + 3), (len(whole) - 1, len(whole))]:
        assert torch.equal(rows(a, b), whole[a:b]), (a, b)


@pytest.mark.parametrize("qtype,tied", [({"*": Q.Q4_1, "output": Q.Q8_0}, False), (Q.F16, True),
                                        ({"*": Q.Q4_1, "token_embd": Q.Q8_0}, True)],
                         ids=["Q4_1+Q8_0-head", "F16-tied", "Q4_1+Q8_0-tied"])
def test_native_gguf_warm_load_reads_its_blocks_from_the_cache(tmp_path, monkeypatch, qtype, tied):
    # the first quantize="gguf" load reads the file and writes the layers as the kernels hold them
    # to the quantized weights cache; a warm load reads that entry: the same layer classes and
    # tensors (a tied lm_head tied again: the float table, or the Int8Embedding's int8 groups, which
    # the entry holds once), the same logits; a truncated entry is read from the file again and rewritten
    monkeypatch.setattr(tokenspeed.weights, "cache_dir", lambda: tmp_path / "cache")
    _write_gguf(tmp_path / "tiny.gguf", _tiny_hf(tie_word_embeddings=tied), qtype)
    ids = torch.tensor([1, 5, 9, 300, 4000, 17])

    def load():
        engine = tokenspeed.Engine.load(str(tmp_path / "tiny.gguf"), quantize="gguf")
        return engine, engine.model(ids, torch.arange(len(ids)), engine.model.new_cache(32), "all")

    cold, cold_logits = load()
    assert "gguf weights streamed to the quantized cache" in cold.load_stages
    entries = list((tmp_path / "cache" / "quantized").iterdir())
    assert len(entries) == 1
    parts = sorted(entries[0].glob("*.safetensors"))
    assert len(parts) == cold.args.n_layers + 2  # the table, one part per block, then the head and norms
    warm, warm_logits = load()
    assert "gguf weights from the quantized cache" in warm.load_stages and warm.weights == "gguf"
    assert [type(m) for m in warm.model.modules()] == [type(m) for m in cold.model.modules()]
    assert all(torch.equal(t, warm.model.state_dict()[k]) for k, t in cold.model.state_dict().items())
    emb = getattr(warm.model.tok_embeddings, "weight", None)  # an Int8Embedding has no float weight
    codes = getattr(warm.model.tok_embeddings, "qweight", None)  # ... but int8 groups
    for model in (cold.model, warm.model):
        shared = [getattr(model.output, "weight", None) is getattr(model.tok_embeddings, "weight", 0),
                  getattr(model.output, "qweight", None) is getattr(model.tok_embeddings, "qweight", 0)
                  and model.output.scales is model.tok_embeddings.scales]
        assert any(shared) == tied and shared[0] == (emb is not None and tied)
    if codes is not None and tied:  # the head is the file's Q8_0 table, stored once in the entry
        for part in parts:
            with safe_open(str(part), "pt") as f:
                assert not any(k.startswith("output.") for k in f.keys())
    assert torch.equal(warm_logits, cold_logits)
    parts[0].write_bytes(parts[0].read_bytes()[:1000])  # the table's part
    again, again_logits = load()
    assert "gguf weights streamed to the quantized cache" in again.load_stages
    assert torch.equal(again_logits, cold_logits) and parts[0].stat().st_size > 1000


@pytest.mark.parametrize("fault", ["folder under a file", "file size limit"])
def test_native_gguf_load_without_a_writable_cache_reads_the_file_into_memory(tmp_path, monkeypatch, caplog, fault):
    # real write failures (root bypasses permissions): the entry's folder would sit under a regular file
    # (OSError at its mkdir), or the process's file size limit (RLIMIT_FSIZE, SIGXFSZ ignored: the
    # write fails with EFBIG, as a full disk fails with ENOSPC; safetensors raises its own error) stops the
    # first part midway. The load logs it and reads the file's blocks into memory instead: the same model
    # and logits, and no temporary folder left behind
    import resource
    import signal

    monkeypatch.setattr(tokenspeed.weights, "cache_dir", lambda: tmp_path / "cache")
    _write_gguf(tmp_path / "tiny.gguf", _tiny_hf(), {"*": Q.Q4_1, "output": Q.Q8_0})
    ids = torch.tensor([1, 5, 9, 300, 4000, 17])
    cached = tokenspeed.Engine.load(str(tmp_path / "tiny.gguf"), quantize="gguf")  # the tokenizer's files too
    quantized = tmp_path / "cache" / "quantized"
    shutil.rmtree(quantized)
    if fault == "folder under a file":
        quantized.write_text("a file, not a folder")
    else:
        limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        with caplog.at_level("WARNING", logger="tokenspeed.weights"):
            uncached = tokenspeed.Engine.load(str(tmp_path / "tiny.gguf"), quantize="gguf")
    finally:
        if fault == "file size limit":
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, handler)
    assert "gguf weights from the file" in uncached.load_stages
    assert "quantized weights not cached" in caplog.text
    if fault == "file size limit":  # the part written midway went with its temporary folder
        assert not list(quantized.glob(".*.tmp"))
    assert [type(m) for m in uncached.model.modules()] == [type(m) for m in cached.model.modules()]
    logits = [e.model(ids, torch.arange(len(ids)), e.model.new_cache(32), "all") for e in (cached, uncached)]
    assert torch.equal(logits[0], logits[1])


def test_a_quantized_cache_entry_replaces_a_stray_file_and_the_folders_of_killed_writers(tmp_path, monkeypatch):
    # a regular file where the entry goes (it would block every later entry) is replaced by the entry; a
    # temporary folder whose writer is gone (a killed load: a pid that no process has) is removed by the next
    # writer, a running writer's is kept
    monkeypatch.setattr(tokenspeed.weights, "cache_dir", lambda: tmp_path / "cache")
    _write_gguf(tmp_path / "tiny.gguf", _tiny_hf(), {"*": Q.Q4_1, "output": Q.Q8_0})
    files = resolve_model(tmp_path / "tiny.gguf")
    path = tokenspeed.weights._quantized_path(files, "gguf")
    path.parent.mkdir(parents=True)
    path.write_text("stray")
    dead = path.with_name(f".{path.name}.{_finished_pid()}.tmp")
    alive = path.with_name(f".{path.name}.1.tmp")  # pid 1 is always running
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "part-00000.safetensors").write_bytes(b"partial")
    engine = tokenspeed.Engine.load(str(tmp_path / "tiny.gguf"), quantize="gguf")
    assert "gguf weights streamed to the quantized cache" in engine.load_stages
    assert path.is_dir() and len(list(path.glob("*.safetensors"))) == engine.args.n_layers + 2
    assert not dead.exists() and alive.is_dir()


def _finished_pid() -> int:
    # the pid of a child process that has exited and been reaped (no process has it, barring reuse)
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_native_q4_1_load_equals_dequantize_then_int4(tmp_path, monkeypatch):
    # a Q4_1 file from a min/max quantizer (gguf's, like llama.cpp's): re-quantizing its dequantized
    # weights (quantize="int4") finds the same codes, so the native load and int4 differ only by
    # the rounding of scales and minimums; the Q8_0 head is the file's blocks exactly (int8 in groups of
    # 32), where int4's head re-quantizes it to one scale per row
    monkeypatch.setattr(tokenspeed.weights, "cache_dir", lambda: tmp_path / "cache")
    _write_gguf(tmp_path / "tiny.gguf", _tiny_hf(), {"*": Q.Q4_1, "output": Q.Q8_0})
    native, int4, ref = (tokenspeed.Engine.load(str(tmp_path / "tiny.gguf"), quantize=q) for q in ("gguf", "int4", None))
    for a, b in zip(native.model.modules(), int4.model.modules()):
        assert type(a) is type(b)
        if hasattr(a, "codes"):
            assert torch.equal(a.codes, b.codes)
            assert torch.allclose(a.scales.float(), b.scales.float(), rtol=2 ** -7, atol=0)
    assert native.model.output.group == 32 and torch.equal(native.model.output.dequantized(), ref.model.output.weight)
    ids = torch.tensor(native.tokenizer.encode("<|im_start|>user\nPick the red cube at x=0.42.<|im_end|>\n"))
    logits = [e.model(ids, torch.arange(len(ids)), e.model.new_cache(64), "all") for e in (native, int4)]
    assert (logits[0] - logits[1]).abs().max() <= 1e-2 * logits[1].abs().max()


def test_native_gguf_needs_a_gguf_file_on_the_cpu(tmp_path):
    _tiny_hf().save_pretrained(tmp_path / "m", safe_serialization=True)
    _copy_tokenizer(tmp_path / "m")
    for model in (str(tmp_path / "m"), "tiny-random"):
        with pytest.raises(tokenspeed.EngineArgumentError, match="not a .gguf file"):
            tokenspeed.Engine.load(model, quantize="gguf")
    with pytest.raises(tokenspeed.EngineArgumentError, match="in torch.bfloat16"):
        tokenspeed.Engine.load(None, quantize="gguf", dtype="bfloat16")


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_weights_are_cached_and_a_bad_entry_is_rebuilt(tmp_path, monkeypatch, fmt):
    # a warm load reads the packed weights instead of reading fp32 and quantizing: same tensors,
    # same logits; a truncated cache entry is quantized again and rewritten. (Only the weights'
    # cache moves to tmp_path: a new TOKENSPEED_CACHE would rebuild the kernels, ~1 min.)
    monkeypatch.setattr(tokenspeed.weights, "cache_dir", lambda: tmp_path / "cache")
    _tiny_hf(tie_word_embeddings=True).save_pretrained(tmp_path / "m", safe_serialization=True)
    _copy_tokenizer(tmp_path / "m")
    ids = torch.tensor([1, 5, 9, 300, 4000, 17])

    def load():
        engine = tokenspeed.Engine.load(str(tmp_path / "m"), quantize=fmt)
        logits = engine.model(ids, torch.arange(len(ids)), engine.model.new_cache(32), "all")
        return engine, logits

    cold, cold_logits = load()
    assert f"quantize {fmt}" in cold.load_stages and "quantized cache written" in cold.load_stages
    entries = list((tmp_path / "cache" / "quantized").iterdir())
    assert len(entries) == 1
    (part,) = entries[0].glob("*.safetensors")
    warm, warm_logits = load()
    assert list(warm.load_stages)[2] == f"{fmt} weights from the quantized cache" and warm.weights == fmt
    assert torch.equal(warm_logits, cold_logits)
    assert all(torch.equal(t, warm.model.state_dict()[k]) for k, t in cold.model.state_dict().items())
    # the tied head is the table's int8 groups in both loads (the entry holds them once)
    assert all(e.model.output.qweight is e.model.tok_embeddings.qweight for e in (cold, warm))
    part.write_bytes(part.read_bytes()[:1000])
    again, again_logits = load()
    assert f"quantize {fmt}" in again.load_stages and torch.equal(again_logits, cold_logits)
    assert part.stat().st_size > 1000
    assert "total" in warm.load_stages.table()


def test_load_stages_record_the_resident_set(engine):
    # each stage of a load closes with the process's RSS and its peak so far (VmRSS, VmHWM): where a load's memory goes
    stages = engine.load_stages
    assert list(stages.memory) == list(stages) and "tokenizer" in stages.memory
    peaks = [peak for _, peak in stages.memory.values()]
    assert peaks == sorted(peaks) and all(0 < rss <= peak for rss, peak in stages.memory.values())
    assert 0 < stages.start_memory[0] <= peaks[0]
    assert "RSS MiB" in stages.table() and "  tokenizer " in stages.table()
    assert engine.load_s >= sum(wall for wall, _ in stages.values())  # load_s: the whole load, every stage


def test_load_runs_without_cyclic_collections_and_restores_the_collector(monkeypatch):
    # no collection from the load's start to its end (gc.callbacks sees every collection; counted inside the
    # load, where the collector is off: after it, the collector may run); left as the caller had it
    import gc

    seen, during = [], []
    real = tokenspeed.Engine._load.__func__

    def counted(cls, *args):  # the real load, its collections counted
        before = len(seen)
        engine = real(cls, *args)
        during.append((len(seen) - before, gc.isenabled()))
        return engine

    def record(phase, info):
        seen.append((phase, info["generation"]))

    monkeypatch.setattr(tokenspeed.Engine, "_load", classmethod(counted))
    gc.callbacks.append(record)
    try:
        for enabled in (True, False):
            if enabled:
                gc.enable()
            else:
                gc.disable()
            engine = tokenspeed.Engine.load("tiny-random")
            assert engine.weights == "fp32" and gc.isenabled() is enabled
        assert during == [(0, False), (0, False)]
        gc.collect()
        assert seen  # the callback does see collections
    finally:
        gc.callbacks.remove(record)
        gc.enable()


def test_embedded_model_loads_and_caches(engine):
    files = resolve_model(None)
    cfg = json.loads((files.folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["tie_word_embeddings"] is True
    assert engine.args.vocab_size == 49152


def _missing(p):
    return p / "missing.gguf"


def _empty_folder(p):
    (p / "empty").mkdir()
    return p / "empty"


def _folder_without_weights(p):
    (p / "noweights").mkdir()
    (p / "noweights" / "config.json").write_text("{}")
    return p / "noweights"


def _not_a_model(p):
    (p / "model.bin").write_bytes(b"\x00" * 64)
    return p / "model.bin"


def _corrupt_gguf(p):
    (p / "bad.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    return p / "bad.gguf"


def _truncated_gguf(p):  # the embedded model's first 100 kB: its vocabulary cut short
    with open(tokenspeed.weights.default_model_path(), "rb") as f:
        (p / "cut.gguf").write_bytes(f.read(100_000))
    return p / "cut.gguf"


def _gguf_without_its_last_tensor_bytes(p):  # the whole index, the last tensor's data cut short
    data = tokenspeed.weights.default_model_path().read_bytes()
    (p / "short.gguf").write_bytes(data[:-4096])
    return p / "short.gguf"


@pytest.mark.parametrize("make,needle", [
    (_missing, "does not exist"),
    (_truncated_gguf, r"ends \(100,000 bytes\) before its header and tensor index do: truncated or corrupt"),
    (_gguf_without_its_last_tensor_bytes, "runs past the end of the file .*: truncated"),
    (_empty_folder, "without config.json"),
    (_folder_without_weights, "no [*].safetensors"),
    (_not_a_model, "neither a .gguf"),
    (_corrupt_gguf, "cannot parse GGUF"),
])
def test_bad_model_paths(tmp_path, monkeypatch, make, needle):
    monkeypatch.setenv("TOKENSPEED_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=needle):
        tokenspeed.Engine.load(str(make(tmp_path)))


def test_auto_runs_a_quantized_gguf_files_own_blocks_without_an_fp32_copy(tmp_path, monkeypatch):
    # quantize="auto" on a GGUF file with quantized blocks runs them ("gguf"): no format measured,
    # no fp32 conversion written to the cache (cold or warm); a float GGUF file is measured as before
    monkeypatch.setattr("tokenspeed.weights.cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr("tokenspeed.engine.cache_dir", lambda: tmp_path / "cache")  # imports it when run alone
    _write_gguf(tmp_path / "tiny.gguf", _tiny_hf(), Q.Q4_1)
    for _ in range(2):
        engine = tokenspeed.Engine.load(str(tmp_path / "tiny.gguf"))
        assert engine.weights == "gguf" and engine.weight_choice is None
        assert "auto weights: the GGUF file's own blocks" in engine.load_stages
        assert "auto weights: format measured" not in engine.load_stages
    assert not list((tmp_path / "cache").rglob("model.safetensors"))     # the fp32 conversion's file
    _write_gguf(tmp_path / "float.gguf", _tiny_hf(), Q.F32)
    floating = tokenspeed.Engine.load(str(tmp_path / "float.gguf"))
    assert set(floating.weight_choice.timings) == {"fp32", "int8", "int4"}
    assert "auto weights: format measured" in floating.load_stages


def test_embedded_model_runs_its_own_q4_1_blocks(engine):
    # the embedded SmolLM2 Q4_1 file loaded natively: its codes are the ones int4 re-derives from the
    # fp32 conversion (llama.cpp's Q4_1 quantizer uses each group's min and max), its embedding rows are
    # the file's, the greedy tokens
    # of both agree, and the top-1 of the last position matches the fp32 reference
    from tokenspeed.quant import Int4Linear

    native, int4 = (tokenspeed.Engine.load(quantize=q) for q in ("gguf", "int4"))
    layers = [(a, b) for a, b in zip(native.model.modules(), int4.model.modules()) if isinstance(a, Int4Linear)]
    assert len(layers) == 4 * native.args.n_layers
    assert all(torch.equal(a.codes, b.codes) for a, b in layers)
    # the Q8_0 embedding table, held in int8 (a quarter of fp32's memory), looks up the file's values
    every = torch.arange(engine.args.vocab_size)
    assert all(torch.equal(e.model.tok_embeddings(every), engine.model.tok_embeddings.weight) for e in (native, int4))
    prompt = engine.tokenizer.encode("<|im_start|>user\nPick up the red cube at x=0.42.<|im_end|>\n<|im_start|>assistant\n")
    outs = []
    for e in (native, int4, engine):
        ids, cache = list(prompt), e.model.new_cache(len(prompt) + 16)
        logits = e.model(torch.tensor(ids), torch.arange(len(ids)), cache, "last")
        for _ in range(12):
            ids.append(int(logits[-1].argmax()))
            logits = e.model(torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]), cache, "last")
        outs.append(ids[len(prompt):])
    assert outs[0] == outs[1] and outs[0][0] == outs[2][0]


def test_a_gguf_files_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    # the digest that names a GGUF's converted folder is hashed once per file version, not per load
    monkeypatch.setenv("TOKENSPEED_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + b"\x01" * 100)
    assert _file_digest(f) == hashlib.sha256(f.read_bytes()).hexdigest()[:24]
    assert not (tmp_path / "cache" / "digests").exists()    # just written: not remembered yet
    os.utime(f, (1e9, 1e9))
    first = _file_digest(f)
    (memo,) = (tmp_path / "cache" / "digests").iterdir()
    memo.write_text("m" * 24)                       # a remembered digest is read, not recomputed
    assert _file_digest(f) == "m" * 24
    f.write_bytes(b"GGUF" + b"\x02" * 100)          # a new version of the file (same size) is hashed again
    os.utime(f, (1e9, 1e9))
    assert _file_digest(f) == hashlib.sha256(f.read_bytes()).hexdigest()[:24] != first


def test_gguf_metadata_is_what_the_gguf_package_reads():
    # the cold load's own metadata reader (no numpy array per vocabulary string) against gguf.GGUFReader:
    # every key of the embedded model, its vocabulary, token types and merges included
    from tokenspeed.weights import _gguf_tensors

    path = tokenspeed.weights.default_model_path()
    meta: dict = {}
    tensors, _ = _gguf_tensors(path, meta)
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and len(meta["tokenizer.ggml.merges"]) > 40000
    assert meta == fields
    assert sorted(tensors) == sorted(t.name for t in reader.tensors)
    assert _gguf_tensors(path)[0].keys() == tensors.keys()  # the metadata skipped: the same index


def test_whether_a_gguf_is_quantized_is_remembered_beside_its_header(tmp_path, monkeypatch):
    # a warm load reads the answer (no index walk, no `gguf` import); the folder is the file's digest
    from tokenspeed.weights import gguf_quantized

    monkeypatch.setenv("TOKENSPEED_CACHE", str(tmp_path / "cache"))
    files = resolve_model(None)
    assert gguf_quantized(files) is True
    memo = files.folder / "gguf_quantized.json"
    assert json.loads(memo.read_text()) == {"quantized": True}
    memo.write_text('{"quantized": false}')  # read back, not recomputed
    assert gguf_quantized(files) is False
    memo.write_text("not json")  # unreadable: the index again, and remembered again
    assert gguf_quantized(files) is True and json.loads(memo.read_text()) == {"quantized": True}
