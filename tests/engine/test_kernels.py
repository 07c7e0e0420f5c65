"""Kernels: the attention-with-mass torch path against SDPA; the Triton attention and fused RMSNorm
kernels (run by the Triton interpreter on CPU) against SDPA and the torch paths, alone and through
the model's CUDA dispatch."""
import pytest
import torch
import torch.nn.functional as F

from tokenspeed.kernels import attention_with_mass


def _qkv(H=9, Hkv=3, T=5, S=40, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, S, D, generator=g),
            torch.randn(1, Hkv, S, D, generator=g))


@pytest.mark.parametrize("masked", [False, True])
def test_torch_path_matches_sdpa_and_mass_sums_to_queries(masked):
    q, k, v = _qkv()
    T, S = q.shape[2], k.shape[2]
    mask = None
    if masked:  # cached slots visible, causal among the new tokens (as Transformer.forward builds it)
        mask = torch.ones(T, S, dtype=torch.bool)
        mask[:, S - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    out, mass, lse = attention_with_mass(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert mass.shape == (S,) and lse.shape == (9, T)
    torch.testing.assert_close(mass.sum(), torch.tensor(9.0 * T))  # each (head, query) spreads 1
    if masked:
        assert float(mass[-1]) > 0 and torch.all(mass >= 0)
    # mass is the sum of softmax probabilities: check one slot by hand
    s = (q[0] @ k[0].repeat_interleave(3, 0).transpose(-1, -2)) / 8.0
    if masked:
        s = s.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(mass[3], s.softmax(-1)[..., 3].sum(), atol=1e-5, rtol=1e-5)


def test_torch_path_rejects_bad_shapes():
    q, k, v = _qkv(H=8, Hkv=3)
    with pytest.raises(ValueError):
        attention_with_mass(q, k, v, None)


def _verify_mask(T, S):
    # as Transformer.forward builds it: cached slots visible, causal among the T new rows
    mask = torch.ones(T, S, dtype=torch.bool)
    mask[:, S - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    return mask


# (H, Hkv, D): SmolLM2's 9/3 heads of 64, plain multi-head, and an 8:1 GQA group of a non-power-of-2 D
@pytest.mark.parametrize("H,Hkv,D,T,S", [(9, 3, 64, 1, 1), (9, 3, 64, 1, 300), (9, 3, 64, 4, 70),
                                         (4, 4, 32, 7, 300), (8, 1, 48, 1, 70), (8, 1, 48, 3, 130)])
def test_triton_attention_matches_sdpa_and_torch_mass(H, Hkv, D, T, S):
    """Values against torch SDPA, mass and log-sum-exp against the torch path, with GQA, ragged
    slot counts (not multiples of the tile or split), cache slices and verification's mask."""
    pytest.importorskip("triton")
    from tokenspeed.kernels import triton_decode
    q, _, _ = _qkv(H=H, Hkv=Hkv, T=T, D=D, seed=S)
    _, kc, vc = _qkv(H=H, Hkv=Hkv, T=T, S=320, D=D, seed=S + 1)
    k, v = kc[:, :, :S], vc[:, :, :S]  # a prefix slice of a larger cache, as the model passes it
    mask = _verify_mask(T, S) if T > 1 else None
    out, mass, lse = triton_decode.decode_attention_with_mass(q, k, v, mask, block_s=32, slots_per_split=128)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    _, ref_mass, ref_lse = attention_with_mass(q, k, v, mask)
    torch.testing.assert_close(mass, ref_mass, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.sum(), torch.tensor(float(H * T)))


def test_triton_attention_bf16_and_a_fully_masked_tile():
    """bf16 inputs (the CUDA dtype): fp32 math inside, within bf16 rounding of the torch path; a
    mask that hides a whole leading tile of slots leaves no NaN."""
    pytest.importorskip("triton")
    from tokenspeed.kernels import triton_decode
    q, k, v = (x.to(torch.bfloat16) for x in _qkv(T=3, S=200))
    mask = _verify_mask(3, 200)
    mask[:, :64] = False
    out, mass, lse = triton_decode.decode_attention_with_mass(q, k, v, mask, block_s=32, slots_per_split=64)
    ref_out, ref_mass, ref_lse = attention_with_mass(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-4, rtol=1e-4)
    assert float(mass[:64].abs().max()) == 0.0


def test_triton_attention_rejects_bad_input():
    pytest.importorskip("triton")
    from tokenspeed.kernels import triton_decode
    q, k, v = _qkv(T=2)
    with pytest.raises(ValueError, match="mask"):
        triton_decode.decode_attention_with_mass(q, k, v, torch.ones(3, k.shape[2], dtype=torch.bool))
    with pytest.raises(ValueError, match="shapes"):
        triton_decode.decode_attention_with_mass(_qkv(H=8, Hkv=3)[0], k, v)
    with pytest.raises(ValueError, match="contiguous"):
        triton_decode.decode_attention_with_mass(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_triton_add_rms_norm_matches_torch(dtype, residual):
    """The fused RMSNorm(+residual) kernel against the model's torch norm. fp32: the sum
    bit-identical, the rows within fp32 rounding (the sum of squares runs in another order). bf16:
    Triton's interpreter rounds fp32 -> bf16 toward zero where CUDA and torch round to nearest, so
    here the sum is within one bf16 step and the rows within three (one per rounding)."""
    pytest.importorskip("triton")
    from tokenspeed.kernels.norm import add_rms_norm
    from tokenspeed.kernels.triton_norm import triton_add_rms_norm
    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, 5, 576, generator=g).to(dtype)
    delta = torch.randn(1, 5, 576, generator=g).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    s, y = triton_add_rms_norm(h, delta, w, 1e-5)
    ref_s, ref_y = add_rms_norm(h, delta, w, 1e-5)
    assert s.dtype == dtype and y.dtype == dtype and y.shape == h.shape
    if dtype == torch.float32:
        assert torch.equal(s, ref_s)
        torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(s, ref_s, atol=0, rtol=2**-7)
        torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=3 * 2**-7)
    with pytest.raises(ValueError, match="shapes"):
        triton_add_rms_norm(h, None, w[:10], 1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "smollm3"])
def test_model_dispatch_to_triton_kernels_keeps_logits_and_relevance(monkeypatch, family):
    """The CUDA dispatch of a pruned cache's forwards (Triton attention for decode and verification
    rows, fused norms), run on CPU tensors by the interpreter: this test adds "cpu" to the devices
    the kernels take (the only fake: no GPU here). Logits and relevance scores match the torch path,
    for Qwen3's Q/K norms and SmolLM3's NoPE layer too (torch code around the kernels, as in a CUDA graph)."""
    pytest.importorskip("triton")
    from tokenspeed.kernels import attention
    from tokenspeed.kv import KVConfig, TieredKVCache
    from tokenspeed.model import ModelArgs, Transformer

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=256,
                     max_seq_len=256, qk_norm=family == "qwen3", no_rope_layers=(1,) if family == "smollm3" else ())
    torch.manual_seed(0)
    model = Transformer(args).eval()
    for layer in model.layers if family == "qwen3" else ():
        for w in (layer.attention.q_norm, layer.attention.k_norm):
            w.data.uniform_(0.5, 1.5)
    model.use_fused = False
    ids = torch.randint(0, 256, (60,))

    def run():
        cache = TieredKVCache(args, KVConfig(budget=96, reserve=32, page=8, cold=0))
        outs = [model(ids[:40], torch.arange(40), cache, "last")]           # prefill: torch path (40 rows)
        outs.append(model(ids[40:41], torch.arange(40, 41), cache, "last"))  # decode: 1 row
        outs.append(model(ids[41:46], torch.arange(41, 46), cache, "all"))   # verification: 5 rows, masked
        return outs, cache.score[:cache.n].clone()

    ref, ref_score = run()
    monkeypatch.setattr(attention, "TRITON_DEVICES", ("cuda", "cpu"))
    for fused_norm in (False, True):
        monkeypatch.setattr(Transformer, "use_triton_norm", fused_norm)
        got, score = run()
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(score, ref_score, atol=1e-6, rtol=1e-5)
